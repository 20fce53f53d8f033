"""Features: how stacked numpy rows become the model's input and target tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Features"]


@dataclass(frozen=True)
class Features:
    """How stacked numpy rows become tensors: feature shape and dtypes."""

    shape: tuple[int, ...] | None = None
    """Per-row shape the model expects (e.g. (1, 8, 8)); None keeps the rows' own shape."""
    dtype: str = "float32"
    label_dtype: str | None = None
    """None: integer labels become int64, floating ones ``dtype``."""

    def features(self, x: np.ndarray) -> torch.Tensor:
        """A batch of feature rows as a tensor of the model's dtype and input shape."""
        t = torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, self.dtype))
        if self.shape is not None:
            per_row = int(np.prod(self.shape))
            if len(t) and t[0].numel() != per_row:
                raise ValueError(f"a feature row has {t[0].numel()} values but feature_shape="
                                 f"{self.shape} needs {per_row}; fix feature_shape")
            t = t.reshape(len(t), *self.shape)
        return t

    def labels(self, y: np.ndarray) -> torch.Tensor:
        """A batch of labels: int64 for integers (class indices), else the feature dtype."""
        t = torch.from_numpy(np.ascontiguousarray(y))
        if self.label_dtype is not None:
            return t.to(getattr(torch, self.label_dtype))
        if t.dtype.is_floating_point:
            return t.to(getattr(torch, self.dtype))
        if t.dtype == torch.bool:
            return t.long()
        return t.to(torch.int64)
