"""Pure pieces of Spark's predict and column checks, without a Spark session."""

from __future__ import annotations

import pytest
import torch

from paraloom.spark.data.rows import cast_hint
from paraloom.spark.evaluation.inference import row_outputs


def test_argmax_of_nan_outputs_is_refused_not_read_as_class_0() -> None:
    """predict(argmax=True) gave class 0 for a row whose features held NaN (argmax and
    ``NaN > threshold`` both read 0), where evaluate refused the same outputs."""
    assert row_outputs(torch.tensor([[0.1, 0.9], [2.0, -1.0]]), argmax=True) == [1, 0]
    assert row_outputs(torch.tensor([[0.3], [-0.2]]), argmax=True) == [1, 0]
    for nan in (torch.tensor([[float("nan"), 1.0]]), torch.tensor([float("nan")])):
        with pytest.raises(ValueError, match="outputs hold NaN.*input features"):
            row_outputs(nan, argmax=True)
    assert row_outputs(torch.tensor([[float("nan"), 1.0]]), argmax=False)[0].shape == (2,)


def test_a_bytes_column_is_not_told_to_cast_to_double() -> None:
    """Spark refuses cast('double') of binary: the hint named a fix that fails."""
    assert "bytes cannot be cast" not in cast_hint(["string"])
    for kind in ("binary", "large_binary", "fixed_size_binary[16]"):
        assert "bytes cannot be cast: store them as array<float>" in cast_hint([kind])
