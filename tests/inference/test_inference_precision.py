"""precision=: Lightning's names, float32 outputs, replicas converted but never the user's model."""

from __future__ import annotations

import pytest
import torch

from paraloom.inference import ParallelInference
from paraloom.models import MLP
from paraloom.precision import PRECISIONS, resolve_precision


@pytest.fixture()
def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=16, hidden=(32,), num_classes=4).eval()


@pytest.mark.parametrize("name, tolerance", [("32-true", 0.0), ("bf16-mixed", 0.05),
                                             ("16-mixed", 0.01), ("bf16-true", 0.05),
                                             ("16-true", 0.01)])
def test_every_precision_gives_float32_outputs_close_to_full_precision(mlp, name, tolerance):
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = mlp(x)
    with ParallelInference(mlp, inference_mode="sequential", workers=1, precision=name,
                           example_input=x[:1]) as pi:
        y = pi.output(x)
    assert y.dtype == torch.float32
    if tolerance == 0.0:
        torch.testing.assert_close(y, expected)
    else:
        torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)
        assert not torch.equal(y, expected)   # it really ran in lower precision
    assert all(p.dtype == torch.float32 for p in mlp.parameters())   # the user's model untouched


def test_unknown_precision_lists_the_valid_names(mlp):
    with pytest.raises(ValueError, match="precision='fp16' is not known; expected one of "
                                         "'32-true', '16-mixed'"):
        ParallelInference(mlp, precision="fp16")
    with pytest.raises(TypeError, match="precision must be a string"):
        resolve_precision(16)
    assert set(PRECISIONS) == {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}
