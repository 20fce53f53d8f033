"""Training throughput: ParallelWrapper against single-process training and PyTorch DDP.

For each model (``--model``: LeNet 0.43M parameters, a small GPT-style transformer 3.5M,
ResNet-18 11.2M, a wide MLP 37.8M; see ``bench.models``), every contender trains the same model
on the same synthetic data with the same per-worker batch, in this process tree, one after the
other. The report gives steady-state samples/s with ratios against the linear limit (workers x
the single-thread rate) and against DDP, the rate of a whole 30-round ``fit()`` on the warm
pool against the same mode's steady rate, and the bytes each worker sends per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from paraloom.arguments import count
from paraloom.bench.common import (
    machine,
    plain_args,
    plain_epoch,
    results_path,
    steady_rate,
    with_threshold,
    write_results,
)
from paraloom.bench.ddp import join_group, run_ranks
from paraloom.bench.models import WORKLOADS, Workload, bench_sgd, mlp_of_width, workload
from paraloom.bench.training_report import (
    WHOLE_FIT_REPEATS,
    FixedCost,
    Measured,
    ModelResults,
    ModeResult,
    TrainingResults,
    plot_ratios,
    print_model,
)

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from paraloom.training.tracker import FitStats

__all__ = ["add_arguments", "run"]


_ROUNDS = {"lenet": 64, "transformer": 8, "resnet18": 8, "mlp": 8}
"""Rounds per timed epoch by default: enough for a steady rate, few for the large models."""
_BATCH = {"lenet": 64, "transformer": 8, "resnet18": 16, "mlp": 64}
"""Rows per worker per step by default (8 x 128 tokens for the transformer): each model's
step then costs 0.3-0.5 s on one core, so the whole table takes minutes, not hours."""
_SWEEP = (256, 1024, 4096)
"""``--sweep``: the widths of the 784-W-W-W-10 MLP (0.3M, 2.9M and 37M parameters)."""


def _width_rounds(width: int) -> int:
    """Rounds per timed epoch of the W-wide MLP: about a second of steps at batch 64."""
    return max(8, min(256, 2**26 // (width * width)))


_WHOLE_FIT_ROUNDS = 30
_STEADY_ROUNDS = 48
"""Rounds at least in the steady-state fit(): a round of timing error is then 2%, not 7%."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lenet",
                   help="comma-separated, or 'all': " + ", ".join(WORKLOADS))
    p.add_argument("--width", type=count, default=None,
                   help="with --model mlp: a 784-W-W-W-10 MLP instead of the 37.8M one")
    p.add_argument("--sweep", action="store_true",
                   help="the 784-W-W-W-10 MLP at W = " + ", ".join(map(str, _SWEEP))
                        + " (with the --modes given), batch 64 per worker")
    p.add_argument("--workers", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=None,
                   help="per worker (default: " + ", ".join(f"{m} {b}" for m, b in
                                                           _BATCH.items()) + ")")
    p.add_argument("--samples", type=count, default=None,
                   help="training rows per epoch (default: "
                        + ", ".join(f"{m} {r} rounds" for m, r in _ROUNDS.items()) + ")")
    p.add_argument("--epochs", type=count, default=2, help="timed epochs (after one warm-up)")
    p.add_argument("--repeat", type=count, default=1,
                   help="measure the modes (each between two DDP runs) this many times; each "
                        "ratio to DDP is the median of its runs")
    p.add_argument("--modes", type=_modes, default="averaging,allreduce,shared_gradients",
                   help="ParallelWrapper modes to measure, comma-separated; a suffix "
                        "+blocking (each exchange waited for in its step) or +sampled (that, "
                        "and messages at their own lengths) sets options: "
                        "shared_gradients+blocking")
    p.add_argument("--ddp-malloc", default="system", choices=["system", "keep"],
                   help="the DDP ranks' allocator: 'system' (glibc's defaults, as PyTorch runs) "
                        "or 'keep' (the setting ParallelWrapper's workers use, training.memory)")
    p.add_argument("--accumulate", type=count, default=1,
                   help="gradient accumulation: batches per optimizer step and exchange, in "
                        "every contender (DDP: no_sync() for all but the last)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each contender's model (its compile time is reported "
                        "apart: the warm-up epoch takes it)")
    p.add_argument("--out", type=results_path, default="benchmarks/results/training.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the 1..N GPU scaling table instead (see bench.gpu_scaling)")


def _workload(args: argparse.Namespace) -> Workload:
    width = getattr(args, "width", None)
    return workload(args.model) if width is None else mlp_of_width(width)


def _data(args: argparse.Namespace) -> TensorDataset:
    width = getattr(args, "width", None)
    rounds = _ROUNDS[args.model] if width is None else _width_rounds(width)
    rows = args.samples or rounds * args.batch_size * args.workers
    return _workload(args).data(rows, torch.Generator().manual_seed(0))


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return _workload(args).build()


def _loss(args: argparse.Namespace) -> nn.Module:
    return _workload(args).loss()


def _sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return bench_sgd(params)


def _single(args: argparse.Namespace, data: TensorDataset, threads: int) -> float:
    """Samples/s of a plain training loop in this process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, loss_fn = _model(args), _loss(args)
        opt = _sgd(model.parameters())
        if getattr(args, "compile", False):
            model = torch.compile(model)  # type: ignore[assignment]
        x, y = data.tensors
        plain_epoch(model, loss_fn, opt, x, y, args.batch_size)  # warm-up
        start = time.perf_counter()
        rows = sum(plain_epoch(model, loss_fn, opt, x, y, args.batch_size)
                   for _ in range(args.epochs))
        return rows / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace,
                data: TensorDataset, threads: int, out: Queue[float]) -> None:
    if getattr(args, "ddp_malloc", "system") == "keep":
        from paraloom.training.memory import keep_freed_memory

        keep_freed_memory()
    join_group(rank, world, port, threads)
    inner = _model(args)
    if getattr(args, "compile", False):
        inner = torch.compile(inner)  # type: ignore[assignment]
    model = nn.parallel.DistributedDataParallel(inner)
    opt, loss_fn = _sgd(model.parameters()), _loss(args)
    x, y = data.tensors
    bs, accumulate = args.batch_size, getattr(args, "accumulate", 1)
    steps = len(x) // (bs * world)
    shuffle = torch.Generator().manual_seed(0)

    def backward(rows: torch.Tensor) -> None:
        loss = loss_fn(model(x.index_select(0, rows)), y.index_select(0, rows))
        (loss / accumulate if accumulate > 1 else loss).backward()

    def epoch() -> None:
        # DistributedSampler(shuffle=True): one permutation per epoch, the same on every rank,
        # rank r taking every world-th batch; each batch gathered from the TensorDataset as
        # paraloom's workers gather theirs (index_select), so both sides do the same data work.
        # With accumulation, all but the last batch of a step run in no_sync() (Lightning's
        # way), the epoch's last batches stepping on what they add up.
        order = torch.randperm(len(x), generator=shuffle)
        for s in range(steps):
            rows = order[(s * world + rank) * bs:(s * world + rank + 1) * bs]
            if s % accumulate == 0:
                opt.zero_grad()
            if (s + 1) % accumulate and s + 1 < steps:
                with model.no_sync():
                    backward(rows)
                continue
            backward(rows)
            opt.step()

    epoch()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    dist.barrier()
    if rank == 0:
        out.put(args.epochs * steps * bs * world / (time.perf_counter() - start))
    dist.destroy_process_group()


def _ddp(args: argparse.Namespace, data: TensorDataset, threads: int) -> float:
    """Samples/s of PyTorch DDP with ``args.workers`` gloo processes, on shuffled epochs (as
    ParallelWrapper trains them here)."""
    # Rank 0 alone reports the rate.
    [rate] = run_ranks(_ddp_worker, args.workers, (args, data, threads), replies=1,
                       timeout_s=600)
    return float(rate)


class _Clock:
    """Timestamps of round completions: the steady-state rate, as the DDP loop is timed."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, iteration: int, epoch: int, loss: float) -> None:
        self.times.append(time.perf_counter())


_VARIANTS: dict[str, dict[str, Any]] = {
    "blocking": {"overlap": False},
    "sampled": {"overlap": False, "threshold_algorithm": ("QuantileThreshold", 1 / 160)},
}
"""``--modes`` suffixes: ``shared_gradients+blocking`` is shared gradients with these options
(blocking: each exchange waited for in its step; sampled: that, and messages at their own
lengths)."""


def _modes(text: str) -> str:
    """``--modes``, checked before anything runs: each entry a training mode, with known
    variants."""
    from paraloom.sync.registry import training_modes

    known = [m for m in training_modes() if m != "custom"]
    entries = [m.strip() for m in text.split(",") if m.strip()]
    for mode in entries or [text]:
        try:
            name, _ = _mode_options(mode)  # refuses an unknown variant
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"{mode!r}: expected comma-separated modes of {known}, each with optional "
                f"variants +{' or +'.join(sorted(_VARIANTS))}")
    return text


def _mode_options(mode: str) -> tuple[str, dict[str, Any]]:
    """The training mode and ParallelWrapper options of a ``--modes`` entry."""
    name, *variants = mode.split("+")
    options: dict[str, Any] = {"averaging_frequency": 3} if name == "averaging" else {}
    for variant in variants:
        if variant not in _VARIANTS:
            raise ValueError(f"--modes entry {mode!r}: unknown variant {variant!r}; expected "
                             f"one of {sorted(_VARIANTS)}")
        options.update(with_threshold(_VARIANTS[variant]))
    return name, options


def _wrapper(args: argparse.Namespace, data: TensorDataset, mode: str) -> ModeResult:
    """Samples/s (steady state, whole fit() of 30 rounds) and bytes/step in one mode."""
    from paraloom import ParallelWrapper, StepOptions

    model = _model(args)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    rows_per_round = args.batch_size * args.workers
    short = DataLoader(Subset(data, range(min(len(data), _WHOLE_FIT_ROUNDS * rows_per_round))),
                       batch_size=args.batch_size, shuffle=True, drop_last=True)
    name, kwargs = _mode_options(mode)
    clock = _Clock()
    steps = StepOptions(accumulate=getattr(args, "accumulate", 1),
                        compile=getattr(args, "compile", False))
    with ParallelWrapper(model, loss_fn=_loss(args), optimizer=_sgd(model.parameters()),
                         workers=args.workers, training_mode=name, progress=False,
                         listeners=[clock], steps=steps, **kwargs) as wrapper:
        warm = wrapper.fit(loader, epochs=1)  # starts the workers (and compiles); warm-up
        clock.times.clear()
        rounds = -(-len(loader) // args.workers)
        stats = wrapper.fit(loader, epochs=max(args.epochs, -(-_STEADY_ROUNDS // rounds)))
        # From the third round on: a listener runs when the parent takes the replies, which
        # the first rounds' dealing can hold back by a round (seen as two rounds in one gap).
        steady = steady_rate(clock.times, rows_per_round)
        rounds_per_epoch = -(-len(short) // args.workers)
        wholes = []
        for _ in range(WHOLE_FIT_REPEATS):
            clock.times.clear()
            start = time.perf_counter()  # a whole call: the model if changed, rounds, final sync
            wrapper.fit(short, epochs=-(-_WHOLE_FIT_ROUNDS // rounds_per_epoch))
            wholes.append(len(clock.times) * rows_per_round / (time.perf_counter() - start))
        whole = statistics.median(wholes)
    per_step = stats["bytes_sent_per_step"]
    phases = {k.removeprefix("seconds_").removesuffix("_per_step"): v
              for k, v in stats["per_worker"][0].items() if k.startswith("seconds_")}
    return {"samples_per_s": steady, "fit_samples_per_s": stats["samples_per_s"],
            "whole_fit_30_samples_per_s": whole, "sync_seconds_per_step": phases,
            "step_seconds": rows_per_round / steady,
            "bytes_per_step_per_worker": sum(per_step) / len(per_step),
            "fixed_cost": _fixed_cost(stats, rows_per_round / steady),
            "compile_seconds": warm["compile_seconds"]}


def _fixed_cost(stats: FitStats, round_s: float) -> FixedCost:
    """The parent's CPU and the workers' time outside their steps and hooks, per round."""
    workers = stats["per_worker"]
    outside = statistics.mean(w.get("overhead_seconds", 0.0) for w in workers)
    data = statistics.mean(w.get("data_seconds", 0.0) for w in workers)
    hooks = statistics.mean(w.get("sync_hook_seconds", 0.0) for w in workers)
    parent = stats["parent_cpu_seconds_per_round"]
    return {"round": round_s, "parent_cpu": parent, "worker_outside": outside,
            "worker_data": data, "worker_hooks": hooks, "share": (parent + outside) / round_s}


def _measure(args: argparse.Namespace) -> ModelResults:
    """Every contender on one model (``args.model``). DDP runs before and after each mode,
    whose ratio is over the mean of the two (the machine's speed drifts by 10-20% over
    minutes: both sides of a ratio then see the same); with ``--repeat R`` all of it R times,
    each ratio the median of its R."""
    cores = machine()["cores"] or 1
    threads = max(1, cores // args.workers)
    data = _data(args)
    parameters = sum(p.numel() for p in _model(args).parameters())
    sps: dict[str, float] = {}
    results: Measured = {"parameters": parameters, "rows_per_epoch": len(data),
                          "batch_size_per_worker": args.batch_size,
                          "threads_per_worker": threads, "samples_per_s": sps,
                          "bytes_per_step_per_worker": {}, "whole_fit_30_samples_per_s": {}}
    sps["single_1_thread"] = _single(args, data, 1)
    sps[f"single_{cores}_threads"] = _single(args, data, cores)
    results["bytes_per_step_per_worker"]["ddp"] = \
        2 * (args.workers - 1) / args.workers * 4 * parameters
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs: dict[str, list[float]] = {"ddp": []}
    ratios: dict[str, list[float]] = {"ddp": []}
    for _ in range(max(1, getattr(args, "repeat", 1))):
        before = _ddp(args, data, threads)
        runs["ddp"].append(before)
        ratios["ddp"].append(1.0)
        for mode in modes:
            _measure_mode(args, data, mode, results)
            after = _ddp(args, data, threads)  # DDP brackets each mode: drift moves both
            runs["ddp"].append(after)
            ratios["ddp"].append(1.0)
            name = f"paraloom_{mode}"
            if name in sps:
                runs.setdefault(name, []).append(sps[name])
                ratios.setdefault(name, []).append(sps[name] / ((before + after) / 2))
            before = after
    sps.update({k: statistics.median(rates) for k, rates in runs.items()})
    linear = args.workers * sps["single_1_thread"]
    ratio_to_ddp = {k: v / sps["ddp"] for k, v in sps.items()}
    ratio_to_ddp.update({k: statistics.median(r) for k, r in ratios.items()})
    return {**results,
            "ratio_to_linear": {k: v / linear for k, v in sps.items()},
            "ratio_to_ddp": ratio_to_ddp, "ratio_to_ddp_runs": ratios,
            "whole_fit_30_to_steady": {
                k: v / sps[k] for k, v in results["whole_fit_30_samples_per_s"].items()}}


def _measure_mode(args: argparse.Namespace, data: TensorDataset, mode: str,
                  results: Measured) -> None:
    """Add one ``--modes`` entry's numbers to ``results`` (or why it was skipped)."""
    try:
        r = _wrapper(args, data, mode)
    except (ImportError, ValueError) as e:  # a mode this version does not have
        results.setdefault("skipped", {})[mode] = str(e)
        return
    name = f"paraloom_{mode}"
    results["samples_per_s"][name] = r["samples_per_s"]
    results["whole_fit_30_samples_per_s"][name] = r["whole_fit_30_samples_per_s"]
    results["bytes_per_step_per_worker"][name] = r["bytes_per_step_per_worker"]
    results.setdefault("fixed_cost", {})[name] = r["fixed_cost"]
    if r["compile_seconds"]:
        results.setdefault("compile_seconds", {})[name] = r["compile_seconds"]
    if r["sync_seconds_per_step"]:  # where a step's time goes (shared_gradients)
        results.setdefault("sync_seconds_per_step", {})[name] = {
            "step": r["step_seconds"], **r["sync_seconds_per_step"]}


def _runs(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """The (model, width) pairs to measure; an unknown name or a misplaced width fails here,
    before anything runs."""
    if args.sweep:
        return [("mlp", width) for width in _SWEEP]
    names = list(WORKLOADS) if args.model == "all" else \
        [m.strip() for m in args.model.split(",") if m.strip()]
    for name in names:
        workload(name)
    if args.width is not None:
        if names != ["mlp"]:
            raise ValueError(f"--width {args.width} applies to --model mlp only; got --model "
                             f"{args.model}")
        mlp_of_width(args.width)
    return [(name, args.width) for name in names]


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    runs = _runs(args)
    names = [name for name, _ in runs]
    if args.device == "cuda":
        if len(names) != 1:
            raise ValueError("--device cuda measures one --model at a time")
        from paraloom.bench.gpu_scaling import run_gpu

        args.model, args.batch_size = names[0], args.batch_size or _BATCH[names[0]]
        return run_gpu(args, _data(args), lambda: _model(args), _sgd, lambda: _loss(args))
    results: TrainingResults = {"machine": machine(), "config": vars(args).copy(), "models": {}}
    batch_size = args.batch_size
    for name, width in runs:
        args.model, args.width, args.batch_size = name, width, batch_size or _BATCH[name]
        key = _workload(args).name
        results["models"][key] = _measure(args)
        print_model(key, results["models"][key])
        write_results(args.out, results)  # after each model: a long run keeps what it measured
    path = write_results(args.out, results)
    plot_ratios(results, Path(args.out).with_suffix(".png"))
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
