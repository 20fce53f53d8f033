"""Fault tolerance: workers that fail at random moments of one long fit, against a clean run.

LeNet on scikit-learn's digits, 2 workers. For each kind of failure (an exception in the model,
a normal exit, SIGKILL, SIGSTOP) one fit runs with ``max_failures=N`` while rank 1 fails N times
at random steps; a fault-free fit with the same seed and data order runs first. Reported per
kind: hangs (a fit that does not end within its limit), detection time (from the failure to the
parent's recovery starting, diagnosis included: median, max), seconds lost per failure (wall
time against the clean run), and the final test accuracy against the clean run's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from paraloom.arguments import count, seconds, whole
from paraloom.bench.common import (
    Machine,
    machine,
    plain_args,
    pyplot,
    results_path,
    save_figure,
    write_results,
)
from paraloom.bench.failure_kinds import KINDS, inject_failure
from paraloom.datasets import digits
from paraloom.evaluation import evaluate
from paraloom.models import LeNet

if TYPE_CHECKING:
    from typing_extensions import NotRequired

    from paraloom import ParallelWrapper

__all__ = ["KINDS", "add_arguments", "run", "Injector", "inject_failure"]



class FitResult(TypedDict):
    """One long fit with failures of one kind injected (``"none"``: the clean run)."""

    kind: str
    seconds: float
    hung: bool
    error: str | None
    """What the fit raised, if it failed."""
    injected: int
    recovered: int
    restart_s: list[float]
    replayed_rounds: list[int]
    redone_rounds: list[int]
    """Per recovery: of the rounds sent again, those trained before the failure."""
    detection_s: list[float]
    """Per recovery: seconds from the injection to the parent's detecting it."""
    seconds_lost_estimate: float
    accuracy: float | None
    seconds_lost_per_failure: NotRequired[float]
    """Wall time against the clean run's, per injected failure (not for the clean run)."""
    accuracy_vs_clean: NotRequired[float | None]


class FaultsResults(TypedDict):
    """The JSON that ``run`` writes."""

    machine: Machine
    config: dict[str, object]
    runs: list[FitResult]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--failures", type=whole, default=20, help="injected failures per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    p.add_argument("--epochs", type=count, default=12)
    p.add_argument("--batch-size", type=count, default=16)
    p.add_argument("--mode", default="allreduce")
    p.add_argument("--heartbeat-timeout", type=seconds, default=2.0)
    p.add_argument("--limit", type=seconds, default=900.0, help="seconds before a fit is a hang")
    p.add_argument("--out", type=results_path, default="benchmarks/results/faults.json")
    p.add_argument("--chaos", action="store_true",
                   help="a fault every --every s for --minutes into random workers (bench.chaos)")
    p.add_argument("--every", type=seconds, default=10.0, help="--chaos: seconds between faults")
    p.add_argument("--minutes", type=seconds, default=3.0, help="--chaos: length of the fit")
    p.add_argument("--workers", type=count, default=2, help="--chaos: workers")
    p.add_argument("--spares", type=whole, default=1, help="--chaos: spares=")
    p.add_argument("--seed", type=whole, default=0, help="--chaos: the faults' kinds and ranks")
    p.add_argument("--segments", type=count, default=9,
                   help="--chaos: clean and chaos fits, alternating, each --minutes / segments")


class Injector(nn.Module):
    """LeNet that, on rank 1, fails as ``kind`` says with probability ``p`` per training step,
    ``budget`` times in all (counted in ``log``, shared by the replacement workers)."""

    def __init__(self, kind: str, p: float, budget: int, log: str) -> None:
        super().__init__()
        self.net = LeNet(image_size=8)
        self.kind, self.p, self.budget, self.log = kind, p, budget, log
        self._rng: random.Random | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.budget and dist.is_initialized() and dist.get_rank() == 1:
            self._rng = self._rng or random.Random(os.getpid())
            if self._rng.random() < self.p and self._injected() < self.budget:
                with open(self.log, "a") as f:
                    f.write(f"{time.monotonic()}\n")
                inject_failure(self.kind)
        out: torch.Tensor = self.net(x)
        return out

    def _injected(self) -> int:
        path = Path(self.log)
        return len(path.read_text().splitlines()) if path.exists() else 0


def _setup(args: argparse.Namespace, kind: str, log: Path
           ) -> tuple[Injector, ParallelWrapper, DataLoader[tuple[torch.Tensor, ...]]]:
    """The failing LeNet, a 2-worker wrapper allowed its failures, and the digits loader."""
    from paraloom import ParallelWrapper

    torch.manual_seed(0)
    train = digits("train")
    steps = args.epochs * len(train) // args.batch_size // 2  # steps of rank 1
    budget = args.failures if kind != "none" else 0
    model = Injector(kind, p=min(0.5, 1.5 * budget / max(1, steps)), budget=budget, log=str(log))
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.05,
                                                        momentum=0.9),
                              workers=2, training_mode=args.mode, progress=False,
                              heartbeat_timeout=args.heartbeat_timeout, max_failures=budget)
    loader = DataLoader(train, batch_size=args.batch_size,
                        generator=torch.Generator().manual_seed(0), shuffle=True)
    return model, wrapper, loader


def _watchdog(wrapper: ParallelWrapper, limit: float, done: threading.Event,
              hung: threading.Event) -> None:
    """Unless ``done`` is set within ``limit`` seconds: a hang, so SIGKILL the workers."""
    if not done.wait(limit):
        hung.set()
        for pid in wrapper.worker_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _fit(args: argparse.Namespace, kind: str, log: Path) -> FitResult:
    model, wrapper, loader = _setup(args, kind, log)
    hung = threading.Event()
    done = threading.Event()
    threading.Thread(target=_watchdog, args=(wrapper, args.limit, done, hung),
                     daemon=True).start()
    started = time.monotonic()
    recovered, lost, error = 0, 0.0, None
    try:
        with wrapper:
            stats = wrapper.fit(loader, epochs=args.epochs)
        recovered, lost = stats.get("failures", 0), stats.get("seconds_lost", 0.0)
    except Exception as e:  # reported, not raised: the table shows it
        error = f"{type(e).__name__}: {e}"
    finally:
        done.set()
    seconds = time.monotonic() - started
    injected = [float(t) for t in log.read_text().split()] if log.exists() else []
    # Each recovery against the last injection before it (a failure that was not injected
    # would otherwise shift the pairs).
    detection = [f.detected_at - max((t for t in injected if t <= f.detected_at), default=0.0)
                 for f in wrapper.recoveries]
    return {"kind": kind, "seconds": seconds, "hung": hung.is_set(), "error": error,
            "injected": len(injected), "recovered": recovered,
            "restart_s": [f.restart_seconds for f in wrapper.recoveries],
            "replayed_rounds": [f.replayed_rounds for f in wrapper.recoveries],
            "redone_rounds": [f.redone_rounds for f in wrapper.recoveries],
            "detection_s": detection, "seconds_lost_estimate": lost,
            "accuracy": evaluate(model.net, DataLoader(digits("test"), batch_size=256)).accuracy
            if error is None else None}


def run(args: argparse.Namespace) -> int:
    if args.chaos:
        from paraloom.bench import chaos

        return chaos.run(args)
    args = plain_args(args)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; expected some of {list(KINDS)}")
    workdir = Path(args.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    results: FaultsResults = {"machine": machine(), "config": vars(args).copy(), "runs": []}
    _fit(args, "none", workdir / "none.log")  # starts the forkserver: no run pays for it
    clean = _fit(args, "none", workdir / "none.log")
    results["runs"].append(clean)
    for kind in kinds:
        log = workdir / f"{kind}.log"
        log.unlink(missing_ok=True)
        r = _fit(args, kind, log)
        r["seconds_lost_per_failure"] = (r["seconds"] - clean["seconds"]) / max(1, r["injected"])
        r["accuracy_vs_clean"] = None if r["accuracy"] is None or clean["accuracy"] is None \
            else r["accuracy"] - clean["accuracy"]
        results["runs"].append(r)
    path = write_results(args.out, results)
    _print(results, path)
    _plot(results, Path(args.out).with_suffix(".png"))
    return 0


def _print(results: FaultsResults, path: Path) -> None:
    print(f"{'kind':<8}{'failures':>9}{'hangs':>6}{'detect med':>11}{'max':>7}"
          f"{'lost/fail s':>12}{'accuracy':>9}{'vs clean':>9}")
    for r in results["runs"]:
        d = r["detection_s"]
        med = f"{statistics.median(d):.2f}" if d else "-"
        top = f"{max(d):.2f}" if d else "-"
        lost = f"{r.get('seconds_lost_per_failure', 0.0):.2f}"
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        diff = r.get("accuracy_vs_clean")
        print(f"{r['kind']:<8}{r['injected']:>9}{int(r['hung']):>6}{med:>11}{top:>7}{lost:>12}"
              f"{acc:>9}{'' if diff is None else f'{diff:+.4f}':>9}")
        if r["error"]:
            print(f"  {r['kind']}: {r['error']}")
    print(f"results written to {path}")


def _plot(results: FaultsResults, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in results["runs"] if r["kind"] != "none"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.boxplot([r["detection_s"] or [0.0] for r in runs], tick_labels=[r["kind"] for r in runs])
    left.set_ylabel("seconds from failure to detection")
    left.set_title("detection time")
    right.bar([r["kind"] for r in runs], [r["seconds_lost_per_failure"] for r in runs])
    right.set_ylabel("seconds lost per failure")
    right.set_title("cost of a recovery (restart + replay)")
    save_figure(fig, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
