"""Training benchmark; same as `paraloom bench training`. Run: python benchmarks/training.py"""

import argparse

from paraloom.bench.training import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="paraloom training benchmark")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
