"""The training benchmark's results: their shape, the printed table and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from paraloom.bench.common import Machine, pyplot, save_figure

if TYPE_CHECKING:
    from typing_extensions import NotRequired

__all__ = ["WHOLE_FIT_REPEATS", "FixedCost", "ModeResult", "ModelResults", "Measured",
           "TrainingResults", "plot_ratios", "print_model"]

WHOLE_FIT_REPEATS = 3
"""Whole fit() calls timed per mode; the median is reported (one call's rate moves by ~4%)."""


class FixedCost(TypedDict):
    """paraloom's own cost per round of a mode, beside the round's length (seconds)."""

    round: float
    """The steady round: the time between two rounds' completions."""
    parent_cpu: float
    """CPU time of the parent process per round (dealing, messages, listeners)."""
    worker_outside: float
    """Per worker, the mean time per round outside taking its batch, forward, backward, the
    optimizer and the synchronizer's hooks: taking the round's message, replying."""
    worker_data: float
    """Per worker, taking the round's batch (gathering shuffled rows; DDP's loop does too)."""
    worker_hooks: float
    """Per worker, the synchronizer's hooks (the mode's own work, not a fixed cost)."""
    share: float
    """(parent_cpu + worker_outside) / round."""


class ModeResult(TypedDict):
    """One ParallelWrapper mode on one model."""

    samples_per_s: float
    fit_samples_per_s: float
    whole_fit_30_samples_per_s: float
    sync_seconds_per_step: dict[str, float]
    step_seconds: float
    bytes_per_step_per_worker: float
    fixed_cost: FixedCost
    compile_seconds: float
    """With ``--compile``: the longest a replica took to compile (in the warm-up fit)."""


class Measured(TypedDict):
    parameters: int
    rows_per_epoch: int
    batch_size_per_worker: int
    threads_per_worker: int
    samples_per_s: dict[str, float]
    """Contender -> steady samples/s."""
    bytes_per_step_per_worker: dict[str, float]
    whole_fit_30_samples_per_s: dict[str, float]
    skipped: NotRequired[dict[str, str]]
    """Mode -> why it could not run."""
    compile_seconds: NotRequired[dict[str, float]]
    """With ``--compile``: mode -> the replicas' compile time, apart from the rates."""
    sync_seconds_per_step: NotRequired[dict[str, dict[str, float]]]
    """Mode -> the step's seconds and those of each synchronization phase."""
    fixed_cost: NotRequired[dict[str, FixedCost]]
    """Mode -> paraloom's fixed cost per round."""


class ModelResults(Measured):
    """Every contender on one model, with the ratios between them."""

    ratio_to_linear: dict[str, float]
    ratio_to_ddp: dict[str, float]
    ratio_to_ddp_runs: dict[str, list[float]]
    """Per ``--repeat`` run, each contender's rate over DDP's of the same run."""
    whole_fit_30_to_steady: dict[str, float]


class TrainingResults(TypedDict):
    """The JSON that ``run`` writes."""

    machine: Machine
    config: dict[str, object]
    models: dict[str, ModelResults]


def print_model(name: str, results: ModelResults) -> None:
    """The table of one model's contenders, then where their rounds' time goes."""
    print(f"\n{name}: {results['parameters'] / 1e6:.2f}M parameters")
    print(f"{'contender':<28}{'samples/s':>12}{'/linear':>10}{'/DDP':>8}{'fit(30)':>9}"
          f"{'bytes/step':>14}")
    for k, v in results["samples_per_s"].items():
        b = results["bytes_per_step_per_worker"].get(k)
        whole = results["whole_fit_30_to_steady"].get(k)
        print(f"{k:<28}{v:>12.1f}{results['ratio_to_linear'][k]:>10.2f}"
              f"{results['ratio_to_ddp'][k]:>8.2f}{'' if whole is None else f'{whole:>9.2f}':>9}"
              f"{'' if b is None else f'{b:>14.0f}'}")
    for k, ratios in results["ratio_to_ddp_runs"].items():
        if len(ratios) > 1 and k != "ddp":
            print(f"{k}: / DDP in each run " + ", ".join(f"{r:.2f}" for r in ratios)
                  + " (median above)")
    for k, cost in results.get("fixed_cost", {}).items():
        print(f"{k}: fixed cost per {cost['round'] * 1e3:.1f} ms round: parent "
              f"{cost['parent_cpu'] * 1e3:.2f} ms CPU + worker {cost['worker_outside'] * 1e3:.2f} "
              f"ms (messages) = {cost['share']:.1%}; the worker's batch "
              f"{cost['worker_data'] * 1e3:.2f} ms, hooks {cost['worker_hooks'] * 1e3:.2f} ms")
    for k, phases in results.get("sync_seconds_per_step", {}).items():
        print(f"{k}: a step takes {phases['step'] * 1e3:.1f} ms, of which " + ", ".join(
            f"{phase} {s * 1e3:.1f} ms" for phase, s in phases.items() if phase != "step"))
    for k, seconds in results.get("compile_seconds", {}).items():
        print(f"{k}: torch.compile took {seconds:.1f} s (in the warm-up, not in the rates)")
    for mode, why in results.get("skipped", {}).items():
        print(f"skipped {mode}: {why}")
    print(f"fit(30): samples/s of a whole 30-round fit() on the warm pool (median of "
          f"{WHOLE_FIT_REPEATS}) / the steady rate")


def plot_ratios(results: TrainingResults, path: Path) -> None:
    """A bar per contender and model: its steady rate over DDP's (a PNG at ``path``)."""
    plt = pyplot()
    if plt is None:
        return
    models = list(results["models"])
    contenders = [k for k in results["models"][models[0]]["ratio_to_ddp"] if k != "ddp"]
    fig, ax = plt.subplots(figsize=(2.2 * len(models) + 3, 4))
    width = 0.8 / max(1, len(contenders))
    for i, contender in enumerate(contenders):
        ax.bar([m + i * width for m in range(len(models))],
               [results["models"][name]["ratio_to_ddp"].get(contender, 0.0) for name in models],
               width, label=contender)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([m + width * (len(contenders) - 1) / 2 for m in range(len(models))],
                  [f"{n}\n{results['models'][n]['parameters'] / 1e6:.1f}M" for n in models])
    ax.set_ylabel("steady samples/s / PyTorch DDP's")
    ax.legend(fontsize=8)
    save_figure(fig, path)
