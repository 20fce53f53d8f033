"""Input-pipeline benchmark; same as `paraloom bench data`. Run: python benchmarks/data.py"""

import argparse

from paraloom.bench.data import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="paraloom input-pipeline benchmark")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
