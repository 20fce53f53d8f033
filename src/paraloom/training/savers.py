"""Where early stopping keeps the best (and latest) model."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

from torch import nn

from paraloom._warnings import warn
from paraloom.checkpoint import _model_spec, _write, load, rebuild_problem
from paraloom.safetensors_files import read_consistently

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
    """``best.safetensors`` and ``latest.safetensors`` in a directory (paraloom.save format).

    In the process that saved them, ``best_model()`` / ``latest_model()`` load the weights into a
    copy of the saved model, so any model comes back (an ``nn.Sequential``, a class whose
    constructor needs arguments). A new saver on the same directory rebuilds the model with
    ``factory()`` if given, else from the file's header (``paraloom.load``).
    """

    def __init__(self, directory: str | Path,
                 factory: Callable[..., nn.Module] | None = None) -> None:
        self.directory = Path(directory).expanduser()  # as the model files' writer expands it
        self.directory.mkdir(parents=True, exist_ok=True)
        self.factory = factory
        self._saved: nn.Module | None = None  # the model saved last: its structure, to copy
        self._warned = False

    def _save(self, name: str, model: nn.Module, epoch: int, score: float) -> None:
        self._saved = model
        self._warn_unless_rebuildable(model)
        record = {"epoch": epoch, "score": score if math.isfinite(score) else None}  # JSON
        _write(model, self.directory / f"{name}.safetensors",
               _model_spec(model, None, None, warn=False), record)
        (self.directory / f"{name}.json").write_text(json.dumps(record))

    def _warn_unless_rebuildable(self, model: nn.Module) -> None:
        problem = None if self.factory is not None else rebuild_problem(model)
        if problem is None or self._warned:
            return
        self._warned = True
        warn(f"LocalDirectorySaver({str(self.directory)!r}): {problem}, so its files "
             "cannot rebuild the model on their own. This run's best_model() still "
             "works (the weights go into a copy of the trained model); to load them "
             "later, pass LocalDirectorySaver(directory, factory=build) or "
             "paraloom.load(path, factory=build), build() returning the model")

    def _resumed_with(self, model: nn.Module) -> None:
        """A run resumed on this directory trains ``model`` (a checkpoint of the same
        architecture): the saved weights go into a copy of it, as in the run that saved them,
        so a model the files cannot rebuild (an ``nn.Sequential``) comes back too."""
        if self._saved is None and self.factory is None:
            self._saved = model

    def _load(self, name: str) -> nn.Module:
        path = self.directory / f"{name}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"no {name} model saved in {str(self.directory)!r}" + (
                " (set save_last_model=True)" if name == "latest" else ""))
        if self._saved is None:
            return load(path, factory=self.factory)
        model = copy.deepcopy(self._saved)
        model.load_state_dict(read_consistently(path)[1])
        return model

    def save_best(self, model: nn.Module, epoch: int, score: float) -> None:
        self._save("best", model, epoch, score)

    def save_latest(self, model: nn.Module, epoch: int, score: float) -> None:
        self._save("latest", model, epoch, score)

    def best_model(self) -> nn.Module:
        return self._load("best")

    def latest_model(self) -> nn.Module:
        return self._load("latest")
