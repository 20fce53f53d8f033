"""LeNet behind ``paraloom serve`` (HTTP, gRPC), MLServer and LitServe: ``--help`` says more."""

from paraloom.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
