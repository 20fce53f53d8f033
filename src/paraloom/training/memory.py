"""The worker processes' memory allocator: keep freed blocks for the next step.

A training step frees and allocates the same large tensors every step: activations, the logits,
the gradients (``zero_grad(set_to_none=True)`` frees them). glibc's malloc serves a block above
its mmap threshold (128 KiB, raised as such blocks are freed, to at most 32 MiB) with a fresh
``mmap`` and unmaps it on ``free``, and it trims the top of its heap once more than twice that
threshold is free; so each step faults its pages in again and the kernel zeroes them. Measured
on the 2-core development machine, one thread, plain PyTorch: 5,800 to 6,200 page faults and 13
to 18 ms of system time per step for the 3.5M-parameter transformer of ``bench.models`` (about
5% of its CPU time), 37,000 faults and 65 ms for the 37.8M-parameter MLP (a 4096 x 4096
gradient is 64 MiB, above any threshold; 21% of its CPU time). With ``mmap`` off and trimming
only above 1 GiB, the freed blocks are reused: 0 to 600 faults and 1 to 5 ms per step, for
about 50 MB more resident memory.

The worker processes are paraloom's own, so they keep freed memory by default;
``PARALOOM_WORKER_MALLOC=system`` leaves glibc's defaults. Elsewhere (not Linux, not glibc)
nothing changes. The process that calls ``fit()`` is never touched.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MALLOC_CHOICES", "worker_malloc", "keep_freed_memory"]

MALLOC_CHOICES = ("keep", "system")
"""``keep``: freed blocks stay in the process for reuse; ``system``: glibc's defaults."""

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap kept before any is given back to the kernel."""


def worker_malloc() -> str:
    """The allocator policy for new worker processes, from ``PARALOOM_WORKER_MALLOC``."""
    choice = os.environ.get("PARALOOM_WORKER_MALLOC", "keep").strip().lower()
    if choice not in MALLOC_CHOICES:
        raise ValueError(f"PARALOOM_WORKER_MALLOC={choice!r}; expected one of "
                         f"{list(MALLOC_CHOICES)} ('system' leaves glibc's malloc as it is)")
    return choice


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """In this process, make glibc's malloc serve every block from its heap (no ``mmap`` per
    block) and give memory back only above ``trim_threshold`` free bytes; returns whether the
    settings were applied (False where the C library is not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this interpreter already runs on
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 for a value it refuses.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
