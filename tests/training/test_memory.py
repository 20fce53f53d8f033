"""Worker processes keep freed memory for the next step (``training.memory``)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper
from paraloom.training.memory import worker_malloc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")]

_BLOCK = 64 * 2**20  # above glibc's largest mmap threshold (32 MiB): always mmapped by default


def _faults_of_a_reallocated_block() -> int:
    """Page faults of filling a 64 MiB tensor and freeing it (what every step of training does
    with its large activations and gradients), in this process's steady state: after the same
    was done a few times (the heap settles in a few steps: a freed block's neighbours must be
    free too before a block of the same size fits in its place)."""
    faults = 0
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(_BLOCK // 4).fill_(1.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


_PROBE = f"""
import sys
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from paraloom.training.memory import keep_freed_memory
from test_memory import _faults_of_a_reallocated_block
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
print(applied, _faults_of_a_reallocated_block())
"""


def _probe(policy: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, policy], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    # A fresh interpreter each: the setting is per process, and pytest's must stay as it is.
    applied, kept = _probe("keep")
    _, default = _probe("system")
    pages = _BLOCK // resource.getpagesize()
    assert applied == "True"
    assert default > pages // 2  # glibc unmapped the first block: every page faults again
    assert kept < pages // 20


def test_the_policy_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("PARALOOM_WORKER_MALLOC", raising=False)
    assert worker_malloc() == "keep"
    monkeypatch.setenv("PARALOOM_WORKER_MALLOC", " System ")
    assert worker_malloc() == "system"
    monkeypatch.setenv("PARALOOM_WORKER_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="PARALOOM_WORKER_MALLOC='jemalloc'.*'keep', 'system'"):
        worker_malloc()


def _faults_step(model: nn.Module, batch) -> torch.Tensor:
    """A step_fn whose loss is the page faults of a reallocated 64 MiB block in the worker."""
    x, _ = batch
    return model(x).sum() * 0.0 + float(_faults_of_a_reallocated_block())


@pytest.mark.parametrize("policy", ["keep", "system"])
def test_workers_apply_the_policy(monkeypatch, policy):
    monkeypatch.setenv("PARALOOM_WORKER_MALLOC", policy)
    losses: list[float] = []
    model = nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 6
    with ParallelWrapper(model, step_fn=_faults_step, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                         listeners=[lambda i, e, loss: losses.append(loss)]) as wrapper:
        wrapper.fit(data)
    pages = _BLOCK // resource.getpagesize()
    assert len(losses) == 3
    if policy == "keep":
        assert max(losses[1:]) < pages // 20
    else:
        assert min(losses) > pages // 2
