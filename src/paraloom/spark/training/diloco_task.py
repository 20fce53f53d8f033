"""DiLoCo on Spark, a task's side: the pseudo-gradient it sends, and what it keeps between
averaging rounds (its residual, and its inner optimizer's state with ``save_updater=True``).

A ParameterAveragingTrainingMaster with an ``outer_optimizer`` or an ``encoding`` runs DiLoCo:
each task trains from the broadcast shared parameters (the *anchor*), then sends the
pseudo-gradient ``anchor - trained`` of the trainable parameters, plus its residual, encoded
with the master's ``TopK`` (the part not sent becomes the new residual: error feedback), and its
buffers dense. The driver averages the messages and steps the anchor with the outer optimizer.

What a partition keeps between rounds lives in a file on its executor's local disk (the
temporary directory, one folder per fit, readable by this user only), written with
``torch.save`` and read with ``weights_only=True``, one file per round, so that a retried task
reads the same round's input again. A partition that Spark runs on another executor than the
round before starts with no residual and a fresh inner optimizer (nothing is lost but the
unsent remainder); with its data cached, Spark keeps a partition where its blocks are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load

from paraloom.spark.runtime import flatten, unflatten
from paraloom.spark.runtime.state import Layout
from paraloom.spark.training.messages import AveragingSums, SparseDelta
from paraloom.sync.pseudo_gradients import (
    Selection,
    TopK,
    decoded,
    entries,
    flat_difference,
    select,
    sum_selections,
)

__all__ = ["local_dir", "load_local", "save_local", "remove_local", "trainable_names",
           "diloco_sums", "dense_delta", "updated_state", "keep_state"]


def local_dir(fit_id: str) -> Path:
    """The folder that holds this fit's per-partition files on this machine."""
    if not re.fullmatch(r"[0-9a-f]{1,64}", fit_id):
        raise ValueError(f"fit id {fit_id!r} is not a hex string")
    return Path(tempfile.gettempdir()) / f"paraloom-diloco-{fit_id}"


def _file(fit_id: str, index: int, sequence: int) -> Path:
    return local_dir(fit_id) / f"part{index}-round{sequence}.pt"


def _shared_file(fit_id: str, sequence: int) -> Path:
    return local_dir(fit_id) / f"shared-round{sequence}.pt"


def load_local(fit_id: str, index: int, sequence: int) -> dict[str, Any] | None:
    """What partition ``index`` kept after round ``sequence - 1``, or None (first round, or
    the partition ran elsewhere)."""
    if sequence == 0:
        return None
    path = _file(fit_id, index, sequence - 1)
    try:
        record = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return None
    return record if isinstance(record, dict) else None


def _write(path: Path, record: dict[str, Any], prefix: str, sequence: int) -> None:
    """``record`` into ``path`` atomically; files of ``prefix`` older than the round before
    ``sequence`` deleted (a retry of this round still finds its input)."""
    folder = path.parent
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to another user; refusing to write there")
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(record, partial)
    os.replace(partial, path)
    for old in folder.glob(f"{prefix}-round*.pt"):
        number = old.stem.rsplit("round", 1)[-1]
        if number.isdigit() and int(number) < sequence - 1:
            old.unlink(missing_ok=True)


def save_local(fit_id: str, index: int, sequence: int, record: dict[str, Any]) -> None:
    """Keep ``record`` for partition ``index``'s next round."""
    _write(_file(fit_id, index, sequence), record, f"part{index}", sequence)


def keep_state(fit_id: str, sequence: int, state: dict[str, torch.Tensor]) -> None:
    """Keep round ``sequence``'s shared state on this machine (flat, with its layout), for the
    next round's sparse update. Every task of the round writes the same bytes. The tensors go
    in name order, the order ``diloco.state_update`` numbers positions in (a state read from
    safetensors comes in that order, the driver's in the model's)."""
    if _shared_file(fit_id, sequence).exists():  # another task of this round wrote it
        return
    flat, layout = flatten(dict(sorted(state.items())))
    _keep_flat(fit_id, sequence, torch.from_numpy(flat), [list(e) for e in layout])


def _keep_flat(fit_id: str, sequence: int, flat: torch.Tensor, layout: list[list[Any]]) -> None:
    if not _shared_file(fit_id, sequence).exists():
        _write(_shared_file(fit_id, sequence), {"flat": flat, "layout": layout}, "shared",
               sequence)


def _update_meta(update: bytes) -> dict[str, str]:
    """The ``__metadata__`` of an update's safetensors header."""
    length = int.from_bytes(update[:8], "little")
    header = json.loads(update[8:8 + length])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return meta if isinstance(meta, dict) else {}


def updated_state(fit_id: str, sequence: int, update: bytes
                  ) -> dict[str, torch.Tensor] | None:
    """This round's shared state: the last round's, kept on this machine, with ``update``
    (``diloco.state_update``) applied, and kept in turn for the next round; None when this
    machine does not hold the last round's."""
    if sequence == 0:
        return None
    try:
        kept = torch.load(_shared_file(fit_id, sequence - 1), weights_only=True)
    except FileNotFoundError:
        return None
    meta = _update_meta(update)
    if meta.get("sequence") != str(sequence) or meta.get("numel") != str(kept["flat"].numel()):
        return None
    tensors = st_load(update)
    flat = kept["flat"].clone()
    positions, values = tensors["positions"].long(), tensors["values"]
    if values.dtype != flat.dtype or (positions.numel() and int(positions.max()) >= flat.numel()):
        return None
    flat[positions] = values
    _keep_flat(fit_id, sequence, flat, kept["layout"])
    layout: Layout = [(str(n), list(shape), str(d)) for n, shape, d in kept["layout"]]
    return unflatten(flat.numpy(), layout)


def remove_local(fit_id: str) -> None:
    """Delete this fit's folder on this machine (the end of a fit)."""
    shutil.rmtree(local_dir(fit_id), ignore_errors=True)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names of the parameters that DiLoCo's outer step moves, in order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _encode(flat: torch.Tensor, encoding: TopK
            ) -> tuple[SparseDelta, torch.Tensor]:
    """The message of ``flat``'s largest entries, and what is left of ``flat`` (the residual)."""
    mine = select(flat, entries(flat.numel(), encoding.density), encoding.values)
    residual = flat.clone()
    residual.index_add_(0, mine.index, -decoded(mine).to(residual.dtype))
    delta = SparseDelta(mine.offsets.numpy(), mine.counts.numpy(), mine.values.numpy(),
                        float(mine.scale), flat.numel())
    return delta, residual


def dense_delta(delta: SparseDelta) -> np.ndarray:
    """The dense float64 vector a ``SparseDelta`` carries (zeros where nothing was sent)."""
    selection = Selection(torch.from_numpy(delta.offsets), torch.from_numpy(delta.counts),
                          torch.from_numpy(delta.values), torch.tensor(delta.scale))
    total = sum_selections([selection], delta.numel, torch.device("cpu"))
    return total.numpy().astype(np.float64)


def diloco_sums(anchor: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                names: list[str], residual: torch.Tensor | None, encoding: TopK,
                ) -> tuple[AveragingSums, torch.Tensor | None]:
    """A trained task's message (counts left to the caller) and its new residual.

    ``state`` is the trained model's state dict; everything in it that is not a trainable
    parameter (the buffers) travels dense in ``model``.
    """
    flat = flat_difference([anchor[n] for n in names], [state[n] for n in names])
    if residual is not None and residual.shape == flat.shape:
        flat += residual.to(flat.dtype)
    moved = set(names)
    buffers, layout = flatten({k: v for k, v in state.items() if k not in moved})
    if encoding.dense:
        sums = AveragingSums(0, model=buffers, layout=layout, pseudo=flat.numpy(),
                             bytes_sent=buffers.nbytes + flat.numpy().nbytes)
        return sums, None
    delta, kept = _encode(flat, encoding)
    sums = AveragingSums(0, model=buffers, layout=layout, delta=delta,
                         bytes_sent=buffers.nbytes + delta.nbytes)
    return sums, kept
