"""Features: how stacked numpy rows become the model's input and target tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paraloom.spark.data.arrays import Arrays

if TYPE_CHECKING:  # typing has TypeIs from Python 3.13 on
    from typing_extensions import TypeIs

__all__ = ["Dtypes", "Features", "Shapes", "ShapeArgument", "Tensors", "normalize_dtypes"]

Shape = tuple[int, ...]
Shapes = Shape | tuple[Shape | None, ...] | dict[str, Shape | None]
"""One input's per-row shape, or one per input (a tuple in argument order, or by name)."""
Dtypes = str | tuple[str | None, ...] | dict[str, str | None]
"""The inputs' dtype names: one for all, or one (or None: the model's) per input."""
ShapeArgument = Sequence[int] | Sequence[Sequence[int] | None] | dict[str, Sequence[int] | None]
"""``SparkModel(feature_shape=...)`` as given: lists or tuples."""
Tensors = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""A batch's inputs or targets as the model and the loss take them: ``Arrays`` as tensors."""


def _is_shape(value: object) -> TypeIs[Shape]:
    return isinstance(value, tuple) and all(isinstance(v, int) for v in value)


def normalize_shapes(value: ShapeArgument | None) -> Shapes | None:
    """``feature_shape=`` as tuples: a shape, a sequence of shapes (or None), or a dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): None if v is None else tuple(int(d) for d in v) for k, v in value.items()}
    items = tuple(value)
    numbers = [int(v) for v in items if isinstance(v, (int, np.integer))]
    if len(numbers) == len(items):
        return tuple(numbers)
    shapes = [v for v in items if v is None or isinstance(v, (list, tuple))]
    if len(shapes) == len(items):
        return tuple(None if v is None else tuple(int(d) for d in v) for v in shapes)
    raise TypeError(f"feature_shape={value!r}; expected a shape (e.g. (1, 8, 8)), one shape "
                    f"(or None) per input, or a dict of them by input name")


def normalize_dtypes(value: object) -> Dtypes | None:
    """``feature_dtype=`` as names: a torch dtype, a sequence of them (or None), or a dict."""
    def name(dtype: object) -> str | None:
        if dtype is None:
            return None
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"feature_dtype holds {dtype!r}; expected torch dtypes, e.g. "
                            "torch.long for an nn.Embedding's ids")
        return str(dtype).removeprefix("torch.")

    if value is None or isinstance(value, torch.dtype):
        return name(value)
    if isinstance(value, dict):
        return {str(k): name(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(name(v) for v in value)
    raise TypeError(f"feature_dtype={value!r}; expected a torch dtype, one (or None) per "
                    "input, or a dict of them by input name")


@dataclass(frozen=True)
class Features:
    """How stacked numpy rows become tensors: feature shape(s) and dtypes.

    Several inputs (or targets) arrive as tuples or dicts of arrays and leave as tuples or
    dicts of tensors, ready for ``model(*inputs)`` / ``model(**inputs)``.
    """

    shape: Shapes | None = None
    """Per-row shape the model expects (e.g. (1, 8, 8)), or one per input; None keeps the
    rows' own shape (read from the data)."""
    dtype: str = "float32"
    label_dtype: str | None = None
    """None: integer labels become int64, floating ones ``dtype``."""
    input_dtypes: Dtypes | None = None
    """The inputs' dtypes (``SparkModel(feature_dtype=...)``): one for every input, or one (or
    None) per input as ``shape`` gives shapes; None: ``dtype``."""

    def _input(self, x: np.ndarray, shape: Shape | None, name: str, dtype: str | None
               ) -> torch.Tensor:
        # Arrow's zero-copy arrays are read-only: torch would warn on each (a copy is cheap).
        x = np.require(x, requirements=("C_CONTIGUOUS", "WRITEABLE"))
        t = torch.from_numpy(x).to(getattr(torch, dtype or self.dtype))
        if shape is not None:
            per_row = int(np.prod(shape))
            if len(t) and t[0].numel() != per_row:
                raise ValueError(f"a row of {name} has {t[0].numel()} values but feature_shape="
                                 f"{shape} needs {per_row}; fix feature_shape")
            t = t.reshape(len(t), *shape)
        return t

    def shapes_for(self, x: object) -> Shapes | None:
        """``feature_shape`` laid out like ``x`` (one input, a tuple or a dict of them): one
        shape or None per input; a ValueError when they (or ``feature_dtype``) do not fit.

        Only ``x``'s structure is read (its length or keys), so the driver checks
        ``Columns.features`` with it before any Spark job.
        """
        inputs = _inputs_of(x)
        self._dtypes(inputs)
        shapes = self._shapes(inputs)
        if inputs is None:
            return shapes[0]  # type: ignore[no-any-return]
        return tuple(shapes) if isinstance(shapes, list) else shapes

    def _shapes(self, inputs: int | list[str] | None) -> Any:
        """``shape`` laid out as the inputs: a list by position or a dict by name."""
        return _per_input(self.shape, _is_shape(self.shape), "feature_shape", "shape", inputs,
                          broadcast=False)

    def _dtypes(self, inputs: int | list[str] | None) -> Any:
        """``input_dtypes`` laid out as the inputs: a list by position or a dict by name."""
        return _per_input(self.input_dtypes, isinstance(self.input_dtypes, str),
                          "feature_dtype", "dtype", inputs, broadcast=True)

    def features(self, x: Arrays) -> Tensors:
        """A batch of feature rows as tensor(s) of the model's dtype and input shape(s)."""
        inputs = _inputs_of(x)
        shapes, dtypes = self._shapes(inputs), self._dtypes(inputs)
        if isinstance(x, tuple):
            return tuple(self._input(v, shapes[i], f"input {i}", dtypes[i])
                         for i, v in enumerate(x))
        if isinstance(x, dict):
            return {k: self._input(v, shapes[k], f"input {k!r}", dtypes[k])
                    for k, v in x.items()}
        return self._input(x, shapes[0], "features", dtypes[0])

    def _label(self, y: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(y))
        if self.label_dtype is not None:
            return t.to(getattr(torch, self.label_dtype))
        if t.dtype.is_floating_point:
            return t.to(getattr(torch, self.dtype))
        if t.dtype == torch.bool:
            return t.long()
        return t.to(torch.int64)

    def labels(self, y: Arrays) -> Tensors:
        """A batch of labels: int64 for integers (class indices), else the feature dtype; a
        tuple (or dict) of them for several outputs."""
        if isinstance(y, tuple):
            return tuple(self._label(v) for v in y)
        if isinstance(y, dict):
            return {k: self._label(v) for k, v in y.items()}
        return self._label(y)


def _inputs_of(x: object) -> int | list[str] | None:
    """A batch's inputs as ``_per_input`` takes them: a count for a tuple, the names of a
    dict, None for one input."""
    if isinstance(x, tuple):
        return len(x)
    if isinstance(x, dict):
        return [str(k) for k in x]
    return None


def _per_input(given: Any, single: bool, option: str, what: str,
               inputs: int | list[str] | None, broadcast: bool) -> Any:
    """An option given once, per position or by name (``feature_shape``, ``feature_dtype``)
    laid out as the inputs are (a count, names, or None for one input): a list by position
    (one item for one input) or a dict by name, None where it gives nothing. One value
    applies to every input if ``broadcast``, else only to a lone input. A ValueError naming
    the fix when the two do not fit."""
    count = 1 if inputs is None else inputs if isinstance(inputs, int) else len(inputs)
    if given is None or (single and (broadcast or inputs is None)):
        one = [given] * count
        return dict(zip(inputs, one, strict=True)) if isinstance(inputs, list) else one
    if inputs is None:
        if not isinstance(given, dict) and len(given) == 1:
            return list(given)  # one per input, for the one input
        raise ValueError(f"{option}={given} gives {len(given)} {what}s but the rows hold one "
                         f"input; give one {what}, or pass inputs=")
    if isinstance(inputs, list):
        if not isinstance(given, dict):
            raise ValueError(f"{option}={given} but the rows hold keyword inputs {inputs}; "
                             f"give a dict of {what}s by input name")
        unknown = sorted(set(given) - set(inputs))
        if unknown:
            raise ValueError(f"{option} names inputs {unknown} that the rows do not have; "
                             f"their inputs are {sorted(inputs)}")
        return {k: given.get(k) for k in inputs}
    if single or isinstance(given, dict):
        raise ValueError(f"{option}={given} but the rows hold {count} positional inputs; give "
                         f"a tuple with one {what} (or None) per input, in order")
    if len(given) != count:
        raise ValueError(f"{option} gives {len(given)} {what}s but the rows hold {count} "
                         f"inputs; give one {what} (or None) per input, in order")
    return list(given)
