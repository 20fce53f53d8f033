"""LeNet behind ``paraloom serve`` vs LitServe under wrk; see ``paraloom bench serving --help``."""

from paraloom.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
