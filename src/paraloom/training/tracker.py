"""Parent-side bookkeeping of one fit(): rounds in flight, listeners, progress bar, stats."""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TextIO, TypedDict

from tqdm.auto import tqdm

from paraloom.listeners import TrainingListener
from paraloom.training.recovery import Recovery

log = logging.getLogger("paraloom")
_DIVERGING = 1000.0
"""How many times the lowest epoch mean loss an epoch's mean must reach to be called diverging."""
score_log = logging.getLogger("paraloom.score")
"""Where ``report_score_after_averaging`` writes; shown even where no logging is configured."""

__all__ = ["FitStats", "RoundSummary", "RoundTracker", "show_scores"]


class RoundSummary(TypedDict):
    """What ``RoundTracker.summary`` counts (the start of ``ParallelWrapper.stats()``)."""

    rounds: int
    batches: int
    samples: int
    seconds: float
    samples_per_s: float


class _BarSafeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes through tqdm, so a line does not break a progress bar being drawn.

    The stream is ``sys.stderr`` as it is when a line is written, not when the handler was
    made (as logging's own last-resort handler does): a later redirection (a notebook, a test
    capture, ``contextlib.redirect_stderr``) gets the lines.
    """

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def show_scores() -> None:
    """Make the score lines visible, as DL4J printed them, if the user configured no logging:
    a handler on ``paraloom.score`` (installed once, only if no handler would take them)."""
    if score_log.hasHandlers() and score_log.getEffectiveLevel() <= logging.INFO:
        return  # the user's logging shows them (or already ours)
    if score_log.hasHandlers() and logging.getLogger().handlers:
        return  # the user configured logging and chose a level that hides them
    handler = _BarSafeHandler()
    handler.setFormatter(logging.Formatter("paraloom: %(message)s"))
    score_log.addHandler(handler)
    score_log.setLevel(logging.INFO)
    score_log.propagate = False


@dataclass
class _Round:
    epoch: int
    first_batch: int
    expected: int
    losses: list[float] = field(default_factory=list)
    rows: int = 0
    replies: int = 0
    synced: bool = False
    skipped: bool = False


class RoundTracker:
    """Collects worker replies per round and fires listeners in round order."""

    def __init__(self, workers: int, listeners: list[TrainingListener], *, iteration: int,
                 total_batches: int | None, progress: bool, report_score: bool) -> None:
        self.workers = workers
        self.listeners = listeners
        self.iteration = iteration
        self.report_score = report_score
        self.rounds: dict[int, _Round] = {}
        self.next_round = 0
        self.skipped = 0
        """Rounds that stop() cut off: dealt, never trained."""
        self.batches = 0
        self.rows = 0
        self.started = time.perf_counter()
        self.epoch_losses: list[float] = []
        self.epoch_means: list[float] = []
        """Each finished epoch's mean loss, in order (for ``_watch_divergence``)."""
        self.diverging = False
        """Whether this fit's loss was seen to diverge (and the warning given)."""
        self.current_epoch: int | None = None
        self.recoveries: list[Recovery] = []
        """The worker failures survived in this fit(), in order."""
        self.bar = tqdm(total=total_batches, unit="batch", disable=not progress,
                        dynamic_ncols=True, desc="paraloom")
        if report_score:
            show_scores()

    def add(self, round_id: int, epoch: int, first_batch: int, batches: int) -> None:
        """A round was dealt: ``batches`` workers got a batch, every worker gets a reply."""
        self.rounds[round_id] = _Round(epoch, first_batch, batches)

    def batch_of(self, round_id: int | None, rank: int | None) -> str:
        """'epoch E, batch B' for a round and worker, for error messages."""
        r = self.rounds.get(round_id) if round_id is not None else None
        if r is None:
            return ""
        return f"epoch {r.epoch}, batch {r.first_batch + (rank or 0)}"

    def reply(self, round_id: int, loss: float | None, rows: int, synced: bool,
              skipped: bool = False) -> int:
        """A worker's ``step`` reply (``skipped``: a round that stop() cut off); returns the
        rounds it completed (their listeners called), in order."""
        r = self.rounds[round_id]
        r.replies += 1
        r.skipped = r.skipped or skipped
        r.synced = r.synced or synced
        if loss is not None:
            r.losses.append(loss)
            r.rows += rows
        completed = 0
        while self.next_round in self.rounds and \
                self.rounds[self.next_round].replies == self.workers:
            self._complete(self.next_round, self.rounds.pop(self.next_round))
            self.next_round += 1
            completed += 1
        return completed

    @property
    def in_flight(self) -> int:
        return len(self.rounds)

    def _complete(self, round_id: int, r: _Round) -> None:
        if r.skipped:
            self.skipped += 1
            return  # never trained: no iteration, no listener call
        loss = sum(r.losses) / len(r.losses) if r.losses else float("nan")
        self.batches += len(r.losses)  # batches trained (a stream may end before expected)
        self.rows += r.rows
        self.epoch_losses.append(loss)
        if self.report_score and r.synced:
            score_log.info("Averaged score: %.6f (iteration %d, epoch %d)", loss, self.iteration,
                           r.epoch)
        for listener in self.listeners:
            listener.on_iteration(self.iteration, r.epoch, loss)
        self.iteration += 1
        if self.bar.disable:
            return
        self.bar.update(len(r.losses))
        postfix: dict[str, object] = {"loss": f"{loss:.4f}",
                                      "samples_s": f"{self.samples_per_s:.0f}"}
        if self.recoveries:
            postfix["failures"] = len(self.recoveries)
        self.bar.set_postfix(postfix, refresh=False)

    def start_epoch(self, epoch: int) -> None:
        """An epoch begins, before its first round is dealt: ``on_epoch_start``."""
        self.current_epoch = epoch
        self.epoch_losses = []
        for listener in self.listeners:
            listener.on_epoch_start(epoch)

    def end_epoch(self) -> None:
        """The epoch's rounds are done (none of the next is dealt): ``on_epoch_end``, once."""
        if self.current_epoch is None:
            return
        losses = self.epoch_losses
        mean = sum(losses) / len(losses) if losses else float("nan")  # stopped before a round
        self._watch_divergence(mean)
        for listener in self.listeners:
            listener.on_epoch_end(self.current_epoch, mean)
        self.epoch_losses = []
        self.current_epoch = None

    def _watch_divergence(self, mean: float) -> None:
        """Warn (once a fit) when an epoch's mean loss is ``_DIVERGING`` times the lowest of
        the epochs before and above the last one: a finite loss that keeps growing is a
        diverging run, which would otherwise return without a word."""
        before = [m for m in self.epoch_means if math.isfinite(m) and m > 0]
        last = self.epoch_means[-1] if self.epoch_means else None
        self.epoch_means.append(mean)
        if self.diverging or not before or not math.isfinite(mean) or last is None:
            return
        if mean > _DIVERGING * min(before) and mean > last:
            self.diverging = True
            warnings.warn(f"paraloom: the mean loss grew from {min(before):.4g} to {mean:.4g} "
                          f"over {len(before)} epoch(s): training is diverging. Lower the "
                          "learning rate (with shared_gradients' overlapped exchange, or the "
                          "dgc recipe, overlap=False may be enough)", RuntimeWarning,
                          stacklevel=2)

    def recovered(self, recovery: Recovery) -> None:
        """Say on the progress bar that a worker failed and training went on."""
        self.recoveries.append(recovery)
        self.bar.write(f"paraloom: worker {recovery.rank} failed and was replaced; "
                       f"{recovery.redone_rounds} round(s) trained again "
                       f"({str(recovery.error).splitlines()[0]})")
        self.bar.set_postfix(failures=len(self.recoveries), refresh=False)

    def seconds_lost(self) -> float:
        """Per recovery, the wait for a frozen or hung worker to be found, the restart, and
        the rounds trained again at this fit's mean round time (waits and restarts left out
        of that mean)."""
        restarts = sum(r.restart_seconds + r.detect_seconds for r in self.recoveries)
        per_round = max(0.0, self.seconds - restarts) / max(1, self.next_round)
        return restarts + sum(r.redone_rounds for r in self.recoveries) * per_round

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def samples_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)

    def close(self, completed: bool) -> None:
        """Fire the last epoch's end (if the fit completed) and close the progress bar."""
        if completed:
            self.end_epoch()
        self.bar.close()

    def summary(self) -> RoundSummary:
        """The fit's counters so far: rounds trained, batches, samples, seconds, samples/s."""
        return {"rounds": self.next_round - self.skipped, "batches": self.batches,
                "samples": self.rows, "seconds": self.seconds, "samples_per_s": self.samples_per_s}


class FitStats(RoundSummary):
    """What ``fit()`` and ``stats()`` return: the round counters, then what the fit sent,
    its failures, and every worker's synchronizer counters."""

    model_sent: bool
    """Whether the model's state went to the workers (False: a warm fit, unchanged)."""
    optimizer_state_sent: bool
    workers: int
    failures: int
    """Worker failures survived (``max_failures``)."""
    seconds_lost: float
    """Wall time the failures cost."""
    mode: str
    """The synchronizer's name."""
    per_worker: list[dict[str, float]]
    """Each worker's ``Synchronizer.stats()``: bytes sent, and the mode's own counters."""
    bytes_sent_per_step: list[float]
    parent_cpu_seconds_per_round: float
    """CPU time this process spent per round (dealing, messages, listeners): with the
    workers' ``overhead_seconds``, paraloom's fixed cost per round."""
    compile_seconds: float
    """With ``compile=``: the longest a replica's ``torch.compile`` took in this fit (its first
    forward and backward); 0.0 without, or when the replicas compiled in an earlier fit."""
