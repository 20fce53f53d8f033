"""Batch structures beyond tensors, tuples and dicts: PackedSequences (one input, its sequences
the rows) and mappings that are not dicts (a tokenizer's BatchEncoding is a UserDict)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence
from torch.utils.data import DataLoader

from paraloom import ParallelInference, ParallelWrapper
from paraloom.data import batch_size, describe, iter_tensors, map_tensors, to_device
from paraloom.inference import InvalidRequestError

pytestmark = pytest.mark.timeout(120)


class Encoding(collections.UserDict):
    """What a Hugging Face tokenizer returns: a UserDict of tensors, not a dict."""


def _sequences(n: int = 192, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(int(torch.randint(2, 9, (1,), generator=g)), 3, generator=g)
        out.append((x, int(x[:, 0].sum() > 0)))
    return out


def _packed(batch: list[tuple[torch.Tensor, int]]) -> tuple[PackedSequence, torch.Tensor]:
    xs, ys = zip(*batch, strict=True)
    return pack_sequence(list(xs), enforce_sorted=False), torch.tensor(ys)


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 16, batch_first=True)
        self.out = nn.Linear(16, 2)

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        _, h = self.rnn(packed)
        return self.out(h[-1])


def test_a_packed_sequence_is_one_input_whose_sequences_are_the_rows():
    packed, _ = _packed(_sequences(5))
    assert batch_size(packed) == batch_size((packed, torch.ones(1))) == 5
    assert describe(packed).startswith("PackedSequence(5 sequences, Tensor(")
    copied = map_tensors(packed, lambda t: t.clone())
    assert isinstance(copied, PackedSequence)
    assert all(torch.equal(a, b) for a, b in zip(copied, packed, strict=True))
    doubled = map_tensors(packed, lambda t: t.to(torch.float64))  # the data only
    assert doubled.data.dtype == torch.float64 and doubled.batch_sizes.dtype == torch.int64
    assert doubled.unsorted_indices.dtype == torch.int64
    assert isinstance(to_device(packed, torch.device("cpu")), PackedSequence)


def test_a_mapping_that_is_not_a_dict_keeps_its_type():
    encoding = Encoding(input_ids=torch.ones(2, 3), mask=torch.zeros(2, 3))
    assert len(list(iter_tensors(encoding))) == 2
    moved = map_tensors(encoding, lambda t: t + 1)
    assert isinstance(moved, Encoding) and torch.equal(moved["mask"], torch.ones(2, 3))
    assert batch_size(encoding) == 2


@pytest.mark.parametrize("mode", ["averaging", "allreduce"])
def test_an_rnn_trains_on_packed_sequences(mode):
    torch.manual_seed(0)
    model = GRUClassifier()
    data = _sequences()
    loader = DataLoader(data, batch_size=16, collate_fn=_packed)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         training_mode=mode,
                         optimizer=torch.optim.Adam(model.parameters(), lr=0.02)) as w:
        stats = w.fit(loader, epochs=4)
    assert stats["samples"] == 4 * len(data)  # sequences counted, not time steps
    packed, labels = _packed(data)
    with torch.no_grad():
        accuracy = (model(packed).argmax(1) == labels).float().mean().item()
    assert accuracy > 0.8


def test_keyword_inputs_in_a_tokenizer_style_mapping_train():
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.out = nn.Linear(8, 2)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            h = (self.embed(input_ids) * attention_mask.unsqueeze(-1)).sum(1)
            return self.out(h / attention_mask.sum(1, keepdim=True))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (256, 5), generator=g)
    labels = ((ids >= 5).sum(1) >= 3).long()  # most tokens from the upper half
    batches = [(Encoding(input_ids=ids[i:i + 32], attention_mask=torch.ones(32, 5)),
                labels[i:i + 32]) for i in range(0, 256, 32)]
    torch.manual_seed(0)
    model = Tagger()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.Adam(model.parameters(), lr=0.05)) as w:
        stats = w.fit(batches, epochs=8)
    assert stats["samples"] == 8 * 256
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=torch.ones(256, 5)).argmax(1)
    assert (predicted == labels).float().mean() > 0.9


def test_parallel_inference_refuses_packed_sequences_with_the_way_to_send_them():
    packed, _ = _packed(_sequences(4))
    with ParallelInference(GRUClassifier().eval(), workers=1) as pool:
        for request in (packed, (packed,), {"packed": packed}):
            with pytest.raises(InvalidRequestError, match="PackedSequence cannot be split.*"
                                                          "padded batch"):
                pool.output(request)


def test_parallel_inference_takes_a_tokenizer_style_mapping_as_keyword_inputs():
    class Scorer(nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return (input_ids * attention_mask).sum(1, keepdim=True)

    ids, mask = torch.arange(12.0).reshape(4, 3), torch.tensor([[1.0, 1.0, 0.0]] * 4)
    with ParallelInference(Scorer(), workers=2) as pool:
        out = pool.output(Encoding(input_ids=ids, attention_mask=mask))
    torch.testing.assert_close(out, (ids * mask).sum(1, keepdim=True))
