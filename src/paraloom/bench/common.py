"""Helpers shared by the benchmarks: machine facts and writing results."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Machine", "machine", "write_results", "plain_args", "pyplot", "save_figure",
           "bar_plot", "plain_epoch", "with_threshold"]


class Machine(TypedDict):
    """The facts ``machine()`` reports."""

    cores: int | None
    torch: str
    python: str
    cuda: str | None
    platform: str


def machine() -> Machine:
    """What the numbers were measured on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


def results_path(value: str) -> str:
    """``--out``'s check, at parse time (not after a run of minutes): a file to write JSON to,
    not a directory, and not below a file."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{value!r} is a directory; expected the JSON file to write, e.g. "
            f"{str(path / 'results.json')!r} (its plot goes beside it)")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is below {str(above)!r}, which is a file; "
                                         "expected a path in a folder")
    return value


def write_results(path: str | Path, results: Mapping[str, object]) -> Path:
    """Write results as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def plain_args(args: argparse.Namespace) -> argparse.Namespace:
    """The benchmark's own options, without what the CLI attached (functions, modules)."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items()
                                 if isinstance(v, (str, int, float, bool, type(None)))})


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the file-only Agg backend; None, with a note, without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        plt: ModuleType = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print("matplotlib is not installed (pip install 'paraloom[bench]'): no plot")
        return None
    return plt


def save_figure(fig: Figure, path: Path) -> None:
    """Lay out, write the PNG, close the figure and say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def bar_plot(path: str | Path, title: str, bars: dict[str, float], ylabel: str) -> None:
    """One bar per contender (a PNG next to the JSON), when matplotlib is installed."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(bars) + 2), 4))
    ax.bar(list(bars), list(bars.values()))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20)
    save_figure(fig, Path(path).with_suffix(".png"))


def plain_epoch(model: nn.Module, loss_fn: nn.Module, opt: torch.optim.Optimizer,
                x: torch.Tensor, y: torch.Tensor, batch_size: int) -> int:
    """One epoch of a plain training loop over pre-made tensors; returns the rows trained."""
    rows = 0
    for i in range(0, len(x) - batch_size + 1, batch_size):
        opt.zero_grad()
        loss_fn(model(x[i:i + batch_size]), y[i:i + batch_size]).backward()
        opt.step()
        rows += batch_size
    return rows


def with_threshold(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a ``threshold_algorithm`` given as JSON-able ``(class name, density[,
    keywords])`` built into the ``paraloom.sync.thresholds`` object it names, and
    ``outer_optimizer="nesterov"`` into DiLoCo's ``nesterov_outer_optimizer``."""
    if options.get("outer_optimizer") == "nesterov":  # JSON-able name of DiLoCo's outer step
        from paraloom.sync.diloco import nesterov_outer_optimizer

        options = {**options, "outer_optimizer": nesterov_outer_optimizer}
    spec = options.get("threshold_algorithm")
    if not isinstance(spec, tuple):
        return dict(options)
    from paraloom.sync import thresholds

    name, density, *keywords = spec
    return {**options,
            "threshold_algorithm": getattr(thresholds, name)(density, **dict(*keywords))}


_CLUMP_S = 1e-3
"""Listener calls closer than this are of rounds whose replies came in one message."""


def steady_rate(times: list[float], rows_per_round: int, skip: int = 2) -> float:
    """Rows/s from the listener's timestamps of round completions, past the first ``skip``.

    Rounds that travelled in one message (``training.pacing``) are answered together, so their
    listener calls come together, at the arrival of the last of them: the count starts after
    the group that holds the first timestamp kept, so no round is counted in a span it did
    not run in. Raises ``ValueError`` with fewer than two groups of timestamps.
    """
    kept = times[skip:]
    first = 0
    while first + 1 < len(kept) and kept[first + 1] - kept[first] < _CLUMP_S:
        first += 1
    if first >= len(kept) - 1:
        raise ValueError(f"{len(times)} round timestamps in fewer than two groups: time more "
                         "rounds (--samples, --epochs)")
    return (len(kept) - 1 - first) * rows_per_round / (kept[-1] - kept[first])
