from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import DistPool


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistPool]:
    """Two CPU processes in one gloo group, shared by the multi-process tests."""
    workers = DistPool(tmp_path_factory.mktemp("dist"), world_size=2)
    try:
        yield workers
    finally:
        workers.close()
