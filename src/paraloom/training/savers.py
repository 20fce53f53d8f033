"""Where early stopping keeps the best (and latest) model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from torch import nn

from paraloom.checkpoint import load, save

__all__ = ["ModelSaver", "InMemoryModelSaver", "LocalDirectorySaver"]


class ModelSaver:
    """Keeps the best model and, if asked, the latest."""

    def save_best(self, model: nn.Module, epoch: int, score: float) -> None:
        raise NotImplementedError

    def save_latest(self, model: nn.Module, epoch: int, score: float) -> None:
        raise NotImplementedError

    def best_model(self) -> nn.Module:
        raise NotImplementedError

    def latest_model(self) -> nn.Module:
        raise NotImplementedError


class InMemoryModelSaver(ModelSaver):
    """Deep copies in memory."""

    def __init__(self) -> None:
        self._best: nn.Module | None = None
        self._latest: nn.Module | None = None

    def save_best(self, model: nn.Module, epoch: int, score: float) -> None:
        self._best = copy.deepcopy(model)

    def save_latest(self, model: nn.Module, epoch: int, score: float) -> None:
        self._latest = copy.deepcopy(model)

    def best_model(self) -> nn.Module:
        if self._best is None:
            raise LookupError("no best model saved yet")
        return self._best

    def latest_model(self) -> nn.Module:
        if self._latest is None:
            raise LookupError("no latest model saved (set save_last_model=True)")
        return self._latest


class LocalDirectorySaver(ModelSaver):
    """``best.safetensors`` and ``latest.safetensors`` in a directory (paraloom.save format)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _save(self, name: str, model: nn.Module, epoch: int, score: float) -> None:
        save(model, self.directory / f"{name}.safetensors",
             metadata={"epoch": epoch, "score": score})
        (self.directory / f"{name}.json").write_text(json.dumps({"epoch": epoch, "score": score}))

    def save_best(self, model: nn.Module, epoch: int, score: float) -> None:
        self._save("best", model, epoch, score)

    def save_latest(self, model: nn.Module, epoch: int, score: float) -> None:
        self._save("latest", model, epoch, score)

    def best_model(self) -> nn.Module:
        return load(self.directory / "best.safetensors")

    def latest_model(self) -> nn.Module:
        return load(self.directory / "latest.safetensors")
