"""Convergence benchmark; same as `paraloom bench convergence`. Run: python benchmarks/convergence.py"""

import argparse

from paraloom.bench.convergence import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="paraloom convergence benchmark")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
