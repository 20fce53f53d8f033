"""Shared fixtures: a seeded LeNet, an app over a real ParallelInference pool, a client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from serving_helpers import Client, closing
from starlette.applications import Starlette
from torch import nn

from paraloom.models import LeNet
from paraloom.serving import create_app


@pytest.fixture()
def lenet() -> nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=8).eval()


@pytest.fixture()
def app(lenet: nn.Module) -> Iterator[Starlette]:
    app = create_app(lenet, name="lenet", workers=2, batch_limit=32, queue_limit=64,
                     shared_memory=True)  # in process, no server settles "auto"
    yield app
    closing(app)


@pytest.fixture()
def client(app: Starlette) -> Iterator[Client]:
    c = Client(app)
    yield c
    c.close()
