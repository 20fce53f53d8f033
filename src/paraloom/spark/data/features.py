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
        if isinstance(x, tuple):
            self._dtypes(len(x))
            return self._positional_shapes(len(x))
        if isinstance(x, dict):
            self._dtypes([str(k) for k in x])
            return self._keyword_shapes([str(k) for k in x])
        self._dtypes(None)
        return self._one_shape()

    def _positional_shapes(self, inputs: int) -> tuple[Shape | None, ...]:
        shape = self.shape
        if isinstance(shape, dict) or _is_shape(shape):
            raise ValueError(f"feature_shape={shape} but the rows hold {inputs} positional "
                             f"inputs; give a tuple with one shape (or None) per input, "
                             f"in order")
        if shape is not None and len(shape) != inputs:
            raise ValueError(f"feature_shape gives {len(shape)} shapes but the rows hold "
                             f"{inputs} inputs; give one shape (or None) per input")
        return shape or (None,) * inputs

    def _keyword_shapes(self, names: list[str]) -> dict[str, Shape | None]:
        shape = self.shape
        if shape is not None and not isinstance(shape, dict):
            raise ValueError(f"feature_shape={shape} but the rows hold keyword inputs "
                             f"{names}; give a dict of shapes by input name, e.g. "
                             f"{{{names[0]!r}: (1, 8, 8)}}")
        named = shape or {}
        unknown = sorted(set(named) - set(names))
        if unknown:
            raise ValueError(f"feature_shape names inputs {unknown} that the rows do not "
                             f"have; their inputs are {sorted(names)}")
        return {k: named.get(k) for k in names}

    def _one_shape(self) -> Shape | None:
        shape = self.shape
        if shape is not None and not _is_shape(shape):
            raise ValueError(f"feature_shape={shape} gives several shapes but the rows hold one "
                             f"input; give one shape, or pass inputs=")
        return shape

    def features(self, x: Arrays) -> Tensors:
        """A batch of feature rows as tensor(s) of the model's dtype and input shape(s)."""
        if isinstance(x, tuple):
            shapes = self._positional_shapes(len(x))
            dtypes = self._dtypes(len(x))
            return tuple(self._input(v, shapes[i], f"input {i}", dtypes[i])
                         for i, v in enumerate(x))
        if isinstance(x, dict):
            named = self._keyword_shapes(list(x))
            by_name = self._dtypes(list(x))
            return {k: self._input(v, named[k], f"input {k!r}", by_name[k])
                    for k, v in x.items()}
        return self._input(x, self._one_shape(), "features", self._dtypes(None)[0])

    def _dtypes(self, inputs: int | list[str] | None) -> Any:
        """``input_dtypes`` laid out as the inputs (a count, names, or None for one input):
        a list by position or a dict by name; a ValueError naming the fix when they differ."""
        given = self.input_dtypes
        count = 1 if inputs is None else inputs if isinstance(inputs, int) else len(inputs)
        if given is None or isinstance(given, str):
            one = [given] * count
            return one if not isinstance(inputs, list) else dict(zip(inputs, one, strict=True))
        if isinstance(inputs, list):
            if not isinstance(given, dict):
                raise ValueError(f"feature_dtype={given} but the rows hold keyword inputs "
                                 f"{inputs}; give one dtype, or a dict of them by input name")
            unknown = sorted(set(given) - set(inputs))
            if unknown:
                raise ValueError(f"feature_dtype names inputs {unknown} that the rows do not "
                                 f"have; their inputs are {sorted(inputs)}")
            return {k: given.get(k) for k in inputs}
        if isinstance(given, dict) or len(given) != count:
            raise ValueError(f"feature_dtype={given} but the rows hold {count} positional "
                             f"input(s); give one dtype, or one (or None) per input, in order")
        return list(given)

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
