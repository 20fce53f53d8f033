"""Input pipelines: ParallelWrapper with a DataLoader per worker against DDP with a
DistributedSampler, both with the same loaders (``num_workers`` loader processes per worker).

The data set is 3x64x64 images with a CPU-heavy augmentation (random resized crop, flip, colour
jitter, normalize), so the loaders do real work. Two configurations, each run for both
contenders in this process tree: a ResNet-style model (``train``), and big batches with a
near-free model (``data_path``: the data path alone, reported as GB/s of input reaching the
workers; there the parent-process path of a plain generator is measured too). For every run
the CPU time of the parent process is given as a share of the CPU time of the whole tree.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from paraloom.arguments import count, names, whole
from paraloom.bench.common import (
    Machine,
    machine,
    plain_args,
    pyplot,
    results_path,
    save_figure,
    write_results,
)
from paraloom.bench.ddp import join_group, run_ranks

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

__all__ = ["add_arguments", "run", "AugmentedImages", "augment"]

_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=count, default=2)
    p.add_argument("--num-workers", type=whole, default=1, help="loader processes per worker")
    p.add_argument("--images", type=count, default=2048, help="images per epoch")
    p.add_argument("--size", type=count, default=64, help="image side")
    p.add_argument("--batch-size", type=count, default=64, help="per worker (train config)")
    p.add_argument("--big-batch-size", type=count, default=256, help="per worker (data path)")
    p.add_argument("--epochs", type=count, default=2, help="timed epochs (after one warm-up)")
    p.add_argument("--mode", default="allreduce", help="ParallelWrapper training mode")
    p.add_argument("--configs", type=names(["train", "data_path"]), default="train,data_path",
                   help="comma-separated: train, data_path")
    p.add_argument("--out", type=results_path, default="benchmarks/results/data.json")


# -- the data ----------------------------------------------------------------------------------
def _resized_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)), bilinear."""
    _, h, w = img.shape
    area = h * w
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(0.08, 1.0))
        log_ratio = torch.log(torch.tensor([3 / 4, 4 / 3]))
        ratio = float(torch.exp(torch.empty(1).uniform_(float(log_ratio[0]),
                                                        float(log_ratio[1]))))
        cw, ch = round((target * ratio) ** 0.5), round((target / ratio) ** 0.5)
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, ()))
            left = int(torch.randint(0, w - cw + 1, ()))
            break
    else:
        ch, cw, top, left = h, w, 0, 0
    crop = img[:, top:top + ch, left:left + cw]
    return F.interpolate(crop[None], size=(size, size), mode="bilinear", antialias=True,
                         align_corners=False)[0]


def _gray(img: torch.Tensor) -> torch.Tensor:
    return (0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2])[None]


def _jitter(img: torch.Tensor, strength: float = 0.4, with_hue: bool = False) -> torch.Tensor:
    """torchvision's ColorJitter(brightness, contrast, saturation[, hue=0.1]), in random
    order."""
    def factor() -> float:
        return float(torch.empty(1).uniform_(1 - strength, 1 + strength))

    def brightness(x: torch.Tensor) -> torch.Tensor:
        return (x * factor()).clamp(0, 1)

    def contrast(x: torch.Tensor) -> torch.Tensor:
        return ((x - _gray(x).mean()) * factor() + _gray(x).mean()).clamp(0, 1)

    def saturation(x: torch.Tensor) -> torch.Tensor:
        return ((x - _gray(x)) * factor() + _gray(x)).clamp(0, 1)

    def hue(x: torch.Tensor) -> torch.Tensor:
        return _shift_hue(x, float(torch.empty(1).uniform_(-0.1, 0.1)))

    ops = [brightness, contrast, saturation, hue][:4 if with_hue else 3]
    for i in torch.randperm(len(ops)).tolist():
        img = ops[i](img)
    return img


def _shift_hue(img: torch.Tensor, shift: float) -> torch.Tensor:
    """RGB -> HSV, rotate the hue, -> RGB (as torchvision's adjust_hue does on tensors)."""
    r, g, b = img
    maxc, _ = img.max(0)
    minc, _ = img.min(0)
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    h = torch.where(maxc == r, ((g - b) / safe) % 6,
                    torch.where(maxc == g, (b - r) / safe + 2, (r - g) / safe + 4)) / 6
    h = torch.where(delta > 0, h, torch.zeros_like(h))
    s = torch.where(maxc > 0, delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc)),
                    torch.zeros_like(maxc))
    h = (h + shift) % 1.0
    i = torch.floor(h * 6)
    f = h * 6 - i
    p, q, t = maxc * (1 - s), maxc * (1 - s * f), maxc * (1 - s * (1 - f))
    i = i.long() % 6
    choices = torch.stack([torch.stack(c) for c in ((maxc, t, p), (q, maxc, p), (p, maxc, t),
                                                    (p, q, maxc), (t, p, maxc), (maxc, p, q))])
    return choices.gather(0, i[None, None].expand(1, 3, *i.shape))[0]


def augment(img: torch.Tensor, size: int) -> torch.Tensor:
    """Random resized crop, horizontal flip, colour jitter, normalize: a uint8 CHW image in,
    a normalized float image out."""
    x = _resized_crop(img.float() / 255, size)
    if float(torch.rand(())) < 0.5:
        x = x.flip(-1)
    return (_jitter(x) - _MEAN) / _STD


_Pair = tuple[torch.Tensor, torch.Tensor]
"""An (image, label) example of ``AugmentedImages``."""


class AugmentedImages(Dataset[_Pair]):
    """``n`` random 3 x size x size uint8 images (fixed by ``seed``), augmented on read."""

    def __init__(self, n: int, size: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.size = size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> _Pair:
        return augment(self.images[i], self.size), self.labels[i]


# -- the models --------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNetSmall(nn.Module):
    """A ResNet-style network for 64x64 images: a strided stem, three residual stages."""

    def __init__(self, classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(_Block(width, width, 1), _Block(width, 2 * width, 2),
                                    _Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.stages(self.stem(x)).mean((2, 3)))
        return logits


class NearFree(nn.Module):
    """Almost no compute: the time measured is the data path's."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.head = nn.Linear(3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(x.mean((2, 3)))
        return logits


def _model(config: str) -> nn.Module:
    torch.manual_seed(0)
    return ResNetSmall() if config == "train" else NearFree()


def _batch(args: argparse.Namespace, config: str) -> int:
    return int(args.batch_size if config == "train" else args.big_batch_size)


# -- CPU accounting ----------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    """CPU time of a process and of its children it has waited for (its loader processes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(pids: list[int]) -> float:
    return sum(_cpu_seconds(p) for p in pids)


# -- DDP ---------------------------------------------------------------------------------------
def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace, config: str,
                threads: int, out: Queue[tuple[int, float, float, float]]) -> None:
    join_group(rank, world, port, threads)
    model = nn.parallel.DistributedDataParallel(_model(config))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = AugmentedImages(args.images, args.size)
    sampler: DistributedSampler[int] = DistributedSampler(data, world, rank, shuffle=True,
                                                          seed=0, drop_last=True)

    def loader() -> DataLoader[_Pair]:
        return DataLoader(data, batch_size=_batch(args, config), sampler=sampler,
                          num_workers=args.num_workers, drop_last=True,
                          persistent_workers=args.num_workers > 0)

    rows = 0

    def epoch(e: int, loader: DataLoader[_Pair]) -> int:
        sampler.set_epoch(e)
        n = 0
        for x, y in loader:
            opt.zero_grad()
            # loss.backward(), through the function it calls: torch leaves that one unannotated
            torch.autograd.backward(F.cross_entropy(model(x), y))
            opt.step()
            n += len(x)
        return n

    epoch(0, loader())  # warm-up; its loader processes end here (as a fit's do)
    dist.barrier()
    cpu = _cpu_seconds(os.getpid())
    start = time.perf_counter()
    timed = loader()
    for e in range(args.epochs):
        rows += epoch(e + 1, timed)
    dist.barrier()
    seconds = time.perf_counter() - start
    del timed  # its loader processes exit and are reaped: their CPU counts
    out.put((rank, rows / seconds, seconds, _cpu_seconds(os.getpid()) - cpu))
    dist.destroy_process_group()


def _ddp(args: argparse.Namespace, config: str, threads: int) -> dict[str, float]:
    """Samples/s of DDP, each rank with a DistributedSampler and its own DataLoader."""
    parent = time.process_time()
    # Not daemons: the ranks start loader processes.
    reports = run_ranks(_ddp_worker, args.workers, (args, config, threads),
                        replies=args.workers, timeout_s=900, daemon=False)
    seconds = max(r[2] for r in reports)
    rows = sum(r[1] * r[2] for r in reports)
    workers_cpu = sum(r[3] for r in reports)
    return {"samples_per_s": rows / seconds, "parent_cpu_s": time.process_time() - parent,
            "workers_cpu_s": workers_cpu}


# -- ParallelWrapper ---------------------------------------------------------------------------
class _Clock:
    """Round completion times and rows: the steady-state rate."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, iteration: int, epoch: int, loss: float) -> None:
        self.times.append(time.perf_counter())


def _through_parent(loader: DataLoader[_Pair]) -> Iterator[object]:
    yield from loader


class _Batches:
    """A re-iterable of the loader's batches that ParallelWrapper cannot see into: the
    parent process reads it and moves each batch to the workers (the old path)."""

    def __init__(self, loader: DataLoader[_Pair]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[object]:
        return _through_parent(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def _paraloom(args: argparse.Namespace, config: str, parent_path: bool) -> dict[str, float]:
    """Samples/s of ParallelWrapper with a DataLoader run by each worker (or, ``parent_path``,
    the same loader read by this process)."""
    from paraloom import ParallelWrapper

    model = _model(config)
    data = AugmentedImages(args.images, args.size)
    nw = args.num_workers * (args.workers if parent_path else 1)  # as many loader processes
    loader = DataLoader(data, batch_size=_batch(args, config), shuffle=True, drop_last=True,
                        num_workers=nw, persistent_workers=nw > 0,
                        generator=torch.Generator().manual_seed(0))
    source: Iterable[object] = _Batches(loader) if parent_path else loader
    clock = _Clock()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=args.workers,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                         training_mode=args.mode, progress=False, listeners=[clock]) as w:
        w.fit(source, epochs=1)  # starts the workers; warm-up
        clock.times.clear()
        pids = w.worker_pids
        workers_cpu, parent_cpu = _tree_cpu(pids), time.process_time()
        stats = w.fit(source, epochs=args.epochs)
        parent_cpu = time.process_time() - parent_cpu
        workers_cpu = _tree_cpu(pids) - workers_cpu
    rows_per_round = _batch(args, config) * args.workers
    steady = (len(clock.times) - 1) * rows_per_round / (clock.times[-1] - clock.times[0])
    return {"samples_per_s": steady, "fit_samples_per_s": stats["samples_per_s"],
            "parent_cpu_s": parent_cpu, "workers_cpu_s": workers_cpu}


# -- the report --------------------------------------------------------------------------------
class DataResults(TypedDict):
    """The JSON that ``run`` writes."""

    machine: Machine
    config: dict[str, object]
    augment_ms_per_image: float
    runs: dict[str, dict[str, dict[str, float]]]
    """Configuration -> contender -> samples/s, GB/s, CPU seconds and shares, ratio to DDP."""


def _augment_ms(args: argparse.Namespace) -> float:
    data = AugmentedImages(64, args.size)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader process
    try:
        start = time.perf_counter()
        for i in range(64):
            data[i]
        return (time.perf_counter() - start) / 64 * 1e3
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    cores = machine()["cores"] or 1
    threads = max(1, cores // args.workers)
    image_bytes = 3 * args.size * args.size * 4
    results: DataResults = {"machine": machine(), "config": vars(args).copy(),
                            "augment_ms_per_image": _augment_ms(args), "runs": {}}
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        runs: dict[str, dict[str, float]] = {"ddp": _ddp(args, config, threads),
                                             "paraloom": _paraloom(args, config, False)}
        if config == "data_path":
            runs["paraloom_through_parent"] = _paraloom(args, config, True)
        for r in runs.values():
            r["gb_per_s"] = r["samples_per_s"] * image_bytes / 1e9
            r["parent_cpu_share"] = r["parent_cpu_s"] / max(
                1e-9, r["parent_cpu_s"] + r["workers_cpu_s"])
            r["ratio_to_ddp"] = r["samples_per_s"] / runs["ddp"]["samples_per_s"]
        results["runs"][config] = runs
    path = write_results(args.out, results)
    _print(results, path)
    _plot(results, path.with_suffix(".png"))
    return 0


def _print(results: DataResults, path: Path) -> None:
    print(f"augmentation: {results['augment_ms_per_image']:.2f} ms per image (one thread)")
    print(f"{'config':<11}{'contender':<26}{'samples/s':>11}{'GB/s':>8}{'/DDP':>7}"
          f"{'parent CPU':>12}")
    for config, runs in results["runs"].items():
        for name, r in runs.items():
            print(f"{config:<11}{name:<26}{r['samples_per_s']:>11.0f}{r['gb_per_s']:>8.3f}"
                  f"{r['ratio_to_ddp']:>7.2f}{100 * r['parent_cpu_share']:>11.1f}%")
    print(f"results written to {path}")


def _plot(results: DataResults, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    configs = list(results["runs"])
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 3.5), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=True):
        runs = results["runs"][config]
        ax.bar(list(runs), [r["samples_per_s"] for r in runs.values()],
               color=["#888888", "#1f77b4", "#ff7f0e"][:len(runs)])
        ax.set_title(f"{config}: samples/s")
        ax.tick_params(axis="x", labelrotation=15)
    save_figure(fig, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
