"""``workers=1``: the one replica runs in the calling process; same protocol, no queues."""

from __future__ import annotations

import collections
import dataclasses
import traceback
from collections.abc import Sequence

import torch

from paraloom.training.failures import failure_error
from paraloom.training.messages import (
    Answer,
    Begin,
    Failed,
    RoundBatch,
    RoundMessage,
    ToReplica,
)
from paraloom.training.runner import ReplicaRunner, WorkerSpec

__all__ = ["LocalPool"]


class LocalPool:
    """One replica in this process: each message is handled as it is sent."""

    def __init__(self, spec: WorkerSpec, device: str = "cpu") -> None:
        self.workers = 1
        self.backend, self.devices, self.threads = "none", [device], torch.get_num_threads()
        self._runner = ReplicaRunner(spec, device=device)
        self._replies: collections.deque[Answer] = collections.deque()
        self._last_round = -1

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def alive(self) -> bool:
        return True

    @property
    def warm(self) -> bool:
        return True

    def begin(self, messages: Sequence[Begin]) -> None:
        # No seed: the replica shares the caller's RNG, which the caller has seeded.
        self._runner.begin(dataclasses.replace(messages[0], seed=None))
        self._last_round = -1

    def halt(self, last: int | None = None) -> int:
        """Nothing is queued here: the last round is the last one sent."""
        return self._last_round if last is None else min(last, self._last_round)

    def send(self, rank: int, message: ToReplica) -> None:
        for one in message.rounds if isinstance(message, RoundBatch) else (message,):
            self._handle(one)

    def _handle(self, message: ToReplica) -> None:
        round_id = message.round_id if isinstance(message, RoundMessage) else None
        if round_id is not None:
            self._last_round = round_id
        try:
            reply = self._runner.handle(message)
        except Exception as e:
            raise failure_error(Failed(0, round_id, f"{type(e).__name__}: {e}",
                                       traceback.format_exc(), type(e).__name__)) from e
        if reply is not None:
            self._replies.append(reply)

    def recv(self, timeout_s: float | None = None) -> Answer | None:
        return self._replies.popleft() if self._replies else None

    def close(self, timeout_s: float = 10.0) -> None:
        pass

    def kill(self, wait: bool = True) -> None:
        pass
