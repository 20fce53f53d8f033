"""``paraloom bench faults --chaos``: a fault every N seconds, for M minutes, into random workers.

LeNet on scikit-learn's digits, ``--workers`` workers, ``max_failures`` unbounded. The minutes
are split into ``--segments`` pairs of fits (same options, same epochs, each from the same
start): one clean, one while a thread of this process arms a fault every ``--every`` seconds
(a random kind: an exception in the model, an exit, SIGKILL, SIGSTOP, for a random worker,
which fails at its next training step; the faults keep their pace from one such fit to the
next), the pairs alternating which goes first, so that the machine's drift over the minutes
moves both alike. One fit of all the epochs with
``max_failures=0`` shows what the fault tolerance costs without faults (one pool start
against the segments' several: a few tenths of a second). Reported: the throughput kept, each
fault's cost (median by kind), the accuracy of the last pair and whether every pair's
parameters are bit-identical, and the worker and spare processes and shared-memory files left
behind; JSON and a timeline plot (rounds delivered against the fits' own time, each fault
marked).

The throughput kept is given two ways: the clean fits' seconds over the chaos fits' (what the
faults cost in all, the recoveries' after-effects included), and one minus the faults' costs
over the chaos fits' seconds; beside them, each pair's own ratio (lowest, median, highest),
which shows how much the machine's drift within a pair moves the first. A fault's cost is
read off the timeline: the gap between the last round delivered before it and the first
reply after (with every round that reply delivered: a message answers several rounds at
once), less the clean fits' time per round for the rounds delivered then (a recovery replays
rounds it had delivered already, which the caller does not see again).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
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

__all__ = ["ChaosModel", "next_fault_s", "pair_ratios", "run"]

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
         tolerant: bool = True, seed: int = 0, first_s: float | None = None) -> dict[str, Any]:
    """One fit; ``tolerant=False``: ``max_failures=0`` (no restore points, no spares);
    ``seed``: the faults' kinds and ranks; ``first_s``: when the first fault fires (default
    ``--every``), the rest every ``--every`` s after it."""
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
            first = args.every if first_s is None else first_s
            threading.Thread(target=_arm, args=(args, armed, seed, done, first),
                             daemon=True).start()
        wrapper.fit(loader, epochs=epochs)
    seconds = time.monotonic() - started
    done.set()
    watcher.join()
    time.sleep(0.5)  # the workers' exits are reaped before the orphan check below
    accuracy = evaluate(model.net, DataLoader(digits("test"), batch_size=256)).accuracy
    return {"seconds": seconds, "started": started, "timeline": timeline.points,
            "accuracy": accuracy, "recoveries": [
                {"rank": r.rank, "detected_at": r.detected_at - started,
                 "restart_s": r.restart_seconds, "replayed_rounds": r.replayed_rounds,
                 "redone_rounds": r.redone_rounds}
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


def _arm(args: argparse.Namespace, armed: Path, seed: int, done: threading.Event,
         first_s: float) -> None:
    rng = random.Random(seed)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    wait = first_s
    while not done.wait(wait):
        wait = args.every
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


def _alternating(args: argparse.Namespace, epochs: int, armed: Path
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``--segments`` clean fits and as many with faults, alternating (clean first, then chaos
    first, ...), each of ``epochs`` from the same start: the machine's drift moves both alike.
    The faults keep their pace across the chaos fits: one every ``--every`` s of their time
    joined (a fit shorter than that still gets its share)."""
    clean: list[dict[str, Any]] = []
    chaos: list[dict[str, Any]] = []
    for i in range(args.segments):
        for faulty in ((False, True) if i % 2 == 0 else (True, False)):
            if faulty:
                first = next_fault_s(sum(c["seconds"] for c in chaos), args.every)
                chaos.append(_fit(args, epochs, armed, seed=args.seed + i, first_s=first))
            else:
                clean.append(_fit(args, epochs, None))
    return clean, chaos


def next_fault_s(elapsed_s: float, every_s: float) -> float:
    """When the next fit's first fault is due, the chaos fits before it having taken
    ``elapsed_s`` in all and faults coming every ``every_s`` of their joined time."""
    return every_s - math.fmod(elapsed_s, every_s)


def pair_ratios(clean_s: list[float], chaos_s: list[float]) -> dict[str, float]:
    """Each pair's clean seconds over its chaos seconds: the lowest, the median and the
    highest. Their spread shows how far the machine's drift within a pair moves the
    throughput kept (a pair's fits run one after the other, so drift between pairs cancels)."""
    if len(clean_s) != len(chaos_s) or not clean_s:
        raise ValueError(f"{len(clean_s)} clean fits and {len(chaos_s)} chaos fits; expected "
                         "as many of each, at least one")
    ratios = [c / x for c, x in zip(clean_s, chaos_s, strict=True)]
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


def _joined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fits as one run: each one's timeline and recoveries follow the last (seconds since the
    first one's start, counting only the fits' own time; rounds counted on). ``spans``: each
    fit's (start, end, shift) on the clock, to place a fault's time on the joined one."""
    points: list[tuple[float, int]] = []
    recoveries: list[dict[str, Any]] = []
    spans: list[tuple[float, float, float]] = []
    offset, rounds = 0.0, 0
    for run_ in runs:
        shift = run_["started"] - offset
        spans.append((run_["started"], run_["started"] + run_["seconds"], shift))
        points += [(t - shift, n + rounds) for t, n in run_["timeline"]]
        recoveries += [{**r, "detected_at": r["detected_at"] + offset} for r in run_["recoveries"]]
        offset += run_["seconds"]
        rounds += run_["timeline"][-1][1] + 1 if run_["timeline"] else 0
    return {"seconds": offset, "started": 0.0, "timeline": points, "recoveries": recoveries,
            "accuracy": runs[-1]["accuracy"], "orphans": sorted(p for r in runs
                                                                for p in r["orphans"]),
            "segments": [round(r["seconds"], 2) for r in runs], "spans": spans}


def _round_s(runs: list[dict[str, Any]]) -> float:
    """The clean fits' time per round (within each fit: not its start)."""
    span = sum(r["timeline"][-1][0] - r["timeline"][0][0] for r in runs)
    rounds = sum(r["timeline"][-1][1] - r["timeline"][0][1] for r in runs)
    return float(span / max(1, rounds))


def _fired(armed: Path, spans: list[tuple[float, float, float]]) -> list[tuple[float, str, int]]:
    """The faults that fired (time on the joined clock, kind, rank)."""
    log = armed / "fired.log"
    lines = log.read_text().splitlines() if log.exists() else []
    fired = []
    for t, kind, rank in (line.split() for line in lines):
        shift = next((s for start, end, s in spans if start <= float(t) <= end), None)
        if shift is not None:
            fired.append((float(t) - shift, kind, int(rank)))
    return fired


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    if args.segments < 1:
        raise SystemExit(f"--segments {args.segments}: expected 1 or more")
    # The files that arm a fault live in a folder of their own (once beside --out: a --out
    # without a suffix then named that folder, and the results could not be written).
    with tempfile.TemporaryDirectory(prefix="paraloom-chaos-") as armed:
        result = _measure(args, Path(armed))
    path = write_results(args.out, result)
    _print(result, path)
    _plot(result, Path(args.out).with_suffix(".png"))
    return 0


def _measure(args: argparse.Namespace, armed: Path) -> dict[str, Any]:
    shm_before = _shm_files()
    probe = _fit(args, 2, None)  # also starts the forkserver: no timed run pays for it
    per_epoch = (probe["timeline"][-1][0] - probe["timeline"][0][0]) / 2
    epochs = max(2, math.ceil(args.minutes * 60 / per_epoch / args.segments))
    plain = _fit(args, epochs * args.segments, None, tolerant=False)
    del plain["state"]
    cleans, faulty = _alternating(args, epochs, armed)
    identical = all(torch.equal(c["state"][k], v) for c, x in zip(cleans, faulty, strict=True)
                    for k, v in x["state"].items())
    clean, chaos = _joined(cleans), _joined(faulty)
    costs = _fault_costs(chaos, _fired(armed, chaos["spans"]), _round_s(cleans))
    return {"machine": machine(), "config": {**vars(args), "epochs": epochs},
            "clean": clean, "chaos": chaos, "faults": costs,
            "plain": plain, "throughput_kept": clean["seconds"] / chaos["seconds"],
            "throughput_kept_from_costs": 1 - sum(c["lost_s"] for c in costs) / chaos["seconds"],
            "throughput_kept_by_pair": pair_ratios([r["seconds"] for r in cleans],
                                                   [r["seconds"] for r in faulty]),
            "tolerance_overhead": 1 - plain["seconds"] / clean["seconds"],
            "identical": identical,
            "lost_s_median_by_kind": {k: statistics.median(c["lost_s"] for c in costs
                                                           if c["kind"] == k)
                                      for k in sorted({c["kind"] for c in costs})},
            "shm_left": sorted(_shm_files() - shm_before)}


def _print(r: dict[str, Any], path: Path) -> None:
    c, x, pairs = r["clean"], r["chaos"], r["throughput_kept_by_pair"]
    print(f"chaos: {len(r['faults'])} faults, one every {r['config']['every']:g} s, "
          f"{r['config']['segments']} x {r['config']['epochs']} epochs, clean and chaos fits "
          f"alternating; clean {c['seconds']:.1f} s, "
          f"chaos {x['seconds']:.1f} s: "
          f"throughput kept {r['throughput_kept']:.3f} (from the faults' costs: "
          f"{r['throughput_kept_from_costs']:.3f}); pair by pair: "
          f"{pairs['min']:.3f} to {pairs['max']:.3f}, median {pairs['median']:.3f}")
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
