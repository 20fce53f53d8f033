"""The dict ``SparkModel.fit`` returns: throughput, losses, bytes, replica digests, attempts."""

from __future__ import annotations

from typing import Any

from torch import nn

from paraloom.spark.training.averaging_task import RoundConfig
from paraloom.spark.training.master import FitJob
from paraloom.spark.training.shared_task import SharedConfig

__all__ = ["dense_bytes_per_step", "epoch_losses", "shared_summary", "averaging_summary"]


def dense_bytes_per_step(model: nn.Module, workers: int) -> float:
    """Bytes one worker sends per step for a dense ring all-reduce of the gradients (DDP)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2 * (workers - 1) / workers * size if workers > 1 else 0.0


def epoch_losses(per_worker: list[dict[str, list[float]]]) -> list[float]:
    """Mean training loss per epoch over every worker's rows."""
    sums: dict[int, list[float]] = {}
    for losses in per_worker:
        for epoch, (total, rows) in losses.items():
            acc = sums.setdefault(int(epoch), [0.0, 0.0])
            acc[0] += total
            acc[1] += rows
    return [sums[e][0] / sums[e][1] for e in sorted(sums) if sums[e][1]]


def shared_summary(infos: dict[int, dict[str, Any]], job: FitJob, cfg: SharedConfig,
                   seconds: float, attempts: int) -> dict[str, Any]:
    """Summary of a SharedTrainingMaster fit from every rank's report."""
    ranks = sorted(infos)  # ranks re-run alone after the fit was done are not in ``infos``
    samples = sum(infos[r]["samples"] for r in ranks)
    loop = max(infos[r]["loop_seconds"] for r in ranks) or 1e-9
    per_step = [infos[r]["sync"].get("bytes_sent_per_step", 0.0) for r in ranks]
    dense = dense_bytes_per_step(job.spec.model, cfg.world_size)
    digests = [infos[r]["digest"] for r in ranks]
    losses = epoch_losses([infos[r]["losses"] for r in ranks])
    resumed = [infos[r]["resumed_from_step"] for r in ranks]
    return {
        "master": "shared", "workers": cfg.world_size, "epochs": cfg.epochs,
        "batch_size_per_worker": cfg.batch_size, "samples": samples,
        "rows_per_worker": [infos[r]["rows"] for r in ranks],
        "rounds_per_epoch": infos[ranks[0]]["rounds_per_epoch"],
        "steps_per_worker": [infos[r]["steps"] for r in ranks],
        "seconds": seconds, "samples_per_s": samples / max(seconds, 1e-9),
        "train_seconds": loop, "train_samples_per_s": samples / loop,
        "loss": losses[-1] if losses else None, "epoch_losses": losses,
        "bytes_sent_per_step": per_step, "dense_bytes_per_step": dense,
        "bytes_ratio_to_dense": (sum(per_step) / len(per_step)) / dense if dense else None,
        "sync": infos[ranks[0]]["sync"], "replica_digests": digests,
        "replicas_identical": len(set(digests)) == 1, "stage_attempts": attempts,
        "resumed_from_step": resumed[0], "device": infos[ranks[0]]["device"],
        "rendezvous": infos[ranks[0]].get("rendezvous"),
        "worker_peak_rss_mb": [infos[r].get("peak_rss", 0) / 2**20 for r in ranks]}


def averaging_summary(rounds: list[dict[str, Any]], job: FitJob, cfg: RoundConfig, workers: int,
                      epochs: int, seconds: float, attempts: int) -> dict[str, Any]:
    """Summary of a ParameterAveragingTrainingMaster fit from each round's aggregate.

    ``cfg`` is any of the fit's rounds: its options are the master's.
    """
    samples = sum(r["n"] for r in rounds)
    steps = sum(r.get("steps", 0) for r in rounds)
    by_epoch: dict[int, list[float]] = {}
    for r in rounds:
        acc = by_epoch.setdefault(r["epoch"], [0.0, 0.0])
        acc[0] += r.get("loss_sum", 0.0)
        acc[1] += r["n"]
    losses = [by_epoch[e][0] / by_epoch[e][1] for e in sorted(by_epoch) if by_epoch[e][1]]
    moved = sum(r.get("bytes_received", 0) + r.get("bytes_sent", 0) for r in rounds if r["n"])
    return {
        "master": "averaging", "workers": workers, "epochs": epochs,
        "batch_size_per_worker": cfg.batch_size,
        "averaging_frequency": cfg.frequency, "save_updater": cfg.save_updater,
        "rounds": len(rounds), "samples": samples, "steps": steps, "seconds": seconds,
        "samples_per_s": samples / max(seconds, 1e-9),
        "loss": losses[-1] if losses else None, "epoch_losses": losses,
        "bytes_per_step_per_worker": moved / max(1, steps),
        "dense_bytes_per_step": dense_bytes_per_step(job.spec.model, workers),
        "stage_attempts": attempts,
        "worker_peak_rss_mb": max((r.get("peak_rss", 0) for r in rounds), default=0) / 2**20}
