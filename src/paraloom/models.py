"""Reference networks: DL4J's LeNet example and a small MLP."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LeNet", "MLP", "build_model"]


class LeNet(nn.Module):
    """DL4J's LeNet: conv 5x5x20, max-pool, conv 5x5x50, max-pool, dense 500 relu, 10 logits.

    The convolutions are padded when the input is too small for unpadded 5x5 kernels
    (scikit-learn's 8x8 digits), and left unpadded for 28x28 MNIST, as in the DL4J example.
    The network returns logits; pair it with ``nn.CrossEntropyLoss`` (softmax is in the loss).
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        if image_size < 4:
            raise ValueError(f"image_size={image_size} is too small for LeNet; expected >= 4")
        self.config = {"in_channels": in_channels, "image_size": image_size,
                       "num_classes": num_classes}
        # Unpadded 5x5 convolutions need 28x28-like inputs; smaller images keep their size.
        padding = 0 if image_size >= 16 else 2
        size = image_size
        size = (size + 2 * padding - 4) // 2
        size = (size + 2 * padding - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=5, padding=padding),
            nn.MaxPool2d(2),
            nn.Conv2d(20, 50, kernel_size=5, padding=padding),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * size * size, 500),
            nn.ReLU(),
            nn.Linear(500, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]`` for images ``[N, in_channels, image_size, image_size]``."""
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


class MLP(nn.Module):
    """A multi-layer perceptron over flattened inputs: ``hidden`` gives the widths of the hidden
    layers (one int: a single hidden layer)."""

    def __init__(self, in_features: int = 64,
                 hidden: int | tuple[int, ...] | list[int] = (128, 64),
                 num_classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = [hidden] if isinstance(hidden, int) else list(hidden)
        self.config = {"in_features": in_features, "hidden": list(hidden),
                       "num_classes": num_classes, "dropout": dropout}
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]`` for inputs ``[N, ...]`` of ``in_features`` values a row."""
        logits: torch.Tensor = self.net(x)
        return logits


def build_model(name: str, input_shape: tuple[int, ...] | torch.Size) -> nn.Module:
    """"lenet" or "mlp" sized for one example of ``input_shape`` (e.g. (1, 8, 8))."""
    if name == "lenet":
        return LeNet(in_channels=input_shape[0], image_size=input_shape[-1])
    if name == "mlp":
        return MLP(in_features=int(torch.Size(input_shape).numel()))
    raise ValueError(f"unknown model {name!r}; expected 'lenet' or 'mlp'")
