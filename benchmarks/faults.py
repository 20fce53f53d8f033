"""Fault-tolerance benchmark; same as `paraloom bench faults`. Run: python benchmarks/faults.py"""

import argparse

from paraloom.bench.faults import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="paraloom fault-tolerance benchmark")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
