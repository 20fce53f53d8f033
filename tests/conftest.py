"""Shared fixtures: small real data sets, and a check that no test leaks worker processes."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

from paraloom.datasets import digits


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests run where torch sees a GPU and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digits_train():
    return digits("train")


@pytest.fixture(scope="session")
def digits_test():
    return digits("test")


@pytest.fixture
def digits_loader(digits_train):
    torch.manual_seed(0)
    return DataLoader(digits_train, batch_size=32, shuffle=True)


@pytest.fixture(autouse=True)
def _cpu_threads():
    """Keep each test's own torch threads modest: the machine has 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)
