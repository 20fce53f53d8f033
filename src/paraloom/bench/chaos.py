"""``paraloom bench faults --chaos``: a fault every N seconds, for M minutes, into random workers.

LeNet on scikit-learn's digits, ``--workers`` workers, ``max_failures`` unbounded. A clean fit
(same options, no faults) is timed on enough epochs for ``--minutes``, and one with
``max_failures=0`` (what the fault tolerance costs without faults); the same fit then runs
while a thread of this process arms a fault every ``--every`` seconds: a random kind (an
exception in the model, an exit, SIGKILL, SIGSTOP) for a random worker, which fails at its
next training step. Reported: the throughput kept, each fault's cost (median by kind), the
accuracy of both fits and whether their parameters are bit-identical, and the worker and spare
processes and shared-memory files left behind; JSON and a timeline plot (rounds delivered
against time, each fault marked).

The throughput kept is given two ways: the clean fit's seconds over the chaos fit's (the two
run minutes apart, so the machine's drift, about 5% on a shared 2-core machine, moves it), and
one minus the faults' costs over the chaos fit's seconds, which drift does not move. A fault's
cost is read off the timeline: the gap between the last round delivered before it and the
first reply after (with every round that reply delivered: a message answers several rounds at
once), less the clean fit's time per round for the rounds delivered then (a recovery replays
rounds it had delivered already, which the caller does not see again).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from paraloom.bench.common import machine, plain_args, pyplot, save_figure, write_results
from paraloom.bench.failure_kinds import KINDS, inject_failure
from paraloom.datasets import digits
from paraloom.evaluation import evaluate
from paraloom.listeners import TrainingListener
from paraloom.models import LeNet

__all__ = ["ChaosModel", "run"]

_BURST_S = 0.002
"""Rounds delivered this close one after the other came in the same reply."""


class ChaosModel(nn.Module):
    """LeNet whose training step, on the rank that a file ``<armed>/<rank>`` names, fails as
    the file says (the file is taken first, so each fault fires once)."""

    def __init__(self, armed: str) -> None:
        super().__init__()
        self.net = LeNet(image_size=8)
        self.armed = armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.armed and dist.is_initialized():
            path = os.path.join(self.armed, str(dist.get_rank()))
            taken = f"{path}.{os.getpid()}"
            try:
                os.rename(path, taken)
            except OSError:
                pass
            else:
                kind = Path(taken).read_text()
                with open(os.path.join(self.armed, "fired.log"), "a") as f:
                    f.write(f"{time.monotonic()} {kind} {dist.get_rank()}\n")
                os.unlink(taken)
                inject_failure(kind)
        out: torch.Tensor = self.net(x)
        return out


class _Timeline(TrainingListener):
    def __init__(self) -> None:
        self.points: list[tuple[float, int]] = []

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        self.points.append((time.monotonic(), iteration))


def _fit(args: argparse.Namespace, epochs: int, armed: Path | None,
         tolerant: bool = True) -> dict[str, Any]:
    """One fit; ``tolerant=False``: ``max_failures=0`` (no restore points, no spares)."""
    from paraloom import ParallelWrapper

    torch.manual_seed(0)
    model = ChaosModel(str(armed) if armed is not None else "")
    timeline = _Timeline()
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.05,
                                                        momentum=0.9),
                              workers=args.workers, training_mode=args.mode, progress=False,
                              heartbeat_timeout=args.heartbeat_timeout,
                              max_failures=10_000 if tolerant else 0, spares=args.spares,
                              listeners=[timeline])
    loader = DataLoader(digits("train"), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    pids: set[int] = set()
    done = threading.Event()
    watcher = threading.Thread(target=_watch_pids, args=(wrapper, pids, done), daemon=True)
    watcher.start()
    started = time.monotonic()
    with wrapper:
        if armed is not None:
            threading.Thread(target=_arm, args=(args, armed, wrapper, done), daemon=True).start()
        wrapper.fit(loader, epochs=epochs)
    seconds = time.monotonic() - started
    done.set()
    watcher.join()
    time.sleep(0.5)  # the workers' exits are reaped before the orphan check below
    accuracy = evaluate(model.net, DataLoader(digits("test"), batch_size=256)).accuracy
    return {"seconds": seconds, "started": started, "timeline": timeline.points,
            "accuracy": accuracy, "recoveries": [
                {"rank": r.rank, "detected_at": r.detected_at - started,
                 "restart_s": r.restart_seconds, "replayed_rounds": r.replayed_rounds}
                for r in wrapper.recoveries],
            "orphans": sorted(p for p in pids if _alive(p)),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _watch_pids(wrapper: Any, pids: set[int], done: threading.Event) -> None:
    """Every worker and spare process seen during the fit (checked for orphans after it)."""
    while not done.wait(0.05):
        pool = wrapper._pool
        pids.update(wrapper.worker_pids)
        pids.update(getattr(pool, "spare_pids", []))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _arm(args: argparse.Namespace, armed: Path, wrapper: Any, done: threading.Event) -> None:
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    while not done.wait(args.every):
        rank = rng.randrange(args.workers)
        (armed / f"{rank}.tmp").write_text(rng.choice(kinds))
        os.replace(armed / f"{rank}.tmp", armed / str(rank))


def _fault_costs(chaos: dict[str, Any], fired: list[tuple[float, str, int]],
                 round_s: float) -> list[dict[str, Any]]:
    points = chaos["timeline"]
    costs = []
    for at, kind, rank in fired:
        before = [p for p in points if p[0] <= at]
        after = [p for p in points if p[0] > at]
        if not before or not after:
            continue
        # Rounds arrive a message's worth at a time: the first reply after the fault counts
        # with every round it delivered, as its time includes training them all.
        (t0, n0), (t1, n1) = before[-1], after[0]
        for t, n in after[1:]:
            if t - t1 > _BURST_S:
                break
            t1, n1 = t, n
        costs.append({"at": at - chaos["started"], "kind": kind, "rank": rank,
                      "lost_s": max(0.0, (t1 - t0) - (n1 - n0) * round_s)})
    return costs


def _shm_files() -> set[str]:
    """Names in /dev/shm, but this process's own joblib semaphores (scikit-learn's loky
    removes them when this process exits)."""
    shm = Path("/dev/shm")
    own = f"sem.loky-{os.getpid()}-"
    return {p.name for p in shm.iterdir() if not p.name.startswith(own)} if shm.is_dir() \
        else set()


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    workdir = Path(args.out).with_suffix("")
    armed = workdir / "armed"
    armed.mkdir(parents=True, exist_ok=True)
    for stale in armed.iterdir():
        stale.unlink()
    shm_before = _shm_files()
    probe = _fit(args, 2, None)  # also starts the forkserver: no timed run pays for it
    per_epoch = (probe["timeline"][-1][0] - probe["timeline"][0][0]) / 2
    epochs = max(2, math.ceil(args.minutes * 60 / per_epoch))
    plain = _fit(args, epochs, None, tolerant=False)
    clean = _fit(args, epochs, None)
    chaos = _fit(args, epochs, armed)
    identical = all(torch.equal(clean["state"][k], v) for k, v in chaos["state"].items())
    for run_ in (plain, clean, chaos, probe):
        del run_["state"]
    fired = [(float(t), kind, int(rank)) for t, kind, rank in
             (line.split() for line in (armed / "fired.log").read_text().splitlines())] \
        if (armed / "fired.log").exists() else []
    rounds = clean["timeline"][-1][1] - clean["timeline"][0][1]
    round_s = (clean["timeline"][-1][0] - clean["timeline"][0][0]) / max(1, rounds)
    costs = _fault_costs(chaos, fired, round_s)
    result = {"machine": machine(), "config": {**vars(args), "epochs": epochs},
              "clean": clean, "chaos": chaos, "faults": costs,
              "plain": plain, "throughput_kept": clean["seconds"] / chaos["seconds"],
              "throughput_kept_from_costs": 1 - sum(c["lost_s"] for c in costs) / chaos["seconds"],
              "tolerance_overhead": 1 - plain["seconds"] / clean["seconds"],
              "identical": identical,
              "lost_s_median_by_kind": {k: statistics.median(c["lost_s"] for c in costs
                                                             if c["kind"] == k)
                                        for k in sorted({c["kind"] for c in costs})},
              "shm_left": sorted(_shm_files() - shm_before)}
    path = write_results(args.out, result)
    _print(result, path)
    _plot(result, Path(args.out).with_suffix(".png"))
    return 0


def _print(r: dict[str, Any], path: Path) -> None:
    c, x = r["clean"], r["chaos"]
    print(f"chaos: {len(r['faults'])} faults, one every {r['config']['every']:g} s, "
          f"{r['config']['epochs']} epochs; clean {c['seconds']:.1f} s, "
          f"chaos {x['seconds']:.1f} s: "
          f"throughput kept {r['throughput_kept']:.3f} (from the faults' costs: "
          f"{r['throughput_kept_from_costs']:.3f})")
    print(f"max_failures=0 (no restore points, no spare): {r['plain']['seconds']:.1f} s; the "
          f"fault tolerance costs {100 * r['tolerance_overhead']:.1f}% without faults")
    print(f"accuracy: clean {c['accuracy']:.4f}, chaos {x['accuracy']:.4f}, parameters "
          f"{'bit-identical' if r['identical'] else 'DIFFERENT'}; "
          f"orphans {len(c['orphans']) + len(x['orphans'])}; shared memory left "
          f"{len(r['shm_left'])}")
    for kind, lost in r["lost_s_median_by_kind"].items():
        n = sum(1 for f in r["faults"] if f["kind"] == kind)
        print(f"  {kind:<6} {n:>3} faults, lost per fault: median {lost:.2f} s")
    print(f"results written to {path}")


def _plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    for name in ("clean", "chaos"):
        run = r[name]
        ax.plot([t - run["started"] for t, _ in run["timeline"]],
                [n for _, n in run["timeline"]], label=name)
    colors = dict(zip(KINDS, ("tab:red", "tab:purple", "tab:brown", "tab:gray"), strict=True))
    for f in r["faults"]:
        ax.axvline(f["at"], color=colors.get(f["kind"], "black"), alpha=0.4, lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("rounds delivered")
    every = r["config"]["every"]
    ax.set_title(f"chaos: a fault every {every:g} s (lines: raise red, exit purple, "
                 "kill brown, stop gray)")
    ax.legend()
    save_figure(fig, path)
