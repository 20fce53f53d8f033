"""The benchmark workloads: a model, synthetic data of realistic shape, and its loss.

Four sizes, four kinds of layer: LeNet (0.43M parameters, convolutions on 1x28x28), a small
GPT-style transformer (3.5M, causal self-attention on 128 tokens), ResNet-18 (11.2M, the
CIFAR-style stem on 3x32x32) and a wide MLP (37.8M, dense layers on 3,072 features). The data
is random (speed does not depend on it); labels are drawn from the model's output space.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = ["Workload", "WORKLOADS", "workload", "mlp_of_width", "ResNet18", "TinyGPT",
           "TokenCrossEntropy"]


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al., 2016) with the 3x3 stem used for 32x32 images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU()]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.head(self.features(x).mean(dim=(2, 3)))
        return logits


class TinyGPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal blocks, tied head."""

    def __init__(self, vocab: int = 4096, context: int = 128, width: int = 256,
                 layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)  # GPT-2's init: logits start near 0
        self.mask: Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.tokens(tokens) + self.positions.weight[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        logits: Tensor = self.norm(x) @ self.tokens.weight.T  # (batch, tokens, vocab)
        return logits


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of next-token logits (batch, tokens, vocab) against (batch, tokens)."""

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class Workload:
    """A benchmark model with its data and loss."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], TensorDataset]
    """``data(rows, generator)``: a synthetic data set of ``rows`` examples."""
    loss: Callable[[], nn.Module]


def _images(shape: tuple[int, ...], classes: int) -> Callable[[int, torch.Generator],
                                                               TensorDataset]:
    def data(rows: int, g: torch.Generator) -> TensorDataset:
        return TensorDataset(torch.rand(rows, *shape, generator=g),
                             torch.randint(0, classes, (rows,), generator=g))
    return data


def _tokens(rows: int, g: torch.Generator) -> TensorDataset:
    sequences = torch.randint(0, 4096, (rows, 129), generator=g)
    return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())


def _lenet() -> nn.Module:
    from paraloom.models import LeNet

    return LeNet(image_size=28)


def _mlp() -> nn.Module:
    from paraloom.models import MLP

    return MLP(in_features=3072, hidden=(4096, 4096, 2048), num_classes=10)


WORKLOADS = {
    "lenet": Workload("lenet", _lenet, _images((1, 28, 28), 10), nn.CrossEntropyLoss),
    "transformer": Workload("transformer", TinyGPT, _tokens, TokenCrossEntropy),
    "resnet18": Workload("resnet18", ResNet18, _images((3, 32, 32), 10), nn.CrossEntropyLoss),
    "mlp": Workload("mlp", _mlp, _images((3072,), 10), nn.CrossEntropyLoss),
}


@dataclass(frozen=True)
class _WideMLP:
    """Builds the 784-W-W-W-10 MLP (picklable, unlike a lambda, for the DDP ranks)."""

    width: int

    def __call__(self) -> nn.Module:
        from paraloom.models import MLP

        return MLP(in_features=784, hidden=(self.width,) * 3, num_classes=10)


def mlp_of_width(width: int) -> Workload:
    """A 784-W-W-W-10 MLP on 784 features: W = 256 has 0.3M parameters (a step of a few ms
    on one core), 1024 has 2.9M, 4096 has 35M. ``--width`` of ``paraloom bench training``."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r}; expected an int >= 1 (units per hidden layer)")
    return Workload(f"mlp{width}", _WideMLP(width), _images((784,), 10), nn.CrossEntropyLoss)


def workload(name: str) -> Workload:
    """The workload called ``name``; a clear error for an unknown one."""
    if name not in WORKLOADS:
        raise ValueError(f"model={name!r}; expected one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]


def workload_for(model: str, width: int | None = None) -> Workload:
    """``--model`` and ``--width`` of ``bench training``: the named workload, or the
    784-W-W-W-10 MLP."""
    return workload(model) if width is None else mlp_of_width(width)


def bench_sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Every contender's optimizer in ``bench training``: SGD, lr 0.01, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
