"""New versions through POST /v2/repository/models/{name}/load, without failing requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from serving_helpers import WAIT_S, Client, Gate, GatedLeNet, closing, infer_json, outputs_of
from starlette.applications import Starlette
from torch import nn

import paraloom
from paraloom.inference.parallel import ParallelInference
from paraloom.models import LeNet
from paraloom.serving import TensorSpec, create_app

URL = "/v2/models/lenet/infer"
LOAD = "/v2/repository/models/lenet/load"


def saved_lenet(path: Path, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = LeNet(image_size=8).eval()
    paraloom.save(model, path)
    return model


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, object]:
    models = tmp_path / "models"
    models.mkdir()
    return {"dir": models, "v1": saved_lenet(models / "v1.safetensors", 1),
            "v2": saved_lenet(models / "v2.safetensors", 2)}


@pytest.fixture()
def served(files: dict) -> Iterator[tuple[Starlette, Client]]:
    first = paraloom.load(files["dir"] / "v1.safetensors")
    app = create_app(first, name="lenet", workers=2, model_file=str(files["dir"] /
                                                                    "v1.safetensors"),
                     model_dir=str(files["dir"]))
    client = Client(app)
    yield app, client
    client.close()
    closing(app)


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_a_load_of_the_weights_served_keeps_the_version(served: tuple) -> None:
    """A Triton client pinned to version "1" got 404 after a reload of the unchanged file
    (Triton's version is its folder's; here an unchanged file moved it to "2")."""
    _, client = served
    x = torch.rand(2, 1, 8, 8)
    assert client.post(LOAD).json()["version"] == "1"  # the file it was started from
    assert client.post(LOAD, json={"parameters": {"path": "v1.safetensors"}}).json() == {
        "name": "lenet", "version": "1"}
    assert client.post("/v2/models/lenet/versions/1/infer", json=infer_json(x)).status_code == 200
    moved = client.post(LOAD, json={"parameters": {"path": "v2.safetensors"}})
    assert moved.json()["version"] == "2"
    assert client.post(LOAD, json={"parameters": {"path": "v2.safetensors"}}).json()[
        "version"] == "2"


def test_load_swaps_the_weights_and_the_version(served: tuple, files: dict) -> None:
    app, client = served
    x = torch.rand(2, 1, 8, 8)
    r = client.post(LOAD, json={"parameters": {"path": "v2.safetensors"}})
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "lenet", "version": "2"}
    after = client.post(URL, json=infer_json(x))
    assert after.json()["model_version"] == "2"
    torch.testing.assert_close(outputs_of(after), output(files["v2"], x))
    assert client.get("/v2/models/lenet").json()["versions"] == ["2"]
    assert client.post("/v2/models/lenet/versions/1/infer", json=infer_json(x)).status_code == 404
    assert client.post("/v2/models/lenet/versions/2/infer", json=infer_json(x)).status_code == 200
    # An empty load re-reads the file the server was started from.
    assert client.post(LOAD).json()["version"] == "3"
    torch.testing.assert_close(outputs_of(client.post(URL, json=infer_json(x))),
                               output(files["v1"], x))


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{", 400, "not valid JSON"),
    (b'{"parameters": [1]}', 400, 'must be {"parameters"'),
    (b'{"parameters": {"path": "../v2.safetensors"}}', 403, "outside the models directory"),
    (b'{"parameters": {"file:1/model.safetensors": "AAAA"}}', 403, "never takes model files"),
    (b'{"parameters": {"path": "big.safetensors"}}', 400, "different architecture"),
])
def test_refused_loads_keep_the_old_version(served: tuple, files: dict, body: bytes,
                                            status: int, fragment: str) -> None:
    paraloom.save(LeNet(image_size=28), files["dir"] / "big.safetensors")
    app, client = served
    r = client.post(LOAD, content=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert app.state.served.version == "1"
    x = torch.rand(1, 1, 8, 8)
    torch.testing.assert_close(outputs_of(client.post(URL, json=infer_json(x))),
                               output(files["v1"], x))


class WorkerGate(Gate):
    """A gate that holds only the pool's worker threads: warming a new version passes it."""

    def pass_through(self) -> None:
        if threading.current_thread().name.startswith("paraloom-inference"):
            super().pass_through()


def test_requests_in_flight_during_a_swap_all_succeed(tmp_path: Path) -> None:
    gate = WorkerGate()
    torch.manual_seed(1)
    v1 = GatedLeNet(gate).eval()
    torch.manual_seed(2)
    v2 = GatedLeNet(gate).eval()
    v2.net = LeNet(image_size=8).eval()
    paraloom.save(v2, tmp_path / "v2.safetensors")
    app = create_app(v1, name="lenet", workers=1, batch_limit=4, queue_limit=64,
                     model_dir=str(tmp_path), inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    client = Client(app)
    xs = [torch.rand(1, 1, 8, 8) for _ in range(12)]

    async def scenario() -> tuple[list, object]:
        gate.close()
        early = [asyncio.create_task(client.http.post(URL, json=infer_json(x))) for x in xs[:6]]
        assert await asyncio.to_thread(gate.entered.wait, WAIT_S)  # a batch is mid-forward
        # Version 2 warms on the signature's probe input off the worker threads, so the swap
        # completes while the first batch is held and the rest wait in the queue.
        loaded = await client.http.post(LOAD, json={"parameters": {"path": "v2.safetensors"}})
        late = [asyncio.create_task(client.http.post(URL, json=infer_json(x))) for x in xs[6:]]
        gate.open()
        return await asyncio.gather(*early, *late), loaded

    try:
        responses, loaded = client.run(scenario())
        assert loaded.status_code == 200 and loaded.json()["version"] == "2"
        models = {"1": v1, "2": v2}
        for x, r in zip(xs, responses, strict=True):
            assert r.status_code == 200, r.text
            version = r.json()["model_version"]
            torch.testing.assert_close(outputs_of(r), output(models[version], x))
        assert responses[0].json()["model_version"] == "1"  # it was mid-forward on version 1
        after = client.post(URL, json=infer_json(xs[0]))
        assert after.json()["model_version"] == "2"
    finally:
        gate.open()
        client.close()
        closing(app)


@pytest.mark.parametrize("name", ["v2\x00.safetensors", "a" * 5000 + ".safetensors"])
def test_a_path_the_file_system_refuses_is_400(served: tuple, name: str) -> None:
    app, client = served
    r = client.post(LOAD, json={"parameters": {"path": name}})
    assert r.status_code == 400, r.text
    assert "is not a usable file name" in r.json()["error"]
    assert app.state.served.version == "1"


def test_a_load_after_the_pool_closed_is_503_shutting_down(served: tuple) -> None:
    app, client = served
    app.state.served.pool.close(timeout=WAIT_S)  # closed under the app, as at shutdown
    r = client.post(LOAD, json={"parameters": {"path": "v2.safetensors"}})
    assert r.status_code == 503, r.text
    assert "shutting down" in r.json()["error"] and r.headers["Retry-After"] == "1"


def test_a_load_racing_close_is_503_shutting_down(served: tuple, monkeypatch) -> None:
    app, client = served
    pool = app.state.served.pool

    def update_then_closed(*args: object, **kwargs: object) -> int:
        pool.close(timeout=WAIT_S)  # close() won the race: update_model refuses
        return ParallelInference.update_model(pool, *args, **kwargs)

    monkeypatch.setattr(pool, "update_model", update_then_closed)
    r = client.post(LOAD, json={"parameters": {"path": "v2.safetensors"}})
    assert r.status_code == 503, r.text
    assert "update_model() after close()" in r.json()["error"]
    assert "retry after 1 s" in r.json()["error"]
