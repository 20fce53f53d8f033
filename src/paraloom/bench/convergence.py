"""Convergence: accuracy (or validation loss), bytes per step and wall time of every
synchronization mode.

Every contender trains the same model from the same seed on the same data order with the same
dense recipe (the task's optimizer at its learning rate, batch 64 per worker, 2 workers): the
recipe a user takes from DDP and keeps when switching modes. Three tasks: LeNet on 16x16 images
holding scikit-learn's 8x8 digits at random offsets and an MLP on a 10-class synthetic problem
(scikit-learn's ``make_classification``), both with SGD and momentum 0.9; and a character-level
transformer language model on the Python standard library's source (``char_lm``), with AdamW
for 24 epochs, ranked by validation loss (only with ``--tasks charlm``: it takes minutes per
run). The report gives, per task and contender, the median test accuracy
and loss over the seeds, their gaps to dense all-reduce, the bytes each worker sends per step as
a fraction of all-reduce's, and the runs that diverged; the plot shows accuracy (or loss)
against bytes per step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.arguments import count
from paraloom.bench.common import (
    Machine,
    machine,
    plain_args,
    pyplot,
    results_path,
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
    "diloco_sharded": {"training_mode": "diloco", "exchange": "sharded"},
    "diloco_overlap": {"training_mode": "diloco", "overlap_rounds": 10},
    "diloco_h10_d01": {"training_mode": "diloco", "sync_every": 10, "density": 0.01},
    "diloco_h25_d025": {"training_mode": "diloco", "sync_every": 25, "density": 0.025},
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
    loss: float | None
    """Mean cross-entropy on the test (validation) data; None when the run diverged."""
    diverged: str | None
    """The first line of the worker's error when a NaN loss stopped the run."""
    bytes_per_step: float | None
    received_per_step: float | None
    """Bytes a worker receives per step: the synchronizer's count where it keeps one
    (diloco), else the bytes sent (a ring all-reduce, or an all-gather of equal messages,
    takes in what it sends)."""
    seconds: float


class Summary(TypedDict):
    """One contender on one task, over the seeds."""

    median_accuracy: float
    min_accuracy: float
    diverged: int
    median_loss: float
    """Median test (validation) cross-entropy."""
    gap_points: float | None
    """Percentage points below dense all-reduce's median accuracy."""
    loss_gap_percent: float | None
    """Percent above dense all-reduce's median loss."""
    median_bytes_per_step: float
    median_received_per_step: float
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


_Data = tuple[TensorDataset, TensorDataset, Callable[[], nn.Module]]


@dataclass(frozen=True)
class Task:
    """One convergence task: its data and model, and its dense recipe."""

    make: Callable[[], _Data]
    lr: float
    """The dense learning rate (the best of a few for allreduce)."""
    optimizer: str = "sgd"
    """"sgd" (with ``--momentum``) or "adamw" (weight decay 0.01)."""
    metric: str = "accuracy"
    """What the report ranks by: "accuracy" (higher is better) or "loss" (the validation
    loss, lower is better)."""
    epochs: int = 6
    """Passes over the training data when ``--epochs`` is not given."""


def _digits_task() -> _Data:
    from paraloom.models import LeNet

    return (shifted_digits("train", seed=1), shifted_digits("test", seed=2),
            lambda: LeNet(image_size=16))


def _synthetic_task() -> _Data:
    from sklearn.datasets import make_classification

    from paraloom.models import MLP

    x, y = make_classification(n_samples=15000, n_features=64, n_informative=40,
                               n_redundant=8, n_classes=10, n_clusters_per_class=2,
                               class_sep=1.5, random_state=0)
    xs, ys = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    cut = 12000
    return (TensorDataset(xs[:cut], ys[:cut]), TensorDataset(xs[cut:], ys[cut:]),
            lambda: MLP(in_features=64, hidden=(256, 256), num_classes=10))


def _char_lm_task() -> _Data:
    from paraloom.bench.char_lm import CharTransformer, char_datasets

    train, validation = char_datasets()
    return train, validation, CharTransformer


TASKS: dict[str, Task] = {
    "digits16": Task(_digits_task, 0.1),
    "synthetic": Task(_synthetic_task, 0.02),
    "charlm": Task(_char_lm_task, 3e-3, optimizer="adamw", metric="loss", epochs=24),
}
"""Task name -> Task (learning rates: the best of 0.005/0.02/0.1 for allreduce; the issue's
0.1 for digits16; for the language model AdamW's usual 3e-3 at this size, and 24 epochs:
1,170 steps at 2 workers, 23 synchronizations at diloco's default ``sync_every``)."""

DEFAULT_TASKS = ("digits16", "synthetic")
"""What runs without ``--tasks`` (the language model takes minutes per run: ask for it)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated, of: " + ", ".join(TASKS))
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="comma-separated: " + ", ".join(CONTENDERS))
    p.add_argument("--seeds", type=count, default=3)
    p.add_argument("--epochs", type=count, default=None,
                   help="passes over the data (default: each task's own, see TASKS)")
    p.add_argument("--workers", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for every task (default: each task's own, see TASKS)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--out", type=results_path, default="benchmarks/results/convergence.json")


def _evaluate(model: nn.Module, data: TensorDataset) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on ``data``, in slices of 1,024 examples."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    right = lost = 0.0
    x, y = data.tensors
    with torch.no_grad():
        for start in range(0, len(y), 1024):
            logits = model(x[start:start + 1024])
            target = y[start:start + 1024]
            right += float((logits.argmax(dim=1) == target).float().sum())
            lost += float(loss_fn(logits, target))
    return right / y.numel(), lost / y.numel()


def _train(args: argparse.Namespace, task: str, contender: str, seed: int) -> RunResult:
    from paraloom import ParallelWrapper
    from paraloom.errors import WorkerError

    spec = TASKS[task]
    train, test, build = spec.make()
    torch.manual_seed(seed)
    model = build()
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    lr, momentum = args.lr or spec.lr, args.momentum
    epochs = args.epochs or spec.epochs
    optimizer: Callable[[Any], torch.optim.Optimizer] = (
        (lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01)) if spec.optimizer == "adamw"
        else (lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum)))
    options = with_threshold(CONTENDERS[contender])
    if options.get("comm_hook") == "powersgd":  # dense for the first 10% of steps, as torch advises
        options.setdefault("powersgd_warmup", max(1, len(loader) * epochs // 10))
    start = time.perf_counter()
    try:
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=optimizer,
                             workers=args.workers, progress=False, timeout=600,
                             **options) as wrapper:
            stats = wrapper.fit(loader, epochs=epochs)
    except WorkerError as e:  # a NaN loss in a worker: the run diverged
        return {"seed": seed, "accuracy": None, "loss": None,
                "diverged": str(e).splitlines()[0], "bytes_per_step": None,
                "received_per_step": None, "seconds": time.perf_counter() - start}
    per_step = stats["bytes_sent_per_step"]
    accuracy, loss = _evaluate(model, test)
    received = [w.get("bytes_received_per_step", sent)
                for w, sent in zip(stats["per_worker"], per_step, strict=True)]
    return {"seed": seed, "accuracy": accuracy, "loss": loss, "diverged": None,
            "bytes_per_step": sum(per_step) / len(per_step),
            "received_per_step": sum(received) / len(received),
            "seconds": time.perf_counter() - start}


def _summary(runs: list[RunResult], dense: Summary | None) -> Summary:
    # (accuracy, loss, bytes per step) of the runs that did not diverge: they have all three.
    done = [(a, loss, b) for r in runs if (a := r["accuracy"]) is not None
            and (loss := r["loss"]) is not None and (b := r["bytes_per_step"]) is not None]
    accuracy = statistics.median(a for a, _, _ in done) if done else math.nan
    loss = statistics.median(x for _, x, _ in done) if done else math.nan
    steps = statistics.median(b for _, _, b in done) if done else math.nan
    dense_bytes = None if dense is None else dense["median_bytes_per_step"]
    received = [r["received_per_step"] for r in runs if r["received_per_step"] is not None]
    return {"median_accuracy": accuracy,
            "median_received_per_step": statistics.median(received) if received else math.nan,
            "min_accuracy": min((a for a, _, _ in done), default=math.nan),
            "median_loss": loss,
            "diverged": len(runs) - len(done),
            "gap_points": None if dense is None else 100 * (dense["median_accuracy"] - accuracy),
            "loss_gap_percent": None if dense is None else
            100 * (loss / dense["median_loss"] - 1),
            "median_bytes_per_step": steps,
            "bytes_fraction_of_allreduce": None if not dense_bytes else steps / dense_bytes,
            "median_seconds": statistics.median(r["seconds"] for r in runs)}


def _summaries(runs: dict[str, list[RunResult]]) -> dict[str, Summary]:
    """Each contender's summary, against dense all-reduce's when it ran."""
    dense = _summary(runs["allreduce"], None) if "allreduce" in runs else None
    return {c: _summary(r, dense) for c, r in runs.items()}


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
                         f"accuracy {r['accuracy']:.4f}, loss {r['loss']:.4f}, "
                         f"{r['bytes_per_step']:.0f} B/step out, "
                         f"{r['received_per_step']:.0f} in")
                      + f", {r['seconds']:.1f} s", flush=True)
        results["summary"][task] = _summaries(results["runs"][task])
    path = write_results(args.out, results)
    _print(results, path)
    _plot(results, Path(args.out).with_suffix(".png"))
    return 0


def _print(results: ConvergenceResults, path: Path) -> None:
    print(f"{'task':<11}{'contender':<18}{'accuracy':>9}{'gap':>7}{'min':>8}{'loss':>8}"
          f"{'loss gap':>9}{'diverged':>9}{'B/step':>10}{'of dense':>10}{'in B/step':>10}"
          f"{'s/run':>7}")
    for task, rows in results["summary"].items():
        for c, s in rows.items():
            gap = "" if s["gap_points"] is None else f"{s['gap_points']:+.1f}"
            loss_gap = "" if s["loss_gap_percent"] is None else f"{s['loss_gap_percent']:+.1f}%"
            frac = s["bytes_fraction_of_allreduce"]
            print(f"{task:<11}{c:<18}{s['median_accuracy']:>9.4f}{gap:>7}"
                  f"{s['min_accuracy']:>8.4f}{s['median_loss']:>8.4f}{loss_gap:>9}"
                  f"{s['diverged']:>9}{s['median_bytes_per_step']:>10.0f}"
                  f"{'' if frac is None else f'1/{1 / frac:.0f}':>10}"
                  f"{s['median_received_per_step']:>10.0f}{s['median_seconds']:>7.1f}")
    print(f"results written to {path}")


def _plot(results: ConvergenceResults, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    tasks = list(results["runs"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for contender, runs in results["runs"][task].items():
            by_loss = TASKS[task].metric == "loss"
            done = [(r["bytes_per_step"], r["loss"] if by_loss else r["accuracy"])
                    for r in runs if r["accuracy"] is not None]
            points = ax.scatter([b for b, _ in done], [y for _, y in done], alpha=0.5)
            s = results["summary"][task][contender]
            ax.scatter([s["median_bytes_per_step"]],
                       [s["median_loss"] if by_loss else s["median_accuracy"]],
                       marker="*", s=160,
                       color=points.get_facecolor()[0], label=f"{contender} "
                       f"({s['diverged']} diverged)" if s["diverged"] else contender)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker per step (log)")
        ax.set_ylabel("validation loss" if TASKS[task].metric == "loss" else "test accuracy")
        ax.set_title(task)
        ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
