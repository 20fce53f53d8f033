"""How many rounds travel in one message: enough that messaging stays a small share of a step.

Every message between the parent and a worker costs both processes CPU time (pickling, a
pipe, waking a thread), about a millisecond per round for two workers on a loaded CPU. Where
a step takes milliseconds (a small model, a fast GPU), that is a tenth of the round. So the
parent deals rounds in batches (``RoundBatch``), each worker answers a batch with one
``RoundsDone``, and ``Pacing`` sizes the batches from the rounds' measured length: about
``TARGET_S`` of training per message, at most ``MAX_ROUNDS_PER_MESSAGE``, one round per
message where a step takes longer.

Batching changes no result: the same rounds, in the same order, with the same checkpoints
(the parent sends what it has before a checkpoint request) and the same ``stop()`` (each round
of a batch passes the workers' gate on its own).
"""

from __future__ import annotations

import time

from paraloom.training.messages import RoundBatch, RoundMessage
from paraloom.training.pool import Pool

__all__ = ["MAX_ROUNDS_PER_MESSAGE", "RECOVERING_TARGET_S", "TARGET_S", "Pacing", "PendingRounds"]

TARGET_S = 0.5
"""Seconds of training per message to aim for. Replies then come every half second or so where
steps are short: listeners and the progress bar see those rounds up to that much later (a
round's replies arrive together), while ``stop()`` still ends the fit after the round in
flight. Measured on 2 workers x 1 core: a message round trip costs the parent 0.5-1.5 ms of
CPU on a loaded machine (pickling, pipes, waking its queue threads)."""
MAX_ROUNDS_PER_MESSAGE = 16
RECOVERING_TARGET_S = 0.1
"""``TARGET_S`` where a fit survives failures (``max_failures > 0``): a recovery replays the
rounds trained since the last restore point, which is taken between messages and answered
behind the rounds in flight, so shorter messages bound that replay (at 1-1.5% of a step's
time in messaging, against about 0.3% at ``TARGET_S``)."""


class Pacing:
    """Rounds per message, from the time the rounds of this fit take (one until a few are
    done; at most ``limit``)."""

    __slots__ = ("limit", "target_s", "_first", "_completed", "_last")

    def __init__(self, limit: int = MAX_ROUNDS_PER_MESSAGE, target_s: float = TARGET_S) -> None:
        self.limit = max(1, limit)
        self.target_s = target_s
        self._first: float | None = None
        self._completed = 0
        self._last = 0.0

    def completed(self, rounds: int) -> None:
        """``rounds`` more rounds have been answered by every worker."""
        if rounds <= 0:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            rounds -= 1  # the first completion starts the clock
        self._completed += rounds
        self._last = now

    @property
    def rounds_per_message(self) -> int:
        if self._first is None or self._completed < 2:
            return 1
        round_s = (self._last - self._first) / self._completed
        return max(1, min(self.limit, int(self.target_s / max(round_s, 1e-6))))


class PendingRounds:
    """Rounds dealt but not sent yet: one message per worker per round, sent together as one
    ``RoundBatch`` per worker (or as the round itself when there is one)."""

    __slots__ = ("workers", "_rounds")

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._rounds: list[list[RoundMessage]] = [[] for _ in range(workers)]

    def __len__(self) -> int:
        return len(self._rounds[0])

    def add(self, messages: list[RoundMessage]) -> None:
        """One round: ``messages[rank]`` for each worker."""
        for pending, message in zip(self._rounds, messages, strict=True):
            pending.append(message)

    def send(self, pool: Pool) -> None:
        """Send what is pending, a message per worker."""
        if not len(self):
            return
        for rank, pending in enumerate(self._rounds):
            pool.send(rank, pending[0] if len(pending) == 1 else RoundBatch(tuple(pending)))
        self._rounds = [[] for _ in range(self.workers)]
