"""Spark training benchmark; same as `paraloom bench spark`. Run: python benchmarks/spark.py"""

import argparse

from paraloom.bench.spark import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="paraloom Spark training benchmark")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
