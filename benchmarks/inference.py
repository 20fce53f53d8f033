"""Inference benchmark; same as `paraloom bench inference`. Run: python benchmarks/inference.py"""

from paraloom.bench.inference import main

if __name__ == "__main__":
    raise SystemExit(main())
