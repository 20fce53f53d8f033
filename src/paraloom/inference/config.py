"""ParallelInference's options: the inference modes and the checks made at construction."""

from __future__ import annotations

import enum
import math
import numbers
import threading
from dataclasses import dataclass

from paraloom._warnings import warn

__all__ = ["InferenceMode", "InferenceConfig", "check_seconds"]


class InferenceMode(str, enum.Enum):
    """How requests reach the replicas (DL4J's names, lower case)."""

    BATCHED = "batched"        # concurrent requests merged into batches of <= batch_limit rows
    SEQUENTIAL = "sequential"  # one request per forward pass, FIFO, on a pool of workers
    INPLACE = "inplace"        # the caller's thread runs a free replica; no queue, no threads

    @classmethod
    def resolve(cls, mode: InferenceMode | str) -> InferenceMode:
        """Accept the enum or its name in any case; the error lists the valid names."""
        if isinstance(mode, cls):
            return mode
        if not isinstance(mode, str):
            raise TypeError(f"inference_mode must be a string or InferenceMode; got "
                            f"{type(mode).__name__} {mode!r}")
        try:
            return cls(mode.lower())
        except ValueError:
            raise ValueError(f"inference_mode={mode!r} is not known; expected one of "
                             f"{', '.join(repr(m.value) for m in cls)}") from None


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value}; expected an int >= {minimum}")
    return int(value)


def check_seconds(name: str, value: object, *, allow_zero: bool,
                  unit: str = "seconds", none_means: str = "no limit") -> float | None:
    """A duration or None (``none_means`` says what None is, for the messages); TypeError /
    ValueError name the option and the rule."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of {unit} or None ({none_means}); got "
                        f"{type(value).__name__} {value!r}")
    rule = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value):
        raise ValueError(f"{name}={value}; expected a finite number {rule} {unit}, or None "
                         f"for {none_means}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value}; expected {rule} {unit}, or None for {none_means}")
    # Longer than threading's longest wait is "forever" in practice; waits must not overflow.
    longest = threading.TIMEOUT_MAX * (1000.0 if unit == "milliseconds" else 1.0)
    return min(float(value), longest)


@dataclass(frozen=True)
class InferenceConfig:
    """Validated options; see ParallelInference for what each one means."""

    mode: InferenceMode
    workers: int | None
    batch_limit: int
    queue_limit: int
    max_wait: float
    timeout: float | None
    threads_per_worker: int | None

    @classmethod
    def build(cls, *, inference_mode: InferenceMode | str, workers: int | None,
              batch_limit: int, queue_limit: int, max_wait_ms: float, timeout: float | None,
              threads_per_worker: int | None) -> InferenceConfig:
        """Check every option's type and value; warn on legal but pointless combinations."""
        mode = InferenceMode.resolve(inference_mode)
        max_wait = check_seconds("max_wait_ms", max_wait_ms, allow_zero=True,
                                 unit="milliseconds", none_means="no wait, as 0")
        config = cls(
            mode=mode,
            workers=None if workers is None else _int("workers", workers, 1),
            batch_limit=_int("batch_limit", batch_limit, 1),
            queue_limit=_int("queue_limit", queue_limit, 1),
            max_wait=(max_wait or 0.0) / 1000.0,
            timeout=check_seconds("timeout", timeout, allow_zero=False),
            threads_per_worker=(None if threads_per_worker is None
                                else _int("threads_per_worker", threads_per_worker, 1)),
        )
        config._warn_pointless()
        return config

    def _warn_pointless(self) -> None:
        if self.mode is not InferenceMode.BATCHED and self.max_wait > 0:
            warn(f"max_wait_ms only applies to inference_mode='batched'; it is ignored "
                 f"in {self.mode.value!r} mode")
        if self.mode is InferenceMode.BATCHED and self.queue_limit < self.batch_limit:
            warn(f"queue_limit={self.queue_limit} < batch_limit={self.batch_limit}: "
                 "batches of one-row requests can never exceed queue_limit rows; raise "
                 "queue_limit to at least batch_limit")
        if self.mode is InferenceMode.INPLACE and self.threads_per_worker is not None:
            warn("threads_per_worker is ignored in 'inplace' mode: the callers' own "
                 "threads run the replicas")
