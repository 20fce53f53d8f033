"""Helpers for the training tests: tiny closed-form models (importable by worker processes),
replica digests, accuracy, and process checks."""

from __future__ import annotations

import torch
from torch import nn


class Scalar(nn.Module):
    """One weight w; ``linear_loss`` makes its gradient equal to the batch's mean input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


class ScalarFrom(Scalar):
    """Scalar whose constructor needs the starting weight: a file cannot rebuild it alone."""

    def __init__(self, start: float) -> None:
        super().__init__()
        with torch.no_grad():
            self.w.fill_(start)


def linear_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d(loss)/dw = mean(x): with SGD lr=1, one step moves w by -mean(x)."""
    return out.mean()


def scalar_batches(values):
    """One (x, target) batch per value, x = [[value]]: for ``Scalar`` and ``linear_loss``."""
    return [(torch.tensor([[float(v)]]), torch.zeros(1)) for v in values]


class TwoInputs(nn.Module):
    """A multi-input model called as model(image=..., extra=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 10)
        self.b = nn.Linear(3, 10)

    def forward(self, image: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.a(image.flatten(1)) + self.b(extra)


def digest(module: nn.Module) -> str:
    """A hash of every parameter and buffer's bytes: equal digests mean bit-identical replicas."""
    import hashlib

    h = hashlib.sha256()
    for t in [*module.parameters(), *module.buffers()]:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_recording_averaging(frequency: int):
    """An Averaging synchronizer that records replica digests before and after each average."""
    from paraloom.sync.averaging import Averaging

    class RecordingAveraging(Averaging):
        def setup(self, ctx):
            super().setup(ctx)
            self.record = []

        def average(self, ctx):
            before = digest(ctx.model)
            super().average(ctx)
            self.record.append((ctx.step, before, digest(ctx.model)))

        def stats(self):
            return {**super().stats(), "record": self.record}

    return RecordingAveraging(frequency=frequency)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False


def accuracy(model: nn.Module, dataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        return float((model(x).argmax(1) == y).float().mean())


def stuck_on_rank_one(model: nn.Module, batch) -> torch.Tensor:
    """A step_fn that never returns on rank 1 (a hung data or model call)."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


class HangsOnRankOne(nn.Module):
    """A linear model whose forward hangs on rank 1 at its 30th training call, mid-epoch (its
    heartbeat goes on): the parent is then blocked dealing it rounds, its queue full."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        from paraloom import replica_info

        info = replica_info()
        if self.training and info is not None and info.rank == 1:
            self.calls += 1
            if self.calls == 30:
                time.sleep(3600)
        return self.lin(x)


class TwoHeads(nn.Module):
    """Two scalar weights; a batch says which one it trains (a routed, multi-task model)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return (self.a if int(head) == 0 else self.b) * x


def quadratic_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """0.5 * (w*x - t)^2 averaged: the gradient depends on w, so averaging order matters."""
    return 0.5 * ((out - target) ** 2).mean()


class SelfTraining(Scalar):
    """A Lightning-style model: its own ``training_step`` (a quadratic loss, so the gradient
    depends on the weight and unsynchronized replicas drift apart)."""

    def training_step(self, batch) -> torch.Tensor:
        x, target = batch
        return quadratic_loss(self(x), target)


def call_training_step(model: nn.Module, batch) -> torch.Tensor:
    """``step_fn=lambda model, batch: model.training_step(batch)``, importable by workers."""
    return model.training_step(batch)


class SignSGD(torch.optim.Optimizer):
    """A hand-written optimizer whose constructor requires ``lr`` (no default)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def make_weight_reporting(mode: str, **options):
    """A synchronizer of ``mode`` (with ``options``) whose stats() report the replica's weights,
    so a test sees every worker's replica (``stats()["per_worker"]``), not only rank 0's."""
    from paraloom.sync.registry import build_synchronizer

    base = type(build_synchronizer(mode))

    class WeightReporting(base):  # type: ignore[misc, valid-type]
        def setup(self, ctx):
            super().setup(ctx)
            self.model = ctx.model

        def stats(self):
            weights = [p.detach().reshape(-1).tolist() for p in self.model.parameters()]
            return {**super().stats(), "weights": weights}

    return WeightReporting(**options)


class _TensorState(nn.Module):
    """A module whose extra state (``get_extra_state``) is a tensor that is no buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.zeros(2)

    def get_extra_state(self) -> torch.Tensor:
        return self.value.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.value = state.clone()


class Counted(nn.Module):
    """Counts its training forwards in its extra state (a dict); a child's is a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calibration = nn.Linear(8, 3), _TensorState()
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += int(self.training)
        return self.fc(x)

    def get_extra_state(self) -> dict[str, int]:
        return {"steps": self.steps}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


class Opaque(Counted):
    """An extra state no file can hold without pickle (an object)."""

    def get_extra_state(self) -> dict[str, object]:
        return {"steps": self.steps, "clock": object()}
