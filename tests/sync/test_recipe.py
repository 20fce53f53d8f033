"""SharingRecipe: every option of shared gradients in one validated value."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from paraloom.sync import (
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    ResidualClipping,
    ResidualPostProcessor,
    SharedGradients,
    SharingRecipe,
    StepContext,
)
from paraloom.sync.encoding import Format


def test_presets_resolve_every_option() -> None:
    dgc = SharingRecipe()
    assert isinstance(dgc.threshold_algorithm, QuantileThreshold)
    assert dgc.threshold_algorithm.density == 1 / 160 and dgc.threshold_algorithm.exact_count
    assert dgc.residual_post_processor.config() == {"type": "ResidualClipping", "ratio": 2.0,
                                                    "frequency": 1}
    assert (dgc.combine, dgc.gradients_at, dgc.overlap, dgc.momentum_masking) == \
        ("mean", "local", True, False)
    assert dgc.sparse_format() == Format.GAP16 and dgc.capacity(1600) == 5
    # exact counts past the bitmap's size are always bitmaps: room for a bitmap, not for the
    # gap16 message never sent (17,411 elements at density 0.9 were padded to 7x the bitmap)
    dense = SharingRecipe(threshold_algorithm=QuantileThreshold(0.9, exact_count=True))
    assert dense.capacity(17_411) == -(-17_411 // 16)
    assert SharingRecipe(threshold_algorithm=QuantileThreshold(0.1, exact_count=True)
                         ).capacity(16_000) == 1000  # either format: the bitmap is the larger
    dl4j = SharingRecipe("dl4j")
    assert isinstance(dl4j.threshold_algorithm, AdaptiveThreshold)
    assert (dl4j.residual_post_processor, dl4j.combine, dl4j.gradients_at, dl4j.overlap) == \
        (None, "sum", "shared", False)
    assert dl4j.sparse_format() == Format.THRESHOLD and dl4j.capacity(1600) is None
    assert dl4j.update_scale(4) == 1.0 and dgc.update_scale(4) == 0.25


def test_explicit_options_win_and_the_recipe_reads_back_complete() -> None:
    recipe = SharingRecipe("dl4j", FixedThreshold(0.5), ResidualClipping(5.0, 5),
                           combine="mean", gradients_at="local", encoding="bitmap")
    assert recipe.overlap is False  # asked for nothing: dl4j's preset does not overlap
    assert recipe.capacity(1600) == 100 and recipe.forced_format() == Format.BITMAP
    assert "combine='mean'" in repr(recipe) and "FixedThreshold" in repr(recipe)
    assert SharingRecipe(residual_post_processor=ResidualPostProcessor()).config()[
        "residual_post_processor"] == {"type": "ResidualPostProcessor"}
    assert dataclasses.replace(recipe, combine="sum").combine == "sum"
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.combine = "sum"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(recipe)).config() == recipe.config()


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"preset": "strom"}, ValueError, "'dgc'.*'dl4j'"),
    ({"threshold_algorithm": 1e-3}, TypeError, "threshold_algorithm=0.001"),
    ({"residual_post_processor": "clip"}, TypeError, "residual_post_processor='clip'"),
    ({"combine": "avg"}, ValueError, "combine='avg'"),
    ({"gradients_at": "global"}, ValueError, "gradients_at='global'"),
    ({"encoding": "dense"}, ValueError, "encoding='dense'"),
    ({"overlap": True, "gradients_at": "shared"}, ValueError, "overlap=True with gradients_at"),
    ({"threshold_algorithm": FixedThreshold(1e-3), "overlap": True}, ValueError,
     "expected messages of one size"),  # it was refused in the workers only
    ({"momentum_masking": "False"}, TypeError, "momentum_masking='False'"),  # bool() said True
    ({"broadcast_buffers": "no"}, TypeError, "broadcast_buffers='no'"),
    ({"overlap": "no"}, TypeError, "overlap='no'"),
])
def test_bad_options_are_refused_when_the_recipe_is_built(options, error, match) -> None:
    with pytest.raises(error, match=match):
        SharingRecipe(**options)


def test_the_keyword_form_builds_the_same_recipe() -> None:
    typed = SharedGradients(recipe=SharingRecipe("dl4j", FixedThreshold(1e-3), combine="mean"))
    flat = SharedGradients(FixedThreshold(1e-3), recipe="dl4j", combine="mean")
    assert typed.config() == flat.config()
    assert (typed.combine, typed.gradients_at, typed.overlap) == ("mean", "shared", False)
    with pytest.raises(TypeError, match=r"\['combine', 'overlap'\].*SharingRecipe\(combine="):
        SharedGradients(recipe=SharingRecipe(), combine="sum", overlap=False)


def test_each_synchronizer_steps_its_own_threshold_and_the_recipe_stays_as_built() -> None:
    recipe = SharingRecipe(threshold_algorithm=AdaptiveThreshold(initial=1e-3))
    first, second = SharedGradients(recipe=recipe), SharedGradients(recipe=recipe)
    assert first.threshold_algorithm is not second.threshold_algorithm
    assert first.threshold_algorithm is not recipe.threshold_algorithm
    model = nn.Linear(64, 1, bias=False)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    first.setup(ctx)
    for _ in range(3):  # nothing reaches tau: AdaptiveThreshold lowers it every step
        first.before_step(ctx)
        model.weight.grad = torch.full_like(model.weight, 1e-6)
        first.after_backward(ctx)
        ctx.optimizer.step()
        first.after_step(ctx)
    assert first.threshold_algorithm.tau < 1e-3
    assert recipe.threshold_algorithm.tau == second.threshold_algorithm.tau == 1e-3


def test_a_threshold_too_small_for_the_residual_is_warned_about_once() -> None:
    """FixedThreshold(1e-12) on updates of 1e-2: no element could be sent exactly, and the
    fit trained nothing, silently."""
    import warnings

    from paraloom.sync.sharing.encoder import MessageEncoder

    residual = torch.full((64,), 1e-2)
    fine = MessageEncoder(SharingRecipe("dl4j", FixedThreshold(1e-3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine.encode(residual)
    tiny = MessageEncoder(SharingRecipe("dl4j", FixedThreshold(1e-12)))
    with pytest.warns(RuntimeWarning, match="never sent and those parameters do not train"):
        msg, found, _ = tiny.encode(residual)
    assert found.indices.numel() == 0  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny.encode(residual)  # once


@pytest.mark.parametrize("gradients_at", ["local", "shared"])
def test_the_unsent_updates_come_back_once_the_fit_ends(gradients_at: str) -> None:
    """fit() returns the local view (the shared parameters plus the residual, "local"), or the
    shared parameters ("shared"); flush_residuals (Spark's shared master) writes the residual
    into the parameters either way and empties it."""
    model = nn.Linear(64, 1, bias=False)
    sync = SharedGradients(recipe=SharingRecipe("dl4j", FixedThreshold(1e-2), combine="mean",
                                                gradients_at=gradients_at))
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    initial = model.weight.detach().clone()
    sync.setup(ctx)
    grads = torch.linspace(-2e-2, 2e-2, 64).view(1, 64)  # half reach tau in two steps
    for _ in range(3):
        sync.before_step(ctx)
        model.weight.grad = grads.clone()
        sync.after_backward(ctx)
        ctx.optimizer.step()
        sync.after_step(ctx)
    sync.finish(ctx)
    shared = model.weight.detach().clone()
    residual = sync._replica.residual.view(1, 64).clone()  # type: ignore[union-attr]
    assert residual.abs().max() > 0 and not torch.equal(shared, initial)
    # Three steps of lr * grad in all: sent or unsent, nothing is lost.
    torch.testing.assert_close(shared + residual, initial - 3 * grads)
    returned = sync.returned_parameters()
    if gradients_at == "local":
        torch.testing.assert_close(returned[id(model.weight)], shared + residual)
    else:
        assert returned == {}
    sync.flush_residuals(ctx)
    torch.testing.assert_close(model.weight.detach(), shared + residual)
    assert sync._replica.residual.abs().max() == 0  # type: ignore[union-attr]
    assert sync.returned_parameters() == {}
