"""output() as DL4J's: a single example is one row; masks (keyword inputs) go by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch import nn

from paraloom import ParallelInference
from paraloom.inference.errors import InvalidRequestError


class Masked(nn.Module):
    """Sum of the masked features times a weight: the mask changes the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.w(x if mask is None else x * mask)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Masked().eval()


@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_a_single_example_is_one_row(model, mode):
    row = [0.5, -1.0, 2.0, 0.25]
    expected = model(torch.tensor([row])).detach()
    with ParallelInference(model, inference_mode=mode, workers=2) as pool:
        for x in (row, tuple(row), torch.tensor(row), np.array(row, dtype=np.float32)):
            out = pool.output(x)
            assert tuple(out.shape) == (1, 2), type(x)
            torch.testing.assert_close(torch.as_tensor(out), expected)
        assert isinstance(pool.output(np.array(row, dtype=np.float32)), np.ndarray)
        # a 2-D input is still a batch of rows, as is a list of rows
        assert pool.output(torch.tensor([row, row, row])).shape == (3, 2)
        torch.testing.assert_close(pool.output([row, row]), expected.expand(2, 2))


def test_masks_go_by_keyword_and_batch_with_the_rows(model):
    x = torch.randn(3, 4)
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * 3)
    expected = model(x, mask=mask).detach()
    with ParallelInference(model, workers=1, batch_limit=8) as pool:
        torch.testing.assert_close(pool.output(x, mask=mask), expected)
        # a single example with its 1-D mask is one row as well
        torch.testing.assert_close(pool.output(x[0].tolist(), mask=mask[0]), expected[:1])
        torch.testing.assert_close(asyncio.run(pool.output_async(x, mask=mask)), expected)
        with pytest.raises(InvalidRequestError, match="disagree on the number of rows"):
            pool.output(x, mask=mask[:2])
    assert not torch.equal(expected, model(x).detach())  # the mask mattered


def test_keyword_inputs_in_inplace_mode(model):
    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    with ParallelInference(model, inference_mode="inplace", workers=1) as pool:
        torch.testing.assert_close(pool.output(x, mask=mask), model(x, mask=mask).detach())
