"""The dict ``SparkModel.fit`` returns: throughput, losses, bytes, replica digests, attempts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from torch import nn

from paraloom.spark.training.averaging_task import AveragingRound
from paraloom.spark.training.messages import WorkerReport
from paraloom.spark.training.shared_task import SharedConfig

__all__ = ["SharedSummary", "AveragingSummary", "Summary", "AveragingRoundTotals",
           "dense_bytes_per_step", "epoch_losses", "last_first_step", "shared_summary",
           "averaging_summary"]


class SharedSummary(TypedDict):
    """A SharedTrainingMaster fit's summary (the README's table says what each key means)."""

    master: str
    workers: int
    epochs: int
    batch_size_per_worker: int
    samples: int
    rows_per_worker: list[int]
    rounds_per_epoch: int
    steps_per_worker: list[int]
    seconds: float
    samples_per_s: float
    train_seconds: float
    train_samples_per_s: float
    loss: float | None
    epoch_losses: list[float]
    bytes_sent_per_step: list[float]
    dense_bytes_per_step: float
    bytes_ratio_to_dense: float | None
    sync: dict[str, float]
    replica_digests: list[str]
    replicas_identical: bool
    stage_attempts: int
    resumed_from_step: int | None
    device: str
    rendezvous: str
    worker_peak_rss_mb: list[float]
    stages: str
    """How the fit ran: "one" (every epoch in one barrier stage)."""
    seconds_to_first_step: float | None
    """From the fit's start to the last worker's first step."""


class AveragingSummary(TypedDict):
    """A ParameterAveragingTrainingMaster fit's summary; ``rounds`` counts averaging rounds."""

    master: str
    workers: int
    epochs: int
    batch_size_per_worker: int
    averaging_frequency: int
    save_updater: bool
    encoding: str | None
    """DiLoCo: how the pseudo-gradients travelled (``TopK(...)``); None: plain averaging."""
    outer_optimizer: str | None
    """DiLoCo: the outer optimizer factory; None: plain averaging."""
    rounds: int
    samples: int
    steps: int
    seconds: float
    samples_per_s: float
    loss: float | None
    epoch_losses: list[float]
    bytes_per_step_per_worker: float
    bytes_sent_per_step_per_worker: float
    """What the tasks sent the driver (the broadcast they received left out)."""
    bytes_received_per_step_per_worker: float
    """What the tasks read of the driver's broadcasts (DiLoCo: a sparse update where their
    executor kept the last round's state)."""
    dense_bytes_per_step: float
    stage_attempts: int
    worker_peak_rss_mb: float
    rows_per_worker: list[int]
    stages: str
    """How the fit ran: "one" (every averaging round in one barrier stage, the tasks
    averaging among themselves) or "per_round" (one Spark job per round, through the driver)."""
    seconds_to_first_step: float | None
    """From the fit's start to the last worker's first step (one stage only)."""


Summary = SharedSummary | AveragingSummary
"""What ``SparkModel.fit`` returns (as a plain dict)."""


@dataclass(frozen=True)
class AveragingRoundTotals:
    """What the driver keeps of one averaging round's sums: the counts, not the vectors."""

    epoch: int
    n: int
    loss_sum: float
    steps: int
    bytes_received: int
    bytes_sent: int
    peak_rss: int


def dense_bytes_per_step(model: nn.Module, workers: int) -> float:
    """Bytes one worker sends per step for a dense ring all-reduce of the gradients (DDP)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2 * (workers - 1) / workers * size if workers > 1 else 0.0


def epoch_losses(per_worker: list[dict[int, tuple[float, int]]]) -> list[float]:
    """Mean training loss per epoch over every worker's rows."""
    sums: dict[int, list[float]] = {}
    for losses in per_worker:
        for epoch, (total, rows) in losses.items():
            acc = sums.setdefault(epoch, [0.0, 0.0])
            acc[0] += total
            acc[1] += rows
    return [sums[e][0] / sums[e][1] for e in sorted(sums) if sums[e][1]]


def last_first_step(reports: Iterable[WorkerReport]) -> float | None:
    """Seconds from the fit's start to the last worker's first step (None: none stepped)."""
    return max((s for r in reports if (s := r.first_step_s) is not None), default=None)


def shared_summary(reports: dict[int, WorkerReport], model: nn.Module, cfg: SharedConfig,
                   seconds: float, attempts: int) -> SharedSummary:
    """Summary of a SharedTrainingMaster fit from every worker's report."""
    ranks = sorted(reports)  # workers re-run alone after the fit was done sent no report
    first = reports[ranks[0]]
    samples = sum(reports[r].samples for r in ranks)
    loop = max(reports[r].loop_seconds for r in ranks) or 1e-9
    per_step = [reports[r].sync.get("bytes_sent_per_step", 0.0) for r in ranks]
    dense = dense_bytes_per_step(model, cfg.world_size)
    digests = [reports[r].digest for r in ranks]
    losses = epoch_losses([reports[r].losses for r in ranks])
    return SharedSummary(
        master="shared", workers=cfg.world_size, epochs=cfg.epochs,
        batch_size_per_worker=cfg.batch_size, samples=samples,
        rows_per_worker=[reports[r].rows for r in ranks],
        rounds_per_epoch=first.rounds_per_epoch,
        steps_per_worker=[reports[r].steps for r in ranks],
        seconds=seconds, samples_per_s=samples / max(seconds, 1e-9),
        train_seconds=loop, train_samples_per_s=samples / loop,
        loss=losses[-1] if losses else None, epoch_losses=losses,
        bytes_sent_per_step=per_step, dense_bytes_per_step=dense,
        bytes_ratio_to_dense=(sum(per_step) / len(per_step)) / dense if dense else None,
        sync=first.sync, replica_digests=digests,
        replicas_identical=len(set(digests)) == 1, stage_attempts=attempts,
        resumed_from_step=first.resumed_from_step, device=first.device,
        rendezvous=first.rendezvous,
        worker_peak_rss_mb=[reports[r].peak_rss / 2**20 for r in ranks], stages="one",
        seconds_to_first_step=last_first_step(reports.values()))


def averaging_summary(totals: list[AveragingRoundTotals], model: nn.Module, cfg: AveragingRound,
                      workers: int, epochs: int, seconds: float, attempts: int,
                      rows_per_worker: list[int], outer: str | None = None
                      ) -> AveragingSummary:
    """Summary of a ParameterAveragingTrainingMaster fit from each averaging round's totals.

    ``cfg`` is any of the fit's averaging rounds: its options are the master's.
    """
    samples = sum(r.n for r in totals)
    steps = sum(r.steps for r in totals)
    by_epoch: dict[int, list[float]] = {}
    for r in totals:
        acc = by_epoch.setdefault(r.epoch, [0.0, 0.0])
        acc[0] += r.loss_sum
        acc[1] += r.n
    losses = [by_epoch[e][0] / by_epoch[e][1] for e in sorted(by_epoch) if by_epoch[e][1]]
    moved = sum(r.bytes_received + r.bytes_sent for r in totals if r.n)
    return AveragingSummary(
        master="averaging", workers=workers, epochs=epochs,
        batch_size_per_worker=cfg.batch_size,
        averaging_frequency=cfg.frequency, save_updater=cfg.save_updater,
        encoding=None if cfg.encoding is None else repr(cfg.encoding), outer_optimizer=outer,
        rounds=len(totals), samples=samples, steps=steps, seconds=seconds,
        samples_per_s=samples / max(seconds, 1e-9),
        loss=losses[-1] if losses else None, epoch_losses=losses,
        bytes_per_step_per_worker=moved / max(1, steps),
        bytes_sent_per_step_per_worker=sum(r.bytes_sent for r in totals if r.n) / max(1, steps),
        bytes_received_per_step_per_worker=sum(r.bytes_received for r in totals if r.n)
        / max(1, steps),
        dense_bytes_per_step=dense_bytes_per_step(model, workers),
        stage_attempts=attempts,
        worker_peak_rss_mb=max((r.peak_rss for r in totals), default=0) / 2**20,
        rows_per_worker=rows_per_worker, stages="per_round", seconds_to_first_step=None)
