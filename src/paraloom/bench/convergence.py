"""Convergence: accuracy, bytes per step and wall time of every synchronization mode.

Every contender trains the same model from the same seed on the same data order with the same
dense recipe (SGD with momentum 0.9 at the task's learning rate, batch 64 per worker, 2
workers): the recipe a user takes from DDP and keeps when switching modes. Two tasks: LeNet on
16x16 images holding scikit-learn's 8x8 digits at random offsets, and an MLP on a 10-class
synthetic problem (scikit-learn's ``make_classification``). The report gives, per task and
contender, the median test accuracy over the seeds, its gap to dense all-reduce, the bytes each
worker sends per step as a fraction of all-reduce's, and the runs that diverged; the plot shows
accuracy against bytes per step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.bench.common import (
    Machine,
    machine,
    plain_args,
    pyplot,
    save_figure,
    with_threshold,
    write_results,
)

__all__ = ["add_arguments", "run", "shifted_digits", "CONTENDERS", "TASKS"]

CONTENDERS: dict[str, dict[str, Any]] = {
    "allreduce": {"training_mode": "allreduce"},
    "averaging": {"training_mode": "averaging", "averaging_frequency": 4},
    "diloco": {"training_mode": "diloco"},
    "diloco_dense": {"training_mode": "diloco", "density": 1.0},
    "diloco_h25": {"training_mode": "diloco", "sync_every": 25},
    "diloco_nesterov": {"training_mode": "diloco", "outer_optimizer": "nesterov"},
    "powersgd": {"training_mode": "allreduce", "comm_hook": "powersgd"},
    "sharing_dl4j": {"training_mode": "shared_gradients", "recipe": "dl4j"},
    "sharing_threshold": {"training_mode": "shared_gradients", "encoding": "threshold",
                          "threshold_algorithm": ("QuantileThreshold", 1 / 320)},
    "sharing": {"training_mode": "shared_gradients"},
    "sharing_masked": {"training_mode": "shared_gradients", "momentum_masking": True},
    "sharing_blocking": {"training_mode": "shared_gradients", "overlap": False,
                         "threshold_algorithm": ("QuantileThreshold", 1 / 160)},
    "sharing_at_shared": {"training_mode": "shared_gradients", "gradients_at": "shared",
                          "momentum_masking": True,
                          "threshold_algorithm": ("QuantileThreshold", 1 / 160)},
}
"""Contender name -> ParallelWrapper options (everything else is the same recipe)."""


class RunResult(TypedDict):
    """One contender's training run from one seed."""

    seed: int
    accuracy: float | None
    """Test accuracy; None when the run diverged."""
    diverged: str | None
    """The first line of the worker's error when a NaN loss stopped the run."""
    bytes_per_step: float | None
    seconds: float


class Summary(TypedDict):
    """One contender on one task, over the seeds."""

    median_accuracy: float
    min_accuracy: float
    diverged: int
    gap_points: float | None
    """Percentage points below dense all-reduce's median accuracy."""
    median_bytes_per_step: float
    bytes_fraction_of_allreduce: float | None
    median_seconds: float


class ConvergenceResults(TypedDict):
    """The JSON that ``run`` writes."""

    machine: Machine
    config: dict[str, object]
    contenders: dict[str, dict[str, Any]]
    runs: dict[str, dict[str, list[RunResult]]]
    """Task -> contender -> one result per seed."""
    summary: dict[str, dict[str, Summary]]


def shifted_digits(split: str, copies: int = 4, seed: int = 0, size: int = 16) -> TensorDataset:
    """scikit-learn's 8x8 digits, each placed ``copies`` times at random offsets on a blank
    ``size`` x ``size`` image: a small task where position must be learned away."""
    from paraloom.datasets import digits

    x, y = digits(split).tensors
    g = torch.Generator().manual_seed(seed)
    n, room = len(y) * copies, size - 8 + 1
    images = torch.zeros(n, 1, size, size)
    tiles = x.repeat(copies, 1, 1, 1)
    rows = torch.randint(0, room, (n,), generator=g).tolist()
    cols = torch.randint(0, room, (n,), generator=g).tolist()
    for i, (r, c) in enumerate(zip(rows, cols, strict=True)):
        images[i, :, r:r + 8, c:c + 8] = tiles[i]
    return TensorDataset(images, y.repeat(copies))


_Task = tuple[TensorDataset, TensorDataset, Callable[[], nn.Module]]


def _digits_task() -> _Task:
    from paraloom.models import LeNet

    return (shifted_digits("train", seed=1), shifted_digits("test", seed=2),
            lambda: LeNet(image_size=16))


def _synthetic_task() -> _Task:
    from sklearn.datasets import make_classification

    from paraloom.models import MLP

    x, y = make_classification(n_samples=15000, n_features=64, n_informative=40,
                               n_redundant=8, n_classes=10, n_clusters_per_class=2,
                               class_sep=1.5, random_state=0)
    xs, ys = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    cut = 12000
    return (TensorDataset(xs[:cut], ys[:cut]), TensorDataset(xs[cut:], ys[cut:]),
            lambda: MLP(in_features=64, hidden=(256, 256), num_classes=10))


TASKS: dict[str, tuple[Callable[[], _Task], float]] = {
    "digits16": (_digits_task, 0.1), "synthetic": (_synthetic_task, 0.02)}
"""Task name -> (data and model, its dense learning rate: the best of 0.005/0.02/0.1 for
allreduce; the issue's 0.1 for digits16)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="comma-separated: " + ", ".join(CONTENDERS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for every task (default: each task's own, see TASKS)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--out", default="benchmarks/results/convergence.json")


def _accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def _train(args: argparse.Namespace, task: str, contender: str, seed: int) -> RunResult:
    from paraloom import ParallelWrapper
    from paraloom.errors import WorkerError

    make, task_lr = TASKS[task]
    train, test, build = make()
    torch.manual_seed(seed)
    model = build()
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    lr, momentum = args.lr or task_lr, args.momentum
    options = with_threshold(CONTENDERS[contender])
    if options.get("comm_hook") == "powersgd":  # dense for the first 10% of steps, as torch advises
        options.setdefault("powersgd_warmup", max(1, len(loader) * args.epochs // 10))
    start = time.perf_counter()
    try:
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum),
                             workers=args.workers, progress=False, timeout=600,
                             **options) as wrapper:
            stats = wrapper.fit(loader, epochs=args.epochs)
    except WorkerError as e:  # a NaN loss in a worker: the run diverged
        return {"seed": seed, "accuracy": None, "diverged": str(e).splitlines()[0],
                "bytes_per_step": None, "seconds": time.perf_counter() - start}
    per_step = stats["bytes_sent_per_step"]
    return {"seed": seed, "accuracy": _accuracy(model, test), "diverged": None,
            "bytes_per_step": sum(per_step) / len(per_step),
            "seconds": time.perf_counter() - start}


def _summary(runs: list[RunResult], dense_bytes: float | None,
             dense_accuracy: float | None) -> Summary:
    # (accuracy, bytes per step) of the runs that did not diverge: they have both.
    done = [(a, b) for r in runs
            if (a := r["accuracy"]) is not None and (b := r["bytes_per_step"]) is not None]
    accuracy = statistics.median(a for a, _ in done) if done else math.nan
    steps = statistics.median(b for _, b in done) if done else math.nan
    return {"median_accuracy": accuracy,
            "min_accuracy": min((a for a, _ in done), default=math.nan),
            "diverged": len(runs) - len(done),
            "gap_points": None if dense_accuracy is None else 100 * (dense_accuracy - accuracy),
            "median_bytes_per_step": steps,
            "bytes_fraction_of_allreduce": None if not dense_bytes else steps / dense_bytes,
            "median_seconds": statistics.median(r["seconds"] for r in runs)}


def _summaries(runs: dict[str, list[RunResult]]) -> dict[str, Summary]:
    """Each contender's summary, against dense all-reduce's when it ran."""
    dense = _summary(runs["allreduce"], None, None) if "allreduce" in runs else None
    dense_bytes = None if dense is None else dense["median_bytes_per_step"]
    dense_accuracy = None if dense is None else dense["median_accuracy"]
    return {c: _summary(r, dense_bytes, dense_accuracy) for c, r in runs.items()}


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for name, known in (("task", TASKS), ("contender", CONTENDERS)):
        unknown = [n for n in (tasks if name == "task" else contenders) if n not in known]
        if unknown:
            raise SystemExit(f"unknown {name}(s) {unknown}; expected some of {list(known)}")
    results: ConvergenceResults = {"machine": machine(), "config": vars(args).copy(),
                                   "contenders": {c: CONTENDERS[c] for c in contenders},
                                   "runs": {}, "summary": {}}
    for task in tasks:
        results["runs"][task] = {c: [] for c in contenders}
        for seed in range(args.seeds):  # seeds outermost: drift hits every contender alike
            for contender in contenders:
                r = _train(args, task, contender, seed)
                results["runs"][task][contender].append(r)
                print(f"{task:<10} {contender:<13} seed {seed}: "
                      + ("diverged" if r["accuracy"] is None else
                         f"accuracy {r['accuracy']:.4f}, {r['bytes_per_step']:.0f} B/step")
                      + f", {r['seconds']:.1f} s", flush=True)
        results["summary"][task] = _summaries(results["runs"][task])
    path = write_results(args.out, results)
    _print(results, path)
    _plot(results, Path(args.out).with_suffix(".png"))
    return 0


def _print(results: ConvergenceResults, path: Path) -> None:
    print(f"{'task':<11}{'contender':<14}{'accuracy':>9}{'gap':>7}{'min':>8}{'diverged':>9}"
          f"{'B/step':>10}{'of dense':>10}{'s/run':>7}")
    for task, rows in results["summary"].items():
        for c, s in rows.items():
            gap = "" if s["gap_points"] is None else f"{s['gap_points']:+.1f}"
            frac = s["bytes_fraction_of_allreduce"]
            print(f"{task:<11}{c:<14}{s['median_accuracy']:>9.4f}{gap:>7}"
                  f"{s['min_accuracy']:>8.4f}{s['diverged']:>9}{s['median_bytes_per_step']:>10.0f}"
                  f"{'' if frac is None else f'1/{1 / frac:.0f}':>10}{s['median_seconds']:>7.1f}")
    print(f"results written to {path}")


def _plot(results: ConvergenceResults, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    tasks = list(results["runs"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for contender, runs in results["runs"][task].items():
            done = [r for r in runs if r["accuracy"] is not None]
            points = ax.scatter([r["bytes_per_step"] for r in done],
                                [r["accuracy"] for r in done], alpha=0.5)
            s = results["summary"][task][contender]
            ax.scatter([s["median_bytes_per_step"]], [s["median_accuracy"]], marker="*", s=160,
                       color=points.get_facecolor()[0], label=f"{contender} "
                       f"({s['diverged']} diverged)" if s["diverged"] else contender)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker per step (log)")
        ax.set_ylabel("test accuracy")
        ax.set_title(task)
        ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
