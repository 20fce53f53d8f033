"""A small character-level language model on text every machine has: the Python standard
library's own source files. ``paraloom bench convergence --tasks charlm`` trains it and reports
the validation loss (nats per character).

Training text: the standard library's top-level modules in name order, every fourth one left
out for validation; characters outside printable ASCII become one "unknown" symbol. The model
is a causal transformer (pre-norm, learned positions) that outputs ``(batch, vocab, time)``
logits, so ``nn.CrossEntropyLoss`` takes them with ``(batch, time)`` targets as they are.
"""

from __future__ import annotations

import string
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["CharTransformer", "stdlib_text", "char_datasets", "VOCAB"]

VOCAB = string.printable
"""The symbols the model knows; everything else is symbol ``len(VOCAB)``."""


def stdlib_text(chars: int, validation: bool) -> str:
    """About ``chars`` characters of the standard library's source: training files, or every
    fourth file (validation)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [f for i, f in enumerate(files) if (i % 4 == 3) == validation]
    parts, total = [], 0
    for path in chosen:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    return "".join(parts)[:chars]


def _encode(text: str) -> torch.Tensor:
    table = {c: i for i, c in enumerate(VOCAB)}
    unknown = len(VOCAB)
    return torch.tensor([table.get(c, unknown) for c in text], dtype=torch.long)


def char_datasets(context: int = 64, train_chars: int = 400_000,
                  validation_chars: int = 60_000) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation): non-overlapping windows of ``context`` characters (inputs) and the
    same windows shifted by one (targets)."""
    out = []
    for chars, validation in ((train_chars, False), (validation_chars, True)):
        codes = _encode(stdlib_text(chars, validation))
        n = (codes.numel() - 1) // context
        x = codes[:n * context].reshape(n, context)
        y = codes[1:n * context + 1].reshape(n, context)
        out.append(TensorDataset(x, y))
    return out[0], out[1]


class CharTransformer(nn.Module):
    """A causal transformer over characters: ``layers`` pre-norm blocks of width ``width``
    with ``heads`` heads, positions up to ``context``; logits as (batch, vocab, time)."""

    def __init__(self, context: int = 64, width: int = 96, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        vocab = len(VOCAB) + 1
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        t = codes.shape[1]
        h = self.embed(codes) + self.position[:t]
        # Made per call, not a buffer: a buffer would be averaged with the model's state.
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=codes.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits.transpose(1, 2)
