"""Schedules, buffers, optimizer factories and parameters the other tests' models do not have."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("schedule", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=16),
])
def test_each_fit_starts_a_schedule_that_steps_from_the_current_lr_afresh(schedule):
    """StepLR and CosineAnnealingLR step from the lr they find: the second fit started from the
    first's end (0.025, then 0.00625 ... for StepLR)."""
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=1,
                         training_mode="allreduce", lr_scheduler=schedule, progress=False) as w:
        ends = []
        for _ in range(3):
            w.fit(_batches())
            ends.append(opt.param_groups[0]["lr"])
    assert ends[0] < 0.1 and ends == [ends[0]] * 3


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.register_buffer("scale", torch.ones(16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)) * self.scale)


def test_bf16_true_keeps_a_non_persistent_buffer_in_bf16():
    """The float32 copy sent from the parent replaced the replica's bf16 buffer, and the next
    bf16 Linear failed on a float32 input."""
    torch.manual_seed(0)
    model = _Scaled()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         precision="bf16-true") as w:
        stats = w.fit(_batches())
    assert stats["batches"] == 8 and model.scale.dtype == torch.float32


def test_an_optimizer_factory_over_the_wrapped_models_parameters_is_refused():
    """lambda p: SGD(model.parameters()) trained nothing, silently: the replica's parameters
    are copies."""
    model = nn.Linear(8, 3)
    with pytest.raises(ValueError, match="not the parameters it was given"):
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                        optimizer=lambda p: torch.optim.SGD(model.parameters(), lr=0.1)
                        ).fit(_batches())


class _Prompted(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 3)
        self.extra_tokens = nn.Parameter(torch.zeros(0, 16))  # prompt tuning with no tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.extra_tokens.sum()


def test_powersgd_refuses_a_parameter_without_elements_before_workers_start():
    """It trained through the warm-up and failed at the first compressed step (1,000 steps
    in, by default)."""
    model = _Prompted()
    with pytest.raises(ValueError, match="'extra_tokens' has no elements"):
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        training_mode="allreduce", comm_hook="powersgd").fit(_batches())


class _WithLock(nn.Module):
    """A model holding a lock; ``drop_lock`` leaves it out of its pickled state."""

    def __init__(self, drop_lock: bool = False) -> None:
        super().__init__()
        import threading
        self.l = nn.Linear(8, 3)
        self.lock = threading.Lock()
        self.drop_lock = drop_lock

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        if self.drop_lock:
            state.pop("lock", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_model_holding_a_lock_is_refused_with_the_fix_and_the_fix_trains(workers):
    """workers=1 copies the model too: it failed with copy's bare TypeError, and the message
    for workers=2 advised workers=1."""
    from paraloom import NotPicklableError

    model = _WithLock()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=workers, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        with pytest.raises(NotPicklableError, match="lock.*__getstate__") as e:
            w.fit(_batches())
    assert "workers=1 trains" not in str(e.value)
    model = _WithLock(drop_lock=True)
    before = model.l.weight.detach().clone()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=workers, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        w.fit(_batches())
    assert not torch.equal(model.l.weight, before)


def test_a_loss_per_output_pairs_dict_outputs_and_dict_targets_by_key():
    from paraloom.forward import compute_loss

    outputs = {"cls": torch.randn(4, 3), "reg": torch.randn(4, 1)}
    targets = {"reg": torch.randn(4, 1), "cls": torch.tensor([0, 1, 2, 0])}  # another order
    losses = [nn.CrossEntropyLoss(), nn.MSELoss()]
    expected = losses[0](outputs["cls"], targets["cls"]) + losses[1](outputs["reg"],
                                                                      targets["reg"])
    torch.testing.assert_close(compute_loss(losses, outputs, targets), expected)
    torch.testing.assert_close(compute_loss(losses, outputs, (targets["cls"], targets["reg"])),
                               expected)
    with pytest.raises(ValueError, match="other keys"):
        compute_loss(losses, outputs, {"cls": targets["cls"], "other": targets["reg"]})


@pytest.mark.timeout(180)
def test_a_modules_extra_state_trains_checkpoints_resumes_and_saves(tmp_path):
    """get_extra_state()'s values (a dict, a tensor) failed fit(), CheckpointListener and
    paraloom.save (AttributeError: 'dict' object has no attribute 'detach')."""
    from training_helpers import Counted

    import paraloom
    from paraloom import TrainingCheckpoint
    from paraloom.listeners import CheckpointListener

    def run(model: Counted, listeners=(), resume_from=None) -> None:
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             listeners=list(listeners)) as w:
            w.fit(_batches(), resume_from=resume_from)

    torch.manual_seed(0)
    model = Counted()
    model.calibration.value = torch.tensor([1.5, -2.0])
    start = copy.deepcopy(model)
    listener = CheckpointListener(tmp_path / "ck", every_n_iterations=2, every_n_epochs=None)
    run(model, [listener])
    assert model.steps == 4  # rank 0's: 4 of the 8 batches
    assert torch.equal(model.calibration.value, torch.tensor([1.5, -2.0]))
    halfway = TrainingCheckpoint.load(listener.written[0]).model_state()
    assert halfway["_extra_state"] == {"steps": 2}
    assert torch.equal(halfway["calibration._extra_state"], torch.tensor([1.5, -2.0]))

    resumed = copy.deepcopy(start)
    run(resumed, resume_from=listener.written[0])
    assert resumed.steps == 4 and torch.equal(resumed.fc.weight, model.fc.weight)

    paraloom.save(model, tmp_path / "m.safetensors")
    loaded = paraloom.load(tmp_path / "m.safetensors", factory=Counted)
    assert loaded.steps == 4 and torch.equal(loaded.calibration.value, model.calibration.value)


def test_an_extra_state_no_file_can_hold_is_refused_naming_the_module_and_the_fix(tmp_path):
    from training_helpers import Opaque

    import paraloom
    from paraloom.listeners import CheckpointListener

    model = Opaque()
    fix = "extra state of the model.*neither a tensor nor JSON.*from get_extra_state"
    with pytest.raises(TypeError, match=fix):
        paraloom.save(model, tmp_path / "m.safetensors", kwargs={})
    assert not (tmp_path / "m.safetensors").exists()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         listeners=[CheckpointListener(tmp_path / "ck")]) as w:
        with pytest.raises(TypeError, match=fix):
            w.fit(_batches())  # before training, not at the first checkpoint
    assert model.steps == 0
