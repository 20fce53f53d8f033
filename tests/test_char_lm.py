"""The convergence benchmark's language model: its data and its causal transformer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom.bench.char_lm import VOCAB, CharTransformer, char_datasets, stdlib_text

pytestmark = pytest.mark.timeout(60)


def test_the_text_is_the_standard_library_split_by_file() -> None:
    train, validation = stdlib_text(20_000, False), stdlib_text(20_000, True)
    assert len(train) == len(validation) == 20_000
    assert "def " in train and "import" in validation and train[:500] != validation[:500]


def test_targets_are_the_inputs_shifted_by_one() -> None:
    train, validation = char_datasets(context=32, train_chars=5_000, validation_chars=2_000)
    x, y = train.tensors
    assert x.shape == (156, 32) and y.shape == x.shape
    assert torch.equal(x[0, 1:], y[0, :-1]) and torch.equal(x[1, 0], y[0, -1])
    assert int(x.max()) <= len(VOCAB) and len(validation) == 62


def test_the_model_is_causal_and_fits_cross_entropy() -> None:
    torch.manual_seed(0)
    model = CharTransformer(context=16, width=32, heads=2, layers=1).eval()
    codes = torch.randint(0, len(VOCAB), (2, 16))
    logits = model(codes)
    assert logits.shape == (2, len(VOCAB) + 1, 16)
    changed = codes.clone()
    changed[:, 10] = (changed[:, 10] + 1) % len(VOCAB)
    with torch.no_grad():
        again = model(changed)
    torch.testing.assert_close(again[..., :10], logits[..., :10].detach())  # the past only
    assert not torch.allclose(again[..., 10:], logits[..., 10:].detach())
    loss = nn.CrossEntropyLoss()(logits, codes)
    assert abs(loss.item() - torch.log(torch.tensor(len(VOCAB) + 1.0))) < 1.0
