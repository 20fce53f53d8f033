"""ParallelWrapper's options: the group objects, the flat keywords mapped onto them, sharing=."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from paraloom import (
    FaultTolerance,
    FixedThreshold,
    LoopOptions,
    ParallelWrapper,
    QuantileThreshold,
    SharingRecipe,
    StepOptions,
)
from paraloom.sync import Averaging, SharedGradients
from paraloom.sync.registry import build_synchronizer
from paraloom.training.options import WrapperKeywords

pytestmark = pytest.mark.timeout(120)


def _wrapper(**options) -> ParallelWrapper:
    model = nn.Linear(4, 2)
    return ParallelWrapper(model, loss_fn=nn.MSELoss(),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2,
                           **options)


def test_the_constructor_stays_small() -> None:
    named = [p for p in inspect.signature(ParallelWrapper.__init__).parameters.values()
             if p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 14  # self included; the rest are keywords mapped onto the groups


def test_defaults_fill_every_group() -> None:
    w = _wrapper()
    assert (w.steps, w.faults, w.loop) == (StepOptions(), FaultTolerance(), LoopOptions())
    assert w.faults.heartbeat_timeout == 2.0 and w.loop.prefetch_buffer == 16
    assert isinstance(w.synchronizer, Averaging) and w.clipping is None


def test_flat_keywords_land_in_their_groups() -> None:
    schedule = lambda opt: StepLR(opt, step_size=10)  # noqa: E731
    w = _wrapper(max_failures=2, timeout=60, heartbeat_timeout=None, step_timeout=5.0,
                 prefetch_buffer=4, progress=False, report_score_after_averaging=True,
                 lr_scheduler=schedule, gradient_clip_val=1.5, gradient_clip_algorithm="value",
                 averaging_frequency=3)
    assert w.faults == FaultTolerance(max_failures=2, timeout=60, heartbeat_timeout=None,
                                      step_timeout=5.0)
    assert w.loop == LoopOptions(prefetch_buffer=4, progress=False,
                                 report_score_after_averaging=True)
    assert w.steps == StepOptions(schedule, 1.5, "value")
    assert (w.clipping.value, w.clipping.algorithm) == (1.5, "value")
    assert w.synchronizer.frequency == 3


def test_a_group_object_and_a_keyword_of_it_combine_and_the_keyword_wins() -> None:
    w = _wrapper(faults=FaultTolerance(max_failures=1, timeout=30), max_failures=3,
                 loop=LoopOptions(progress=False))
    assert w.faults == FaultTolerance(max_failures=3, timeout=30)
    assert w.loop.progress is False


def test_bad_groups_and_values_are_refused_with_the_option_named() -> None:
    with pytest.raises(TypeError, match=r"faults=.*FaultTolerance\(\.\.\.\)"):
        _wrapper(faults={"max_failures": 2})
    with pytest.raises(ValueError, match="timeout=0"):
        FaultTolerance(timeout=0)
    with pytest.raises(ValueError, match="heartbeat_timeout=-1"):
        _wrapper(heartbeat_timeout=-1)
    with pytest.raises(ValueError, match="max_failures=-1"):
        FaultTolerance(max_failures=-1)
    with pytest.raises(ValueError, match="prefetch_buffer=-1"):
        LoopOptions(prefetch_buffer=-1)
    with pytest.raises(ValueError, match="gradient_clip_val=0"):
        StepOptions(gradient_clip_val=0)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='l1'"):
        _wrapper(gradient_clip_algorithm="l1")
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="lr_scheduler=.*function"):
        StepOptions(lr_scheduler=StepLR(opt, step_size=1))
    with pytest.raises(TypeError, match="epochs= is not a ParallelWrapper option"):
        _wrapper(epochs=3)
    with pytest.raises(TypeError, match="no_such_option"):
        _wrapper(no_such_option=1)


@pytest.mark.parametrize(("mode", "option", "owner"), [
    ("allreduce", {"recipe": "dgc"}, "shared_gradients"),
    ("averaging", {"comm_hook": "fp16"}, "allreduce"),
    ("diloco", {"threshold_algorithm": FixedThreshold(1e-3)}, "shared_gradients"),
])
def test_an_option_of_another_mode_is_refused_naming_that_mode(mode, option, owner) -> None:
    """allreduce passed recipe= on to DDP's keywords and called it an unknown DDP option;
    the other modes said it was no option at all."""
    with pytest.raises(TypeError, match=rf"{next(iter(option))} is an option of "
                                        rf"training_mode='{owner}'.*training_mode='{mode}' takes"):
        _wrapper(training_mode=mode, **option)


def test_a_ddp_keyword_another_mode_also_takes_still_goes_to_ddp() -> None:
    """shared_gradients takes broadcast_buffers= too; under allreduce it is DDP's own."""
    synchronizer = build_synchronizer("allreduce", broadcast_buffers=False)
    assert synchronizer.ddp_options == {"broadcast_buffers": False}


@pytest.mark.parametrize(("options", "error", "said"), [
    ({"timeout": "3"}, TypeError, "timeout='3'; expected seconds > 0 as a number"),
    ({"timeout": None}, TypeError, "timeout=None"),
    ({"step_timeout": [1]}, TypeError, r"step_timeout=\[1\].*or None"),
    ({"prefetch_buffer": 2.5}, TypeError, "prefetch_buffer=2.5; expected an int"),
    ({"progress": "no"}, TypeError, "progress='no'; expected True or False"),
    ({"listeners": 3}, TypeError, "listeners=3; expected a list"),
    ({"loss_fn": 3}, TypeError, "loss_fn=3 is not callable"),
    ({"loss_fn": nn.CrossEntropyLoss}, TypeError, r"a class, not a loss.*CrossEntropyLoss\(\)"),
    ({"step_fn": lambda model, batch: model(batch).sum()}, ValueError, "not both"),
    ({"average_updaters": "no"}, TypeError, "average_updaters='no'"),
    ({"training_mode": "allreduce", "bucket_cap_mb": "x"}, ValueError, "bucket_cap_mb='x'"),
    ({"training_mode": "allreduce", "find_unused_parameters": "yes"}, TypeError,
     "find_unused_parameters=.yes.; expected True or False"),
    ({"compile": {"modee": "default"}}, TypeError, r"torch.compile keyword\(s\) \['modee'\]"),
])
def test_values_of_the_wrong_type_are_refused_with_the_option_named(options, error,
                                                                      said) -> None:
    model = nn.Linear(4, 2)
    keywords = {"loss_fn": nn.MSELoss(), "workers": 2, **options}
    with pytest.raises(error, match=said):
        ParallelWrapper(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        **keywords)


def test_one_listener_may_be_given_alone() -> None:
    heard: list[int] = []
    assert len(_wrapper(listeners=lambda i, e, loss: heard.append(i)).listeners) == 1


def test_every_documented_keyword_is_taken() -> None:
    """Each keyword of WrapperKeywords, at its default, in a mode that takes it (DDP's own
    keywords go to "allreduce", which passes them to DistributedDataParallel at setup)."""
    sharing = {"recipe", "threshold_algorithm", "residual_post_processor", "combine",
               "momentum_masking", "gradients_at", "encoding", "broadcast_buffers", "overlap"}
    averaging = {"averaging_frequency", "average_updaters"} | {
        f.name for group in (StepOptions, FaultTolerance, LoopOptions)
        for f in dataclasses.fields(group)}
    defaults = {"recipe": "dgc", "encoding": "auto", "broadcast_buffers": True,
                "averaging_frequency": 1, "average_updaters": True, "max_failures": 0,
                "timeout": 300.0, "heartbeat_timeout": 2.0, "spares": 1, "prefetch_buffer": 16,
                "progress": True, "report_score_after_averaging": False,
                "gradient_clip_algorithm": "norm", "accumulate": 1, "compile": False,
                "find_unused_parameters": False,
                "gradient_as_bucket_view": False, "static_graph": False}
    for key in WrapperKeywords.__annotations__:
        mode = "shared_gradients" if key in sharing else \
            "averaging" if key in averaging else "allreduce"
        _wrapper(training_mode=mode, **{key: defaults.get(key)})


def test_sharing_takes_a_recipe_and_implies_its_mode() -> None:
    recipe = SharingRecipe(threshold_algorithm=QuantileThreshold(1 / 100, exact_count=True),
                           combine="sum")
    w = _wrapper(sharing=recipe)
    assert isinstance(w.synchronizer, SharedGradients) and w.synchronizer.recipe is recipe
    assert _wrapper(sharing=recipe, training_mode="shared_gradients").synchronizer.combine == \
        "sum"
    keywords = _wrapper(training_mode="shared_gradients", combine="sum",
                        threshold_algorithm=QuantileThreshold(1 / 100, exact_count=True))
    assert keywords.synchronizer.config() == w.synchronizer.config()
    assert keywords.fingerprint() == w.fingerprint()  # a checkpoint of one resumes the other
    with pytest.raises(TypeError, match="sharing= configures training_mode='shared_gradients'"):
        _wrapper(sharing=recipe, training_mode="allreduce")
    with pytest.raises(TypeError, match="recipe= and sharing="):
        _wrapper(sharing=recipe, recipe="dl4j")
    with pytest.raises(TypeError, match=r"\['combine'\].*inside it"):
        _wrapper(sharing=recipe, combine="mean")
    with pytest.raises(TypeError, match="expected a SharingRecipe"):
        _wrapper(sharing="dgc")


def _train(**options) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(6)]
    w = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        workers=1, progress=False, **options)
    w.fit(data, epochs=2)
    return [p.detach().clone() for p in model.parameters()]


def test_the_typed_and_the_keyword_forms_train_the_same_model() -> None:
    typed = _train(sharing=SharingRecipe(preset="dl4j", gradients_at="local"),
                   steps=StepOptions(gradient_clip_val=0.5))
    flat = _train(training_mode="shared_gradients", recipe="dl4j", gradients_at="local",
                  gradient_clip_val=0.5)
    assert all(torch.equal(a, b) for a, b in zip(typed, flat, strict=True))
    # With one worker, where the gradients are taken is an option that changes the result.
    other = _train(training_mode="shared_gradients", recipe="dl4j", gradient_clip_val=0.5)
    assert not all(torch.equal(a, b) for a, b in zip(typed, other, strict=True))


def test_a_model_with_nothing_to_train_is_refused_before_workers_start() -> None:
    wrapper = _wrapper()
    wrapper.model.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        wrapper.fit([(torch.rand(2, 4), torch.rand(2, 2))])
    assert wrapper.worker_pids == []


@pytest.mark.parametrize(("fit", "said"), [
    ({"epochs": True}, "epochs=True; expected an int"),
    ({"epochs": 3, "initial_epoch": True}, "initial_epoch=True"),
    ({"epochs": 3, "initial_epoch": 1, "resume_from": "ckpt.safetensors"},
     "initial_epoch=1 with resume_from=.*one or the other"),
])
def test_fit_refuses_bools_for_counts_and_an_initial_epoch_beside_a_checkpoint(fit,
                                                                               said) -> None:
    wrapper = _wrapper()
    with pytest.raises(ValueError, match=said):
        wrapper.fit([(torch.rand(2, 4), torch.rand(2, 2))], **fit)
    assert wrapper.worker_pids == []


@pytest.mark.parametrize("value", [True, 1.0])
def test_an_averaging_option_equal_to_its_default_in_another_type_is_refused(value) -> None:
    """True == 1 == 1.0: allreduce took averaging_frequency=True as the default and ignored
    it, where averaging refuses it."""
    with pytest.raises(TypeError, match="applies to training_mode='averaging' only"):
        _wrapper(training_mode="allreduce", averaging_frequency=value)


def test_spares_without_max_failures_are_warned_about_at_the_callers_line() -> None:
    """Given as a keyword, the warning named dataclasses.py (``replace`` ran the check), and
    the default filter then hid it for every later line of the user's."""
    with pytest.warns(UserWarning, match="spares=5 with max_failures=0") as caught:
        _wrapper(spares=5)
    assert caught[0].filename == __file__
