"""The ``paraloom`` command: train | evaluate | serve | spark-train | bench."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

__all__ = ["main", "add_data_arguments"]

# Sub-commands that live in their own modules: name -> (module, help).
_DELEGATED = {
    "serve": ("paraloom.serving.cli", "serve a model over HTTP (Open Inference Protocol v2)"),
    "spark-train": ("paraloom.spark.cli", "train on an Apache Spark cluster (local[2] by default)"),
}
_BENCHES = {
    "training": "paraloom.bench.training",
    "inference": "paraloom.bench.inference",
    "serving": "paraloom.bench.serving",
    "spark": "paraloom.bench.spark",
    "faults": "paraloom.bench.faults",
    "convergence": "paraloom.bench.convergence",
    "data": "paraloom.bench.data",
}


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """--dataset, --data-dir and --batch-size, shared by the training commands."""
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    p.add_argument("--data-dir", help="folder with MNIST's IDX files (.gz or raw)")
    p.add_argument("--batch-size", type=int, default=32)


def _train(args: argparse.Namespace) -> int:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    import paraloom
    from paraloom.datasets import load_dataset
    from paraloom.evaluation import evaluate
    from paraloom.models import build_model

    torch.manual_seed(args.seed)
    train = load_dataset(args.dataset, "train", args.data_dir)
    test = load_dataset(args.dataset, "test", args.data_dir)
    model = build_model(args.model, train[0][0].shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                nesterov=args.momentum > 0)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    mode_options = {"averaging_frequency": args.averaging_frequency} \
        if args.mode == "averaging" else {}
    with paraloom.ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer,
                                  workers=args.workers, training_mode=args.mode,
                                  **mode_options) as wrapper:
        stats = wrapper.fit(loader, epochs=args.epochs)
    result = evaluate(model, DataLoader(test, batch_size=256))
    print(f"test accuracy {result.accuracy:.4f}  ({stats['samples_per_s']:.0f} samples/s, "
          f"{args.workers} workers, {args.mode})")
    if args.out:
        paraloom.save(model, args.out, metadata={"dataset": args.dataset})
        print(f"saved {args.out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from torch.utils.data import DataLoader

    import paraloom
    from paraloom.datasets import load_dataset
    from paraloom.evaluation import evaluate

    model = paraloom.load(args.model_file)
    test = load_dataset(args.dataset, "test", args.data_dir)
    result = evaluate(model, DataLoader(test, batch_size=256))
    print(result.report())
    if args.json:
        print(json.dumps(result.metrics()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    return int(args.bench_module.run(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paraloom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model with ParallelWrapper and save it")
    p.add_argument("--model", default="lenet", choices=["lenet", "mlp"])
    add_data_arguments(p)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", default="averaging",
                   choices=["averaging", "shared_gradients", "allreduce"])
    p.add_argument("--averaging-frequency", type=int, default=3,
                   help="rounds between averaging steps (averaging mode)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="where to save the model (.safetensors)")
    p.set_defaults(func=_train)

    p = sub.add_parser("evaluate", help="accuracy and confusion matrix of a saved model")
    p.add_argument("model_file")
    add_data_arguments(p)
    p.add_argument("--json", action="store_true", help="also print the metrics as JSON")
    p.set_defaults(func=_evaluate)

    for name, (module, help_text) in _DELEGATED.items():
        p = sub.add_parser(name, help=help_text)
        _attach(p, module)

    p = sub.add_parser("bench", help="benchmarks: ratios against baselines, written as JSON")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name, module in _BENCHES.items():
        _attach(bench_sub.add_parser(name, help=f"the {name} benchmark"), module,
                bench=True)
    return parser


def _attach(p: argparse.ArgumentParser, module_name: str, bench: bool = False) -> None:
    """Let a module add its own arguments; commands whose extra is missing say how to get it."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=lambda _a, e=e: _missing(e))
        return
    module.add_arguments(p)
    if bench:
        p.set_defaults(func=_bench, bench_module=module)
    else:
        p.set_defaults(func=module.run)


def _missing(error: ImportError) -> int:
    print(f"this command needs an optional dependency: {error}. Install it with "
          "pip install 'paraloom[serve]' (or [spark], [bench])", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: say so without a traceback
        parser.exit(2, f"paraloom {args.command}: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
