"""Arrays of one field or several: stacking, slicing and joining rows of multi-input data.

A field's rows are one numpy array, a tuple of arrays (positional inputs or several targets)
or a dict of arrays (keyword inputs); every function here keeps that structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

import numpy as np

__all__ = ["Arrays", "stack", "concat", "take", "num_rows", "leaves", "map_arrays", "empty_like"]

Arrays: TypeAlias = np.ndarray | tuple[np.ndarray, ...] | dict[str, np.ndarray]
"""One field of a batch of rows: an array, a tuple of arrays, or a dict of arrays."""


def map_arrays(f: Callable[[np.ndarray], np.ndarray], a: Arrays) -> Arrays:
    """``f`` applied to every array of ``a``, keeping its tuple / dict structure."""
    if isinstance(a, tuple):
        return tuple(f(v) for v in a)
    if isinstance(a, dict):
        return {k: f(v) for k, v in a.items()}
    return f(a)


def leaves(a: Arrays) -> list[np.ndarray]:
    """The arrays of ``a`` in order."""
    if isinstance(a, tuple):
        return list(a)
    if isinstance(a, dict):
        return list(a.values())
    return [a]


def num_rows(a: Arrays) -> int:
    """Rows in ``a`` (the first array's length; 0 for no arrays)."""
    first = leaves(a)
    return len(first[0]) if first else 0


def take(a: Arrays, idx: np.ndarray | slice) -> Arrays:
    """Rows ``idx`` (indices or a slice) of every array of ``a``."""
    return map_arrays(lambda v: v[idx], a)


def _stack_one(values: Sequence[np.ndarray], what: str) -> np.ndarray:
    try:
        return np.stack(values)
    except ValueError as e:
        shapes = sorted({np.shape(v) for v in values})[:4]
        raise ValueError(f"{what} rows have different shapes {shapes}: every row must have the "
                         f"same shape ({e})") from e


def stack(rows: Sequence[Arrays], what: str = "feature") -> Arrays:
    """One array per field from per-row values (arrays, or tuples / dicts of arrays)."""
    first = rows[0]
    if isinstance(first, tuple):
        tuples = [r for r in rows if isinstance(r, tuple) and len(r) == len(first)]
        if len(tuples) != len(rows):
            raise ValueError(f"{what} rows hold different numbers of arrays: every row must "
                             f"have the same inputs")
        return tuple(_stack_one([r[i] for r in tuples], f"{what} {i}")
                     for i in range(len(first)))
    if isinstance(first, dict):
        dicts = [r for r in rows if isinstance(r, dict) and r.keys() == first.keys()]
        if len(dicts) != len(rows):
            raise ValueError(f"{what} rows hold different keys: every row must have the same "
                             f"inputs {sorted(first)}")
        return {k: _stack_one([r[k] for r in dicts], f"{what} {k!r}") for k in first}
    return _stack_one(cast("Sequence[np.ndarray]", rows), what)


def concat(parts: Sequence[Arrays]) -> Arrays:
    """Row-wise concatenation of same-structured arrays (a partition's chunks joined)."""
    first = parts[0]
    if isinstance(first, tuple):
        tuples = cast("Sequence[tuple[np.ndarray, ...]]", parts)
        return tuple(np.concatenate([p[i] for p in tuples]) for i in range(len(first)))
    if isinstance(first, dict):
        dicts = cast("Sequence[dict[str, np.ndarray]]", parts)
        return {k: np.concatenate([p[k] for p in dicts]) for k in first}
    return np.concatenate(cast("Sequence[np.ndarray]", parts))


def empty_like(a: Arrays) -> Arrays:
    """``a`` with no rows (same structure, dtypes and row shapes)."""
    return map_arrays(lambda v: v[:0], a)
