"""One device choice for training, inference, serving and Spark: ``devices=`` resolved.

``devices`` takes ``"auto"`` (every CUDA device, else the CPU), ``"cpu"``, ``"cuda"`` (every
CUDA device), one device (``"cuda:1"``), a list (``["cuda:0", "cuda:1"]``) or an int count
(that many GPUs, as Lightning's ``devices=2``; CPU replicas where there is no CUDA).

Replicas are dealt round robin over the resolved devices. In training, every replica is an
NCCL rank when all are GPUs, and NCCL refuses two ranks on one GPU: more workers than GPUs is
an error naming the fixes, unless the user listed a GPU once per replica that shares it
(``["cuda:0", "cuda:0"]``), which trains over gloo (slower collectives, but allowed).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DeviceSpec", "TrainingDevices", "resolve_devices", "replica_devices",
           "training_devices", "task_device", "cpu_cores", "parse_devices"]

DeviceSpec = str | int | torch.device | Sequence[str | torch.device] | None
"""What ``devices=`` takes; None means ``"auto"``."""

_HELP = ("expected a device ('cpu', 'cuda:0'), 'auto', 'cuda' (every GPU), a non-empty list "
         "of devices, or an int count of GPUs")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(d: str | torch.device) -> torch.device:
    try:
        device = torch.device(d)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"devices: {d!r} is not a device ({e}); {_HELP}") from None
    if device.type == "cuda":
        count = _cuda_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ValueError(f"devices: {d!r} asked for, but this machine has {have}; use "
                             "devices='auto' or 'cpu', or one of "
                             f"{[f'cuda:{i}' for i in range(count)]}")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"devices: {d!r} is a {device.type!r} device; paraloom runs on 'cpu' "
                         "and 'cuda' devices")
    return device


def resolve_devices(devices: DeviceSpec = "auto") -> list[torch.device]:
    """The devices the user chose, in order (a GPU listed twice stays twice)."""
    count = _cuda_count()
    if devices is None or devices == "auto":
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if devices == "cuda":
        if not count:
            raise ValueError("devices='cuda' but torch sees no CUDA device (torch.cuda."
                             "is_available() is False); use devices='auto' or 'cpu'")
        return [torch.device("cuda", i) for i in range(count)]
    if isinstance(devices, bool):
        raise TypeError(f"devices={devices!r}; {_HELP}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices={devices}; expected a count >= 1")
        if not count:
            return [torch.device("cpu")] * devices
        if devices > count:
            raise ValueError(f"devices={devices} GPUs asked for, but this machine has {count}; "
                             f"use devices={count} or fewer, or devices='cpu'")
        return [torch.device("cuda", i) for i in range(devices)]
    if isinstance(devices, (str, torch.device)):
        return [_device(devices)]
    if isinstance(devices, Sequence) and devices:
        return [_device(d) for d in devices]
    raise ValueError(f"devices={devices!r}; {_HELP}")


def replica_devices(devices: DeviceSpec, workers: int | None) -> list[torch.device]:
    """One device per replica, round robin (inference: threads may share a device);
    ``workers=None`` gives one replica per device."""
    pool = resolve_devices(devices)
    n = len(pool) if workers is None else workers
    return [pool[i % len(pool)] for i in range(n)]


@dataclass(frozen=True)
class TrainingDevices:
    """Where each training replica runs, the process group's backend, and CPU threads each."""

    devices: tuple[str, ...]
    backend: str
    threads: int

    @property
    def workers(self) -> int:
        return len(self.devices)


def cpu_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def training_devices(devices: DeviceSpec, workers: int | None, *,
                     cpu_workers: int = 2) -> TrainingDevices:
    """Resolve ``devices=`` and ``workers=`` for ParallelWrapper (``workers=None``: one per
    GPU, else ``cpu_workers``); raises ValueError when NCCL would need two ranks on one GPU."""
    pool = resolve_devices(devices)
    gpus = [d for d in pool if d.type == "cuda"]
    if workers is None:
        workers = len(pool) if gpus else max(cpu_workers, len(pool))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}; expected an int >= 1")
    most = max(8, 4 * cpu_cores())
    if not gpus and workers > most:  # each a process with torch and a model: memory runs out
        raise ValueError(f"workers={workers} on {cpu_cores()} CPU cores; expected at most "
                         f"{most} (4 per core): each worker is a process with its own copy of "
                         "torch and of the model, and past one per core they only share the "
                         "cores")
    chosen = [pool[i % len(pool)] for i in range(workers)]
    shared = [d for d, n in Counter(d for d in chosen if d.type == "cuda").items() if n > 1]
    listed_twice = len(set(gpus)) < len(gpus)
    if shared and not listed_twice:
        distinct = sorted({str(d) for d in gpus})
        raise ValueError(
            f"workers={workers} on {len(distinct)} GPU(s) ({', '.join(distinct)}) would put two "
            "NCCL ranks on one GPU, which NCCL refuses. Use workers="
            f"{len(distinct)} (one per GPU, as DL4J advises), or share a GPU on purpose by "
            "listing it once per worker, e.g. devices="
            f"{[str(d) for d in chosen]} (trains over gloo, slower than NCCL), or "
            "devices='cpu'")
    if workers == 1:
        backend = "none"
    elif gpus and not shared and all(d.type == "cuda" for d in chosen):
        backend = "nccl"
    else:
        backend = "gloo"  # the CPU, a shared GPU, or GPUs mixed with the CPU
    on_cpu = sum(d.type == "cpu" for d in chosen)
    threads = max(1, cpu_cores() // on_cpu) if on_cpu else 1
    return TrainingDevices(tuple(str(d) for d in chosen), backend, threads)


def task_device(local_rank: int, per_host: int, gpu_addresses: Sequence[str] = (),
                backend: str | None = None) -> tuple[str, str]:
    """A Spark barrier task's (device, backend): its GPU from Spark's resources, else a GPU by
    its rank among the ``per_host`` tasks on its host, else the CPU (gloo)."""
    count = _cuda_count()
    if not count:
        return "cpu", backend or "gloo"
    if gpu_addresses:
        # Spark hands out physical ids; with CUDA_VISIBLE_DEVICES set they are positions in it.
        return f"cuda:{int(gpu_addresses[0]) % count}", backend or "nccl"
    if per_host > count and backend in (None, "nccl"):
        raise ValueError(
            f"{per_host} training tasks on one host with {count} GPU(s) would put two NCCL ranks "
            "on one GPU, which NCCL refuses. Give each task a GPU (spark.task.resource.gpu."
            f"amount=1), use at most {count} partitions per host, or pass backend='gloo'")
    return f"cuda:{local_rank % count}", backend or "nccl"


def parse_devices(text: str) -> DeviceSpec:
    """``--devices`` on a command line: ``auto``, ``cpu``, ``cuda``, a GPU count (``2``), or a
    comma-separated list (``cuda:0,cuda:1``)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if "," in text:
        return [part.strip() for part in text.split(",") if part.strip()]
    return text
