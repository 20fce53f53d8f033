"""Arrays of one field or several: stacking, slicing and joining rows of multi-input data.

A field's rows are one numpy array, a tuple of arrays (positional inputs or several targets)
or a dict of arrays (keyword inputs); every function here keeps that structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np

__all__ = ["Arrays", "stack", "concat", "take", "num_rows", "leaves", "map_arrays", "empty_like"]

Arrays: TypeAlias = np.ndarray | tuple[np.ndarray, ...] | dict[str, np.ndarray]
"""One field of a batch of rows: an array, a tuple of arrays, or a dict of arrays."""


def map_arrays(f: Callable[[np.ndarray], Any], a: Any) -> Any:
    """``f`` applied to every array of ``a``, keeping its tuple / dict structure."""
    if isinstance(a, tuple):
        return tuple(f(v) for v in a)
    if isinstance(a, dict):
        return {k: f(v) for k, v in a.items()}
    return f(a)


def leaves(a: Any) -> list[np.ndarray]:
    """The arrays of ``a`` in order."""
    if isinstance(a, tuple):
        return list(a)
    if isinstance(a, dict):
        return list(a.values())
    return [a]


def num_rows(a: Any) -> int:
    """Rows in ``a`` (the first array's length; 0 for no arrays)."""
    first = leaves(a)
    return len(first[0]) if first else 0


def take(a: Any, idx: np.ndarray) -> Any:
    """Rows ``idx`` of every array of ``a``."""
    return map_arrays(lambda v: v[idx], a)


def _stack_one(values: Sequence[np.ndarray], what: str) -> np.ndarray:
    try:
        return np.stack(values)
    except ValueError as e:
        shapes = sorted({np.shape(v) for v in values})[:4]
        raise ValueError(f"{what} rows have different shapes {shapes}: every row must have the "
                         f"same shape ({e})") from e


def stack(rows: Sequence[Any], what: str = "feature") -> Any:
    """One array per field from per-row values (arrays, or tuples / dicts of arrays)."""
    first = rows[0]
    if isinstance(first, tuple):
        if any(not isinstance(r, tuple) or len(r) != len(first) for r in rows):
            raise ValueError(f"{what} rows hold different numbers of arrays: every row must "
                             f"have the same inputs")
        return tuple(_stack_one([r[i] for r in rows], f"{what} {i}") for i in range(len(first)))
    if isinstance(first, dict):
        if any(not isinstance(r, dict) or r.keys() != first.keys() for r in rows):
            raise ValueError(f"{what} rows hold different keys: every row must have the same "
                             f"inputs {sorted(first)}")
        return {k: _stack_one([r[k] for r in rows], f"{what} {k!r}") for k in first}
    return _stack_one(rows, what)


def concat(parts: Sequence[Any]) -> Any:
    """Row-wise concatenation of same-structured arrays (a partition's chunks joined)."""
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in first}
    return np.concatenate(parts)


def empty_like(a: Any) -> Any:
    """``a`` with no rows (same structure, dtypes and row shapes)."""
    return map_arrays(lambda v: v[:0], a)
