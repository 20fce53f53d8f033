"""``paraloom bench training --device cuda``: the 1..N GPU scaling table.

For each GPU count n (1, 2, ... every visible GPU), ParallelWrapper trains
the training benchmark's model with one worker per GPU (``devices=n``, NCCL from n = 2) in each
mode; the baseline is a plain training loop on ``cuda:0`` in this process, the same batch per
step. Speed-up is against that loop, efficiency is speed-up / n.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.bench.common import machine, write_results

__all__ = ["gpu_counts", "run_gpu"]


def gpu_counts(available: int) -> list[int]:
    """1, 2, ... every GPU; the error says what to do when there is none."""
    if available < 1:
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() "
                         "is False); run on a GPU machine, or use --device cpu")
    return list(range(1, available + 1))


def _plain_loop(args: argparse.Namespace, data: TensorDataset) -> float:
    """Samples/s of a plain training loop on cuda:0 (the data already on the GPU)."""
    from paraloom.bench.training import _model, _sgd

    device = torch.device("cuda", 0)
    model, loss_fn = _model(args).to(device), nn.CrossEntropyLoss()
    opt = _sgd(model.parameters())
    x, y = (t.to(device) for t in data.tensors)
    bs = args.batch_size

    def epoch() -> None:
        for i in range(0, len(x) - bs + 1, bs):
            opt.zero_grad()
            loss_fn(model(x[i:i + bs]), y[i:i + bs]).backward()
            opt.step()

    epoch()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    torch.cuda.synchronize(device)
    return args.epochs * (len(x) // bs) * bs / (time.perf_counter() - start)


def _paraloom(args: argparse.Namespace, data: TensorDataset, gpus: int, mode: str) -> float:
    """Steady-state samples/s of ParallelWrapper on ``gpus`` GPUs, one worker each."""
    from paraloom import ParallelWrapper
    from paraloom.bench.training import _Clock, _model, _sgd

    model = _model(args)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    kwargs: dict[str, Any] = {"averaging_frequency": 3} if mode == "averaging" else {}
    clock = _Clock()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=_sgd(model.parameters()),
                         devices=gpus, workers=gpus, training_mode=mode, progress=False,
                         listeners=[clock], **kwargs) as wrapper:
        wrapper.fit(loader, epochs=1)  # starts the workers; warm-up
        clock.times.clear()
        wrapper.fit(loader, epochs=args.epochs)
    return (len(clock.times) - 1) * args.batch_size * gpus / (clock.times[-1] - clock.times[0])


def run_gpu(args: argparse.Namespace, data: TensorDataset) -> int:
    """Measure and print the scaling table; writes JSON next to the CPU benchmark's."""
    counts = gpu_counts(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    baseline = _plain_loop(args, data)
    rows = [{"gpus": n, "mode": mode, "samples_per_s": _paraloom(args, data, n, mode)}
            for mode in modes for n in counts]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / baseline
        row["efficiency"] = row["speedup"] / row["gpus"]
    results = {"machine": {**machine(), "gpus": [torch.cuda.get_device_name(i)
                                                 for i in range(torch.cuda.device_count())]},
               "config": vars(args).copy(),
               "plain_loop_cuda0_samples_per_s": baseline, "scaling": rows}
    out = Path(args.out)
    path = write_results(str(out.with_name(out.stem + "_cuda" + out.suffix)), results)
    print(f"plain loop on cuda:0: {baseline:.0f} samples/s (batch {args.batch_size} per GPU)")
    print(f"{'mode':<18}{'GPUs':>5}{'samples/s':>12}{'speed-up':>10}{'efficiency':>12}")
    for row in rows:
        print(f"{row['mode']:<18}{row['gpus']:>5}{row['samples_per_s']:>12.0f}"
              f"{row['speedup']:>10.2f}{row['efficiency']:>12.2f}")
    print(f"results written to {path}")
    return 0
