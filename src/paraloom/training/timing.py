"""Where a worker's time goes per round: its step, its synchronizer, and the rest.

The rest (``overhead``) is paraloom's own fixed cost per round in the worker: taking the
round's message and sending the reply. Taking the round's batch (gathering its rows from the
dataset, or the replica's own DataLoader) is counted apart: any shuffled epoch costs that.
``paraloom bench training`` reports the overhead beside the parent's CPU time per round.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoundTiming"]


@dataclass
class RoundTiming:
    """Seconds one worker spent in the rounds of a fit (``perf_counter`` sums)."""

    rounds: int = 0
    round_s: float = 0.0
    """From a round's message in hand to its reply sent."""
    data_s: float = 0.0
    """Taking the round's batch: gathering its rows, or the replica's own DataLoader."""
    step_s: float = 0.0
    """Forward, loss, backward and the optimizer step (DDP's all-reduce runs in backward)."""
    sync_s: float = 0.0
    """The synchronizer's hooks: before_step, after_backward, after_step, idle_step."""
    compile_s: float = 0.0
    """``torch.compile``: the first forward and backward of a compiled model (in ``step_s``
    too)."""

    def reset(self) -> None:
        """A new fit: nothing counted."""
        self.rounds, self.round_s, self.data_s, self.step_s, self.sync_s = 0, 0.0, 0.0, 0.0, 0.0
        self.compile_s = 0.0

    def stats(self) -> dict[str, float]:
        """Seconds per round: the whole round, taking its batch, the step, the hooks, and
        what is left (``overhead_seconds``: paraloom's messages and bookkeeping); and the
        seconds ``torch.compile`` took in all (``compile_seconds``)."""
        n = max(1, self.rounds)
        rest = self.round_s - self.data_s - self.step_s - self.sync_s
        return {"round_seconds": self.round_s / n, "data_seconds": self.data_s / n,
                "step_seconds": self.step_s / n, "sync_hook_seconds": self.sync_s / n,
                "overhead_seconds": max(0.0, rest) / n, "compile_seconds": self.compile_s}
