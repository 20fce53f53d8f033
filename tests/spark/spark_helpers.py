"""Data, models and failure-injecting losses for the Spark tests (shipped to executors by value)."""

from __future__ import annotations

import os
import socket
import time
from html.parser import HTMLParser

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.datasets import digits


def rows(split: str) -> list[tuple]:
    """The digits split as (1x8x8 float32 array, int label) pairs."""
    x, y = digits(split).tensors
    return list(zip(x.numpy(), y.tolist(), strict=True))


def rdd(sc, split: str, partitions: int = 2):
    return sc.parallelize(rows(split), partitions)


def unequal_rdd(sc, split: str, first: int):
    """Two partitions of different sizes: ``first`` rows, then the rest."""
    data = rows(split)
    return sc.parallelize([data[:first], data[first:]], 2).flatMap(lambda part: part)


def dataframe(spark, split: str):
    """A DataFrame with a flat 64-float ``features`` array column and a long ``label``."""
    x, y = digits(split).tensors
    records = [(row.reshape(-1).tolist(), int(label)) for row, label in zip(x, y, strict=True)]
    return spark.createDataFrame(records, "features array<float>, label long")


def accuracy(model: nn.Module, dataset) -> float:
    """Test accuracy of ``model`` on a TensorDataset, computed locally."""
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        return float((model(x).argmax(1) == y).float().mean())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Crash(nn.Module):
    """Cross-entropy; on rank ``rank``'s ``at``-th call the process exits.

    With ``marker``, only while the marker file does not exist: it is written just before the
    exit, so only the first stage attempt dies (a deterministic "task killed mid-fit").
    Without it, every attempt dies.
    """

    def __init__(self, at: int, rank: int = 1, marker: str | None = None) -> None:
        super().__init__()
        self.marker, self.at, self.rank, self.calls = marker, at, rank, 0

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and _rank() == self.rank:
            if self.marker is None:
                os._exit(3)
            if not os.path.exists(self.marker):
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                os._exit(3)
        return F.cross_entropy(out, target)


class FailAt(nn.Module):
    """Cross-entropy; rank ``rank`` raises ValueError on its ``at``-th call."""

    def __init__(self, at: int, rank: int = 1) -> None:
        super().__init__()
        self.at, self.rank, self.calls = at, rank, 0

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and _rank() == self.rank:
            raise ValueError(f"injected failure on call {self.calls}")
        return F.cross_entropy(out, target)


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.timelines: dict[str, int] = {}
        self.current: str | None = None
        self.tags: set[str] = set()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag == "svg" and "timeline" in (attrs.get("class") or ""):
            self.current = attrs["data-worker"]
            self.timelines[self.current] = 0
        if tag == "rect" and self.current is not None:
            self.timelines[self.current] += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self.current = None


def read_page(path) -> tuple[str, _Page]:
    """The HTML text and what a parser found in it (timelines and their bars, tags, URLs)."""
    text = path.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    return text, page


class TwoTowers(nn.Module):
    """Two inputs (the top and bottom halves of a digit), two outputs (class logits, brightness)."""

    def __init__(self) -> None:
        super().__init__()
        self.top, self.bottom = nn.Linear(32, 32), nn.Linear(32, 32)
        self.digit, self.shade = nn.Linear(64, 10), nn.Linear(64, 1)

    def forward(self, top: torch.Tensor, bottom: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.cat([F.relu(self.top(top)), F.relu(self.bottom(bottom))], dim=1)
        return self.digit(h), self.shade(h).squeeze(1)


def two_tower_columns(split: str):
    """The digits split as numpy columns: top (n, 32), bottom (n, 32), label, brightness
    (the mean pixel, standardized: its spread is comparable to the class loss's)."""
    x, y = digits(split).tensors
    flat = x.reshape(len(x), 64).numpy()
    return flat[:, :32], flat[:, 32:], y.numpy(), (flat.mean(1) - 0.3) * 30


def two_tower_dataframe(spark, split: str):
    """Columns ``top`` (array<float>), ``b0`` .. ``b31`` (floats), ``label``, ``brightness``."""
    top, bottom, label, bright = two_tower_columns(split)
    records = [(t.tolist(), *map(float, b), int(lab), float(br))
               for t, b, lab, br in zip(top, bottom, label, bright, strict=True)]
    schema = ", ".join(["top array<float>", *[f"b{i} float" for i in range(32)],
                        "label long", "brightness float"])
    return spark.createDataFrame(records, schema)


class ByName(nn.Module):
    """TwoTowers called with keywords (``model(**inputs)``)."""

    def __init__(self, towers: nn.Module) -> None:
        super().__init__()
        self.towers = towers

    def forward(self, *, top: torch.Tensor, bottom: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.towers(top, bottom)


class Shaped(nn.Module):
    """TwoTowers called with keywords, its ``top`` input reshaped to (4, 8) by feature_shape."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = TwoTowers()

    def forward(self, *, top: torch.Tensor, bottom: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if top.shape[1:] != (4, 8) or bottom.shape[1:] != (32,):
            raise ValueError(f"inputs of shapes {tuple(top.shape)}, {tuple(bottom.shape)}")
        return self.towers(top.flatten(1), bottom)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for start in range(41000, 60000, 97):
        socks = []
        try:
            for p in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return start
    raise RuntimeError("no free port range")

class BagOfIds(nn.Module):
    """An nn.Embedding over a row of item ids, averaged, then two class logits."""

    def __init__(self, items: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(items, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids).mean(1))


class IdsEcho(nn.Module):
    """Returns its int64 input as it came (a parameter so that the model has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dtype == torch.int64
        return ids


class StuckOnMarkedRows(nn.Module):
    """A Linear(2, 2) whose training forward hangs on a row whose first value is over 100."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and bool((x[:, 0] > 100).any()):
            time.sleep(3600)
        return self.linear(x)


class Items(nn.Module):
    """418 parameters: each step's message moves about 3 of them, so most of what a fit
    trains is still in the residuals at its end."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e, self.o = nn.Embedding(50, 8), nn.Linear(8, 2)

    def forward(self, item: torch.Tensor) -> torch.Tensor:
        return self.o(self.e(item.view(-1)))


class Normed(nn.Module):
    """BatchNorm on 4 features: a minibatch of one row fails in training."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.r = nn.Linear(4, 2), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"cls": self.c(x), "reg": self.r(x)}


class ScoreAndProbability(nn.Module):
    """A regression score and, second, a sigmoid probability (trained with BCELoss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.s, self.p = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"score": self.s(x), "prob": torch.sigmoid(self.p(x))}


class Tagger(nn.Module):
    """Per position scores: (rows, positions, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).reshape(len(x), 2, 3)


class Released(nn.Module):
    """A classifier of 4 features whose extra state (get_extra_state) names its release."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.release = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def get_extra_state(self) -> dict[str, str]:
        return {"release": self.release}

    def set_extra_state(self, state: dict[str, str]) -> None:
        self.release = state["release"]
