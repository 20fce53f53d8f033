"""Test helpers: a gate that holds forward passes, an in-process client, request builders."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import torch
from starlette.applications import Starlette
from torch import nn

from paraloom.models import LeNet

WAIT_S = 30.0  # the bound on every wait in these tests; a healthy run never gets near it


class Gate:
    """Holds forward passes while closed; deep-copies as itself so every replica shares it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        self._open.set()

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:
        return self

    def close(self) -> None:
        self.entered.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        self.entered.set()
        if not self._open.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")


class GatedLeNet(nn.Module):
    """LeNet whose forward waits at a gate: lets a test hold a worker busy."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = LeNet(image_size=8)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.pass_through()
        return self.net(x)


class Client:
    """A synchronous face over httpx's ASGI transport: requests go straight into the app."""

    def __init__(self, app: Starlette) -> None:
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://test", timeout=WAIT_S)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, WAIT_S))

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.http.request(method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def gather(self, *calls: tuple[str, str, dict[str, Any]]) -> list[httpx.Response]:
        """Send requests concurrently and return their responses in order."""
        async def all_of() -> list[httpx.Response]:
            return list(await asyncio.gather(*(self.http.request(m, u, **kw)
                                               for m, u, kw in calls)))
        return self.run(all_of())

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


def infer_json(x: torch.Tensor, name: str = "input", **extra: Any) -> dict[str, Any]:
    """A v2 JSON inference request for one FP32 input."""
    return {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                        "data": x.flatten().tolist()}], **extra}


def outputs_of(response: httpx.Response, name: str = "output") -> torch.Tensor:
    """A JSON response's output tensor."""
    (out,) = [o for o in response.json()["outputs"] if o["name"] == name]
    return torch.tensor(out["data"]).reshape(out["shape"])


def expected(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


def closing(app: Starlette) -> None:
    """Close the pools an app built (the lifespan would, under a real server)."""
    for served in app.state.repository.models().values():
        if served.owns_pool:
            served.pool.close(drain=False, timeout=WAIT_S)
