"""Triton's classification extension: an output asked for with ``classification: k``
(tritonclient's ``InferRequestedOutput(name, class_count=k)``) comes back as a ``BYTES``
tensor of its k largest values per row, largest first, each the string ``"value:index"``, or
``"value:index:label"`` where the output has labels (``label_filename`` in ``config.pbtxt``:
one label per line, line i naming class i).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paraloom.serving.errors import ProtocolError

__all__ = ["classes_asked", "classify", "read_labels"]


def classes_asked(raw: object, where: str) -> int:
    """The ``classification`` parameter's class count (0: not asked); ``ProtocolError`` for
    anything but a positive integer."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ProtocolError(f"{where} asks for classification {raw!r}; expected the number of "
                            "classes to return, an integer >= 1")
    return raw


def classify(value: object, k: int, batched: bool, labels: Sequence[str], name: str
             ) -> np.ndarray:
    """``value``'s top ``k`` classes per row (``batched``: the first dimension is the rows; else
    the whole tensor is one row), as ``[rows, k]`` (``[k]`` unbatched) strings."""
    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
        raise ProtocolError(f"output {name!r} cannot be classified: classification takes a "
                            "numeric tensor of scores; request the raw output")
    t = value.detach().cpu()
    rows = t.reshape(t.shape[0], -1) if batched and t.dim() > 0 else t.reshape(1, -1)
    count = min(k, rows.shape[1])
    keys = _ranking_keys(rows)
    try:
        top = torch.topk(keys, count, dim=1).indices  # exact: the same order as the values
    except RuntimeError:  # a type topk does not take on this device
        top = torch.topk(keys.double(), count, dim=1).indices
    floating = rows.is_floating_point()
    out = np.empty(tuple(top.shape), dtype=object)
    for r in range(top.shape[0]):
        for c in range(count):
            index = int(top[r, c])
            number = rows[r, index].item()
            text = f"{number:f}:{index}" if floating else f"{int(number)}:{index}"
            if index < len(labels) and labels[index]:
                text += f":{labels[index]}"
            out[r, c] = text.encode()
    return out if batched else out.reshape(count)


def _ranking_keys(rows: torch.Tensor) -> torch.Tensor:
    """``rows``, or values that rank as they do in a type ``topk`` takes: torch has no ``topk``
    for unsigned integers wider than 8 bits, and a double cannot hold every uint64 apart (one
    above 2**53 would tie with its neighbours)."""
    if rows.dtype in (torch.uint16, torch.uint32):
        return rows.to(torch.int64)
    if rows.dtype == torch.uint64:  # flipping the top bit keeps the order, in int64
        return rows.view(torch.int64) ^ torch.iinfo(torch.int64).min
    return rows


def read_labels(text: str) -> list[str]:
    """A labels file's lines (trailing whitespace dropped): line i names class i."""
    return [line.rstrip() for line in text.splitlines()]
