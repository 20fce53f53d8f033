"""The ``paraloom`` command: train | evaluate | serve | spark-train | bench."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paraloom._version import __version__
from paraloom.arguments import count
from paraloom.errors import ParaloomError, WorkerError

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import DataLoader

    from paraloom.devices import DeviceSpec
    from paraloom.training.options import WrapperKeywords

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


def add_data_arguments(p: argparse.ArgumentParser, *, per_worker: bool = True) -> None:
    """--dataset, --data-dir and --batch-size, shared by the training and evaluating commands
    (``per_worker``: a training command's batches go one to a worker)."""
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist"],
                   help="the built-in data set (default digits: scikit-learn's 8x8 digits)")
    p.add_argument("--data-dir", help="folder with MNIST's IDX files (.gz or raw)")
    p.add_argument("--batch-size", type=count, default=32,
                   help="rows per batch (" + ("per worker; " if per_worker else "")
                   + "default 32)")


def _train(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    import paraloom

    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr}; expected a finite learning rate > 0, e.g. 0.05")
    if not 0 <= args.momentum < 1:
        raise ValueError(f"--momentum {args.momentum}; expected a value in [0, 1), e.g. 0.9")
    if args.out:
        check_writable(args.out)
    torch.manual_seed(args.seed)
    model, loader, test = _training_setup(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                nesterov=args.momentum > 0)
    mode_options = _mode_options(args)
    loss_fn = nn.CrossEntropyLoss() if args.loss == "cross_entropy" else nn.MSELoss()
    interrupted = None
    with paraloom.ParallelWrapper(model, loss_fn=loss_fn, optimizer=optimizer,
                                  workers=args.workers, devices=_devices(args),
                                  training_mode=args.mode, **mode_options) as wrapper:
        try:
            stats = wrapper.fit(loader, epochs=args.epochs)
        except paraloom.FitInterrupted as e:  # Ctrl-C: report and save what was trained
            interrupted, stats = e, wrapper.stats()
    speed = (f"{stats['samples_per_s']:.0f} samples/s, {wrapper.workers} workers, "
             f"{args.mode}")
    if args.out:  # first: a failing evaluation must not lose what was trained
        _save_trained(model, args)
    if test is None:
        print(f"trained {stats['samples']} samples ({speed})")
    elif args.loss == "cross_entropy":
        from paraloom.evaluation import evaluate

        print(f"test accuracy {evaluate(model, test).accuracy:.4f}  ({speed})")
    else:
        print(f"test mse {_mean_loss(model, test, nn.MSELoss()):.6g}  ({speed})")
    if interrupted is not None:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130  # what a shell reports for a program ended by Ctrl-C
    return 0


def _devices(args: argparse.Namespace) -> DeviceSpec:
    """``--devices``, checked as ParallelWrapper checks ``devices=``, its errors naming the
    flag."""
    from paraloom.devices import parse_devices, training_devices

    devices = parse_devices(args.devices)
    try:
        training_devices(devices, args.workers)
    except ValueError as e:
        raise ValueError(f"--devices {args.devices}: {e}") from None
    return devices


def _mode_options(args: argparse.Namespace) -> WrapperKeywords:
    """The options of ``--mode`` (each mode's own; another mode's is refused, not ignored)."""
    given = {"averaging": ("--averaging-frequency", args.averaging_frequency),
             "diloco": ("--sync-every", args.sync_every)}
    for mode, (flag, value) in given.items():
        if value is not None and args.mode != mode:
            raise ValueError(f"{flag} is an option of --mode {mode}, and the mode is "
                             f"{args.mode}; drop it, or pass --mode {mode}")
    if args.mode == "averaging":
        return {"averaging_frequency": 3 if args.averaging_frequency is None
                else args.averaging_frequency}
    if args.mode == "diloco" and args.sync_every is not None:
        return {"sync_every": args.sync_every}
    return {}


def check_writable(out: str, flag: str = "--out", example: str = "model.safetensors") -> None:
    """Refuse a file to write (``--out``) that cannot be written, before anything trains."""
    path = Path(out)
    if path.is_dir():
        raise ValueError(f"{flag} {out} is a directory; give a file path, e.g. "
                         f"{path / example}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {out}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {out}: the folder {parent} is not writable")


def _training_setup(args: argparse.Namespace
                    ) -> tuple[nn.Module, DataLoader[Any], DataLoader[Any] | None]:
    """(model, training loader, test loader or None): built-in or the user's (--factory,
    --data, --test-data)."""
    from torch.utils.data import DataLoader

    from paraloom.user_code import build_user_model, user_data

    if args.test_data is not None and args.data is None:
        raise ValueError("--test-data goes with --data (your training data); without --data "
                         "the test split of --dataset is used")
    if args.data is not None:
        loader = user_data(args.data, "--data", args.batch_size, shuffle=True)
        test = user_data(args.test_data, "--test-data", 256, shuffle=False) \
            if args.test_data else None
    else:
        from paraloom.datasets import load_dataset

        train = load_dataset(args.dataset, "train", args.data_dir)
        loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
        test = DataLoader(load_dataset(args.dataset, "test", args.data_dir), batch_size=256)
    if args.factory is not None:
        return build_user_model(args.factory), loader, test
    if args.data is not None:
        raise ValueError("--data needs --factory pkg.module:function (the model for your data)")
    from paraloom.models import build_model

    return build_model(args.model, loader.dataset[0][0].shape), loader, test


def _mean_loss(model: nn.Module, data: Iterable[object], loss_fn: nn.Module) -> float:
    import torch

    from paraloom.data import split_batch
    from paraloom.forward import forward

    total, rows = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in data:
            inputs, targets = split_batch(batch)
            n = int(targets.shape[0])
            total += float(loss_fn(forward(model, inputs), targets)) * n
            rows += n
    return total / max(1, rows)


def _evaluate(args: argparse.Namespace) -> int:
    from torch import nn
    from torch.utils.data import DataLoader

    from paraloom.evaluation import evaluate, evaluate_regression

    model = _load_model(args.model_file, args.factory)
    if args.data is not None:
        from paraloom.user_code import user_data

        test = user_data(args.data, "--data", args.batch_size, shuffle=False)
    else:
        from paraloom.datasets import load_dataset

        test = DataLoader(load_dataset(args.dataset, "test", args.data_dir),
                          batch_size=args.batch_size)
    try:
        result = evaluate(model, test, loss_fn=nn.CrossEntropyLoss()) \
            if args.loss == "cross_entropy" else evaluate_regression(model, test)
    except RuntimeError as e:  # e.g. a model trained on 8x8 digits given 28x28 MNIST
        raise RuntimeError(f"{e}{_trained_on_hint(args)}") from e
    print(result.report())
    if args.json:
        print(json.dumps(result.metrics()))
    return 0


def _trained_on_hint(args: argparse.Namespace) -> str:
    """What the file says it was trained on, when that is not what it was given."""
    from paraloom.safetensors_files import read_header

    try:
        trained = read_header(args.model_file).get("metadata", {})
    except (ValueError, OSError):
        return ""
    if not isinstance(trained, dict):
        return ""
    given = ("data", args.data) if args.data is not None else ("dataset", args.dataset)
    other, evaluated = given
    for key in ("data", "dataset"):
        value = trained.get(key)
        if isinstance(value, str) and given != (key, value):  # or --data for --dataset
            return (f"; {args.model_file} was trained on --{key} {value}, and is evaluated "
                    f"on --{other} {evaluated}: pass --{key} {value}"
                    + ("" if key == other else f" (or a --data shaped as {value}'s)"))
    return ""


def _save_trained(model: nn.Module, args: argparse.Namespace) -> None:
    """Save the trained model to ``--out``, noting the data (and ``--factory``) it came from.
    A model from ``--factory`` is rebuilt by the same flag, which the file records and
    ``paraloom evaluate`` names: no warning that ``load`` needs a factory."""
    import warnings

    import paraloom

    metadata = {"dataset": args.dataset} if args.data is None else {"data": args.data}
    with warnings.catch_warnings():
        if args.factory is not None:
            metadata["factory"] = args.factory
            warnings.filterwarnings("ignore", message=".*paraloom.load will need factory=")
        paraloom.save(model, args.out, metadata=metadata)
    again = f" (rebuilt with --factory {args.factory})" if args.factory is not None else ""
    print(f"saved {args.out}{again}")


def _load_model(path: str, factory_spec: str | None) -> nn.Module:
    """A paraloom file, or (with --factory) the user's model with the file's weights (a
    paraloom file or plain safetensors weights). A file that ``paraloom train --factory``
    wrote, given without it, is refused naming the flag it was trained with."""
    import paraloom
    from paraloom.user_code import guarded_callable

    factory = None if factory_spec is None else guarded_callable(factory_spec, "--factory")
    try:
        return paraloom.load(path, factory=factory)
    except (ValueError, TypeError):  # the class not imported, or not built without arguments
        trained = _trained_factory(path) if factory is None else None
        if trained is None:
            raise
        raise ValueError(f"{path} holds a model that paraloom train built with --factory "
                         f"{trained}: pass --factory {trained} (with its module importable, "
                         "e.g. PYTHONPATH=.)") from None


def _trained_factory(path: str) -> str | None:
    """The ``--factory`` that ``paraloom train`` recorded in the file; None if none is."""
    from paraloom.safetensors_files import read_header

    try:
        metadata = read_header(path).get("metadata")
    except (ValueError, OSError):  # no header, a folder: load's own error stands
        return None
    factory = metadata.get("factory") if isinstance(metadata, dict) else None
    return factory if isinstance(factory, str) else None


def _bench(args: argparse.Namespace) -> int:
    return int(args.bench_module.run(args))


def _installed(distribution: str) -> str:
    """An installed distribution's version, read without importing it (torch takes seconds)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paraloom", description="paraloom: data-parallel training, inference and serving "
        "for PyTorch, on one machine or a Spark cluster.")
    parser.add_argument("--version", action="version",
                        version=f"paraloom {__version__} (torch {_installed('torch')})")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model with ParallelWrapper and save it")
    _add_train_arguments(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("evaluate", help="a saved model's metrics on test data: accuracy and "
                       "the confusion matrix, or (--loss mse) MSE, MAE, RMSE and R²")
    p.add_argument("model_file", help="a .safetensors file (paraloom.save, or plain weights "
                   "with --factory)")
    add_data_arguments(p, per_worker=False)
    _add_user_code_arguments(p)
    p.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse"],
                   help="the loss the model was trained with: a classifier's (cross_entropy) "
                   "or a regression's (mse)")
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


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lenet", choices=["lenet", "mlp"],
                   help="the built-in model (default lenet)")
    add_data_arguments(p)
    _add_user_code_arguments(p)
    p.add_argument("--test-data", metavar="PKG.MOD:FN",
                   help="with --data: a function returning the test Dataset or DataLoader")
    p.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse"],
                   help="classification or regression (default cross_entropy)")
    p.add_argument("--workers", type=count, default=None,
                   help="worker processes (default: one per GPU, else 2)")
    p.add_argument("--devices", default="auto",
                   help="auto (every GPU, else the CPU), cpu, a GPU count, or cuda:0,cuda:1")
    p.add_argument("--mode", default="averaging",
                   choices=["averaging", "shared_gradients", "allreduce", "diloco"],
                   help="the training mode (default averaging); diloco: each worker trains "
                   "alone and they synchronize every --sync-every rounds, sending 5%% of the "
                   "change, for slow networks")
    p.add_argument("--averaging-frequency", type=count, default=None,
                   help="rounds between averaging steps (averaging mode; default 3, where "
                   "ParallelWrapper's default is 1)")
    p.add_argument("--sync-every", type=count, default=None,
                   help="rounds each worker trains alone between synchronizations (diloco "
                   "mode; default 50)")
    p.add_argument("--epochs", type=count, default=5, help="passes over the data (default 5)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum, Nesterov (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data's "
                   "order (default 0)")
    p.add_argument("--out", help="where to save the model (.safetensors)")


def _add_user_code_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--factory", metavar="PKG.MOD:FN",
                   help="your model: a function returning an nn.Module (instead of the "
                   "built-in models)")
    p.add_argument("--data", metavar="PKG.MOD:FN",
                   help="your data: a function returning a Dataset (batched with --batch-size) "
                   "or a DataLoader (instead of --dataset)")


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
    except (ValueError, TypeError, OSError) as e:  # bad input, a file: no traceback
        parser.exit(2, f"paraloom {args.command}: error: {_os_error(e)}\n")
    except KeyError as e:  # e.g. a file naming a model class not registered
        parser.exit(2, f"paraloom {args.command}: error: {e.args[0] if e.args else e}\n")
    except (ParaloomError, RuntimeError) as e:  # training failed, or the model and data differ
        parser.exit(1, f"paraloom {args.command}: error: {_shown(e, args)}\n")


def _os_error(e: BaseException) -> str:
    """An OSError as a line (``[Errno 21] Is a directory: 'x'`` -> ``x: is a directory``)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror.lower()}"
    return str(e)


def _shown(e: BaseException, args: argparse.Namespace) -> str:
    """A failure's message; a worker's traceback only when the user's own code ran there
    (--factory, --data): in paraloom's built-in models and datasets it is noise."""
    if isinstance(e, WorkerError) and e.remote_traceback and not (
            getattr(args, "factory", None) or getattr(args, "data", None)):
        return str(e).split("\n\nTraceback in the worker:")[0]
    return str(e)


if __name__ == "__main__":
    raise SystemExit(main())
