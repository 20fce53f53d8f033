"""An idle server runs a fast model's request on the event loop; a slow one never blocks it."""

from __future__ import annotations

import threading
import time

import torch
from serving_helpers import Client, closing, infer_json, outputs_of
from torch import nn

from paraloom.serving import create_app


class ThreadNoting(nn.Module):
    """A Linear(4, 3) that notes the thread of each call; ``sleep_s`` makes it slow."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.sleep_s = sleep_s
        self.threads: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.lin(x)


def _threads_of_requests(model: ThreadNoting, count: int) -> tuple[list[str], list[str]]:
    app = create_app(model, name="m", workers=2, example_input=torch.zeros(1, 4))
    replicas = app.state.repository.get("m", None).pool._generation.replicas
    for replica in replicas:
        replica.threads.clear()  # the probe and warm-up ran on this thread, not requests
    client = Client(app)
    try:
        answers = []
        for i in range(count):
            x = torch.full((2, 4), float(i))
            response = client.post("/v2/models/m/infer", json=infer_json(x))
            assert response.status_code == 200, response.text
            answers.append(torch.allclose(outputs_of(response), model.lin(x), atol=1e-6))
        assert all(answers)
        ran = [t for r in replicas for t in r.threads]
    finally:
        client.close()
        closing(app)
    return ran, [threading.current_thread().name]  # the Client's loop runs on this thread


def test_an_idle_server_answers_a_fast_model_on_the_event_loop() -> None:
    ran, (loop_thread,) = _threads_of_requests(ThreadNoting(), 5)
    # The first request of its shape runs on a worker: no cost is known before it.
    assert ran.count(loop_thread) == 4 and len(ran) == 5


def test_a_slow_model_never_runs_on_the_event_loop() -> None:
    ran, (loop_thread,) = _threads_of_requests(ThreadNoting(sleep_s=0.002), 4)
    assert loop_thread not in ran and len(ran) == 4
