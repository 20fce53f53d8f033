"""shared_gradients: bit-identical replicas, nothing lost, idle rounds, errors, state."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from paraloom.sync.base import StepContext
from paraloom.sync.encoding import Format
from paraloom.sync.sharing import SharedGradients
from paraloom.sync.thresholds import (
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    ResidualClipping,
    ResidualPostProcessor,
)

from .replicas import batch, make_model, train

STEPS = 12


def _identical(results: list[dict[str, Any]]) -> None:
    first, *others = results
    for other in others:
        assert other["digests"] == first["digests"], "replicas differ after some step"
        assert other["final"] == first["final"]


def _shared_run(rank: int, world_size: int, **options: Any) -> dict[str, Any]:
    idle = options.pop("idle", None)
    batchnorm = options.pop("batchnorm", False)
    sync = SharedGradients(**options)
    return train(rank, world_size, sync, STEPS, idle=idle, batchnorm=batchnorm)


@pytest.mark.parametrize("options", [
    {"encoding": "auto", "batchnorm": True, "idle": {STEPS - 1: [1]}},
    {"encoding": "threshold", "threshold_algorithm": FixedThreshold(1e-3)},
    {"encoding": "bitmap", "combine": "sum", "idle": {3: [0], 7: [1]}},
    {"residual_post_processor": ResidualClipping(2.0, 2),
     "threshold_algorithm": AdaptiveThreshold(initial=1e-2)},
    {"recipe": "dl4j", "idle": {5: [1]}},
    {"gradients_at": "shared", "momentum_masking": True, "idle": {2: [0]}},
    {"encoding": "gap16", "threshold_algorithm": QuantileThreshold(1 / 160), "idle": {4: [1]}},
    {"threshold_algorithm": QuantileThreshold(1 / 40, exact_count=True), "idle": {6: [0]}},
    {"overlap": True, "batchnorm": True, "idle": {0: [1], 4: [1], STEPS - 1: [0]}},
], ids=["auto-batchnorm-idle", "threshold", "bitmap-sum-idle", "clipping", "dl4j-idle",
         "shared-masked-idle",
        "gap16-idle", "exact-count-one-collective-idle", "overlap-batchnorm-idle"])
def test_replicas_are_bit_identical_after_every_step(pool, options) -> None:
    results = pool.run(_shared_run, **options)
    _identical(results)
    a, b = results
    # The replicas are separate and see different data: their local steps differ.
    assert any(x != y for x, y in zip(a["local"], b["local"], strict=True) if x and y)
    assert a["params"] != a["initial"], "the messages never moved the parameters"
    stats = a["stats"]
    assert stats["bytes_sent"] > 0 and stats["tau"] > 0 and 0 <= stats["sparsity"] <= 1
    assert stats["setup_bytes_sent"] > 0
    assert all(stats[f"seconds_{phase}_per_step"] > 0
               for phase in ("encoding", "exchange", "applying"))


def _exact_count_run(rank: int, world_size: int) -> dict[str, Any]:
    sync = SharedGradients(QuantileThreshold(1 / 40, exact_count=True))
    out = train(rank, world_size, sync, STEPS)
    out["numel"] = sync._replica.residual.numel()
    return out


def test_exact_count_messages_have_one_size_and_go_in_one_collective(pool) -> None:
    results = pool.run(_exact_count_run)
    _identical(results)
    numel = results[0]["numel"]
    count = round(numel / 40)
    for r in results:
        assert r["stats"]["sparsity"] == count / numel  # exactly the count, the largest
        # One all-gather of a 6-word header and ceil(count / 2) gap16 words, every step.
        assert r["bytes_per_step"] == [(6 + -(-count // 2)) * 4] * STEPS


def _conservation_run(rank: int, world_size: int, combine: str,
                      gradients_at: str, overlap: bool = False) -> dict[str, Any]:
    total: list[torch.Tensor] = []
    scale = 1.0 / world_size if combine == "mean" else 1.0

    def on_update(model: nn.Module, before: list[torch.Tensor]) -> None:
        deltas = [(p.detach() - b).reshape(-1) * scale for p, b in zip(model.parameters(),
                                                                        before, strict=True)]
        total.append(torch.cat(deltas))

    threshold = QuantileThreshold(1 / 64, exact_count=True) if overlap else \
        FixedThreshold(2.0 ** -9)
    sync = SharedGradients(threshold, recipe="dl4j", combine=combine, gradients_at=gradients_at,
                           overlap=overlap)
    out = train(rank, world_size, sync, STEPS, on_update=on_update, dtype=torch.float64,
                seed=0)
    out["sum_updates"] = torch.stack(total).sum(0).tolist()
    out["residual"] = sync._replica.residual.tolist()
    return out


@pytest.mark.parametrize(("combine", "gradients_at", "overlap"),
                         [("mean", "shared", False), ("sum", "shared", False),
                          ("mean", "local", False), ("sum", "local", False),
                          ("mean", "local", True)])
def test_applied_steps_plus_residuals_equal_all_updates(pool, combine, gradients_at,
                                                        overlap) -> None:
    """Nothing is lost: the parameters moved by every update except what the residuals hold
    (with the local view too: the optimizer's update is taken from where it stepped; with
    overlap, the last exchange is collected at the end of the fit)."""
    results = pool.run(_conservation_run, combine=combine, gradients_at=gradients_at,
                       overlap=overlap)
    _identical(results)
    def exact(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    moved = exact(results[0]["params"]) - exact(results[0]["initial"])
    updates = sum(exact(r["sum_updates"]) for r in results)
    held = sum(exact(r["residual"]) for r in results)
    assert torch.allclose(moved, updates - held, rtol=0, atol=1e-12)
    assert held.abs().max() > 0  # the residuals really hold something back


def _nonfinite_run(rank: int, world_size: int, overlap: bool) -> str:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = StepContext(model=model, optimizer=optimizer, rank=rank, world_size=world_size)
    sync = SharedGradients(overlap=overlap)
    sync.setup(ctx)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    sync.after_backward(ctx)
    if rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    optimizer.step()
    try:
        sync.after_step(ctx)
        sync.finish(ctx)  # with overlap, the exchange is collected here
    except FloatingPointError as error:
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before,
                                                          strict=True))
        return f"{error} | unchanged={unchanged}"
    return "no error"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_non_finite_update_stops_every_replica_consistently(pool, overlap) -> None:
    results = pool.run(_nonfinite_run, overlap=overlap)
    for text in results:
        assert "replica(s) [1]" in text and "non-finite" in text and "unchanged=True" in text


# -- single process -------------------------------------------------------------------------

def _ctx(model: nn.Module, lr: float = 0.5) -> StepContext:
    return StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def _step(sync: SharedGradients, ctx: StepContext, grad: list[float]) -> None:
    (param,) = ctx.model.parameters()
    param.grad = torch.tensor(grad)
    sync.after_backward(ctx)
    ctx.optimizer.step()
    sync.after_step(ctx)


def test_one_replica_applies_only_its_quantized_update() -> None:
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    tau = 2.0 ** -3
    sync = SharedGradients(FixedThreshold(tau), encoding="threshold")
    sync.setup(ctx)
    _step(sync, ctx, [[-0.3, 0.05, 0.2, -0.1]])  # update = -grad
    assert model.weight.tolist() == [[tau, 0.0, -tau, 0.0]]
    assert sync._replica.residual.tolist() == pytest.approx([0.3 - tau, -0.05, -0.2 + tau, 0.1])
    assert sync.stats()["sparsity"] == 0.5 and sync.stats()["bytes_sent"] == 0


def test_bitmap_half_steps_alternate_sides_between_messages() -> None:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    tau = 2.0 ** -2
    sync = SharedGradients(FixedThreshold(tau), encoding="bitmap", overlap=False)
    sync.setup(ctx)
    _step(sync, ctx, [[-0.75 * tau, 0.75 * tau]])
    _step(sync, ctx, [[0.0, 0.0]])
    # One message sent +tau/2, the next -tau/2: both sides drained alike (DL4J: only -tau/2).
    assert model.weight.tolist() == [[tau / 2, -tau / 2]]
    assert sync.stats()["bitmap_fraction"] == 1.0


def test_hooks_out_of_order_and_bad_options_are_explained() -> None:
    sync = SharedGradients()
    with pytest.raises(RuntimeError, match="before setup"):
        sync.after_backward(_ctx(nn.Linear(2, 1)))
    ctx = _ctx(nn.Linear(2, 1))
    sync.setup(ctx)
    with pytest.raises(RuntimeError, match="after_backward"):
        sync.after_step(ctx)
    frozen = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        SharedGradients().setup(StepContext(model=frozen, optimizer=None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FixedThreshold"):
        SharedGradients(threshold_algorithm=1e-3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ResidualClipping"):
        SharedGradients(residual_post_processor="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="combine="):
        SharedGradients(combine="avg")
    with pytest.raises(ValueError, match="encoding="):
        SharedGradients(encoding="dense")
    with pytest.raises(ValueError, match="'dgc'.*'dl4j'"):
        SharedGradients(recipe="strom")


def test_recipes_set_the_defaults_and_explicit_options_win() -> None:
    dgc, dl4j = SharedGradients(), SharedGradients(recipe="dl4j")
    assert isinstance(dgc.threshold_algorithm, QuantileThreshold)
    assert (dgc.combine, dgc.momentum_masking, dgc.gradients_at) == ("mean", False, "local")
    assert dgc.config()["residual_post_processor"] == {"type": "ResidualClipping", "ratio": 2.0,
                                                       "frequency": 1}
    assert isinstance(dl4j.threshold_algorithm, AdaptiveThreshold)
    assert dl4j.threshold_algorithm.tau == 1e-3
    assert (dl4j.combine, dl4j.momentum_masking, dl4j.gradients_at) == ("sum", False, "shared")
    assert dl4j.residual_post_processor is None
    mixed = SharedGradients(FixedThreshold(0.5), recipe="dl4j", combine="mean",
                            momentum_masking=True, gradients_at="local")
    assert mixed.config()["threshold_algorithm"]["type"] == "FixedThreshold"
    assert (mixed.combine, mixed.momentum_masking, mixed.gradients_at,
            mixed.config()["recipe"]) == ("mean", True, "local", "dl4j")


def test_momentum_masking_zeroes_the_momentum_of_the_elements_sent() -> None:
    for masking in (True, False):
        model = nn.Linear(4, 1, bias=False)
        nn.init.zeros_(model.weight)
        ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0,
                                                                  momentum=0.9))
        sync = SharedGradients(FixedThreshold(0.125), momentum_masking=masking,
                               encoding="threshold")
        sync.setup(ctx)
        _step(sync, ctx, [[-0.3, 0.05, 0.2, -0.1]])  # elements 0 and 2 reach tau
        buffer = ctx.optimizer.state[model.weight]["momentum_buffer"].reshape(-1)
        expected = [0.0, 0.05, 0.0, -0.1] if masking else [-0.3, 0.05, 0.2, -0.1]
        assert buffer.tolist() == pytest.approx(expected)
        assert sync.stats()["momentum_masked"] == (2 if masking else 0)


def test_state_dict_round_trip_and_pickling() -> None:
    model = nn.Linear(3, 1, bias=False)
    ctx = _ctx(model)
    sync = SharedGradients(AdaptiveThreshold(initial=1e-3))
    sync.setup(ctx)
    _step(sync, ctx, [[1.0, -1.0, 0.5]])
    state = sync.state_dict()
    restored = SharedGradients(AdaptiveThreshold(initial=1e-3))
    restored.load_state_dict(state)
    assert restored.threshold_algorithm.tau == sync.threshold_algorithm.tau
    assert restored.sync_steps == 1 and restored._encoder.format == Format(state["format"])
    restored.setup(_ctx(nn.Linear(3, 1, bias=False)))  # the residual waited for the model
    assert torch.equal(restored._replica.residual, sync._replica.residual)
    with pytest.raises(ValueError, match="same model"):
        restored.setup(_ctx(nn.Linear(3, 2, bias=False)))
        restored.load_state_dict(state)
    assert restored.config() == sync.config()
    assert sync.config()["threshold_algorithm"] == {
        "type": "AdaptiveThreshold", "initial": 1e-3, "min_sparsity": 1e-4,
        "max_sparsity": 1e-2, "decay": pytest.approx(0.5 ** (1 / 20))}
    clone = pickle.loads(pickle.dumps(sync))
    assert clone.threshold_algorithm.tau == sync.threshold_algorithm.tau


def test_residual_survives_between_fits() -> None:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    sync = SharedGradients(FixedThreshold(1.0))
    sync.setup(ctx)
    _step(sync, ctx, [[-0.75, 0.0]])
    sync.setup(ctx)  # a second fit()
    _step(sync, ctx, [[-0.75, 0.0]])
    assert model.weight.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("write", ["in_place", "new_storage", "load_state_dict"])
def test_a_parameter_written_between_steps_is_not_reverted(write) -> None:
    """The saved copy of the parameters mirrors them across steps; a write from outside the
    step (a restored checkpoint, the user's code) must be seen, not undone."""
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    sync = SharedGradients(FixedThreshold(1.0), encoding="threshold")  # sends nothing here
    sync.setup(ctx)
    _step(sync, ctx, [[0.1, 0.0, 0.0, 0.0]])
    edited = [[2.0, 3.0, 4.0, 5.0]]
    with torch.no_grad():
        if write == "in_place":
            model.weight.copy_(torch.tensor(edited))
        elif write == "new_storage":
            model.weight.data = torch.tensor(edited)
        else:
            model.load_state_dict({"weight": torch.tensor(edited)})
    _step(sync, ctx, [[0.0, 0.0, 0.0, 0.0]])
    assert model.weight.tolist() == edited
    # Only the real updates are in the residual, not the edit.
    assert sync._replica.residual.tolist() == pytest.approx([-0.1, 0.0, 0.0, 0.0])


def test_the_saved_copy_is_skipped_when_only_messages_moved_the_parameters() -> None:
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    sync = SharedGradients(FixedThreshold(2.0 ** -3), encoding="threshold")
    sync.setup(ctx)
    copies = []
    target = sync._replica.old_parts[0]  # old_flat: the parameters are laid end to end
    original = target.copy_

    def counting_copy(src, *args, **kwargs):
        copies.append(1)
        return original(src, *args, **kwargs)

    target.copy_ = counting_copy  # type: ignore[method-assign]
    for _ in range(3):
        _step(sync, ctx, [[-0.3, 0.05, 0.2, -0.1]])
    assert len(copies) == 1  # the first step only
    old = sync._replica.old[0]
    assert torch.equal(old, model.weight.detach())  # bit for bit, after every message


def test_clipping_only_the_chunks_past_its_bound_equals_clipping_everything() -> None:
    g = torch.Generator().manual_seed(3)
    model = nn.Linear(3_000, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    sync = SharedGradients(FixedThreshold(0.25), ResidualClipping(2.0, 1), encoding="threshold")
    sync.setup(ctx)
    _step(sync, ctx, [[0.0] * 3_000])  # ResidualClipping clips from the second step on
    grad = torch.randn(1, 3_000, generator=g) * 0.2
    grad[0, 100] = -5.0  # one element far past 2 tau: only its chunk needs the clip
    from paraloom.sync.sharing import encoder as sharing
    real_scan = sharing.scan
    sharing.scan = lambda v, tau: real_scan(v, tau, chunk=512)  # 6 chunks
    try:
        _step(sync, ctx, grad.tolist())
    finally:
        sharing.scan = real_scan
    update = -grad.reshape(-1)
    moved = update.abs() >= 0.25
    expected = (update - torch.where(moved, update.sign() * 0.25, 0.0)).clamp(-0.5, 0.5)
    assert torch.equal(sync._replica.residual, expected)
    assert float(sync._replica.residual[100]) == 0.5


def _two_fits_run(rank: int, world_size: int, touch_rank: int | None) -> dict[str, Any]:
    """Two fits on one model; between them, ``touch_rank`` (if any) alone writes a parameter."""
    sync = SharedGradients(FixedThreshold(1e-3))
    model = make_model(rank)
    first = train(rank, world_size, sync, 3, model=model)
    if rank == touch_rank:
        with torch.no_grad():
            next(model.parameters()).add_(0.5)
    setup_before = sync.setup_bytes_sent
    second = train(rank, world_size, sync, 3, model=model)
    return {"first": first["final"], "second": second["digests"],
            "setup_bytes": sync.setup_bytes_sent - setup_before}


@pytest.mark.parametrize("touch_rank", [None, 1])
def test_a_second_setup_broadcasts_the_parameters_only_if_some_replica_wrote_one(
        pool, touch_rank) -> None:
    results = pool.run(_two_fits_run, touch_rank=touch_rank)
    a, b = results
    assert a["first"] == b["first"] and a["second"] == b["second"]  # identical throughout
    if touch_rank is None:
        assert a["setup_bytes"] == 0  # untouched everywhere: nothing to broadcast
    else:  # one replica's write: every replica votes to broadcast (none waits alone)
        assert a["setup_bytes"] > 0


class _WithBuffers(nn.Module):
    """BatchNorm (written by every forward), a constant mask, and a counter that only the last
    rank's forward writes."""

    def __init__(self, mask: bool, replace: bool = False) -> None:
        super().__init__()
        self.body = make_model(0, batchnorm=True)
        if mask:
            self.register_buffer("mask", torch.ones(4096))
        self.register_buffer("count", torch.zeros(1))
        self.replace = replace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_rank() == dist.get_world_size() - 1:
            if self.replace:  # a new tensor each step, as `self.ema = 0.9 * self.ema + ...`
                self.count = self.count + 1
            else:
                self.count += 1
        return self.body(x)


def _buffers_run(rank: int, world_size: int, mask: bool, replace: bool = False
                 ) -> dict[str, Any]:
    sync = SharedGradients(FixedThreshold(1e-3))
    out = train(rank, world_size, sync, STEPS, model=_WithBuffers(mask, replace), seed=0)
    return {"final": out["final"], "bytes_per_step": out["bytes_per_step"]}


def test_a_buffer_the_forward_replaces_is_broadcast_too(pool) -> None:
    """The buffers were listed once, at setup: one the forward replaced was never sent again,
    so the replicas' counters drifted apart for the whole fit."""
    a, b = pool.run(_buffers_run, mask=False, replace=True)
    assert a["final"] == b["final"]


def test_only_written_buffers_are_broadcast_and_every_replica_ends_equal(pool) -> None:
    with_mask = pool.run(_buffers_run, mask=True)
    without = pool.run(_buffers_run, mask=False)
    for results in (with_mask, without):
        assert results[0]["final"] == results[1]["final"]  # parameters and buffers, every bit
    # The constant mask (16 KiB) went out once, at setup, never with a step: each step's bytes
    # are the same with and without it (the BatchNorm statistics and the counter go each step).
    assert with_mask[0]["bytes_per_step"] == without[0]["bytes_per_step"]
    assert min(without[0]["bytes_per_step"]) > 4 * 32 * 2  # the BatchNorm statistics do go


@pytest.mark.parametrize("batched", [False, True])
def test_differs_flags_changed_values_and_shapes_in_either_mode(batched) -> None:
    from paraloom.sync.sharing import differs

    values = [torch.zeros(3), torch.ones(2, 2), torch.arange(4.0), torch.zeros(5)]
    tensors = [v.clone() for v in values]
    tensors[1][1, 0] = 2.0  # one element changed
    tensors[2] = torch.arange(5.0)  # another shape
    tensors[3][0] = float("nan")  # NaN never equals what was sent
    assert differs(tensors, values, batched=batched) == [False, True, True, True]
    assert differs(values, values, batched=batched) == [False] * 4
    assert differs([], [], batched=batched) == []


# -- gradients_at="local" -------------------------------------------------------------------

def _local_step(sync: SharedGradients, ctx: StepContext, x: torch.Tensor,
                seen: list[torch.Tensor]) -> None:
    """One step as the training loop runs it: before_step, forward and backward, step."""
    sync.before_step(ctx)
    ctx.optimizer.zero_grad(set_to_none=True)
    (weight,) = ctx.model.parameters()
    seen.append(weight.detach().clone())
    ctx.model(x).pow(2).sum().backward()
    sync.after_backward(ctx)
    ctx.optimizer.step()
    sync.after_step(ctx)


def test_the_local_view_is_where_one_replica_steps_so_it_trains_as_plain_sgd() -> None:
    """The forward runs at the shared parameters plus the unsent residual; with one replica
    that is plain SGD's trajectory, while the parameters between steps are the shared ones
    (without clipping, which takes from the view what it takes from the residual)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g) for _ in range(10)]
    plain = nn.Linear(16, 1, bias=False)
    model = nn.Linear(16, 1, bias=False)
    model.load_state_dict(plain.state_dict())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01,
                                                             momentum=0.9))
    sync = SharedGradients(QuantileThreshold(1 / 8), ResidualPostProcessor())
    sync.setup(ctx)
    seen: list[torch.Tensor] = []
    for x in xs:
        shared = sync.shared_parameters(ctx).get(id(model.weight), model.weight).clone()
        residual = sync._replica.residual.clone().view_as(shared)
        assert torch.allclose(shared + residual, plain.weight, rtol=0, atol=1e-6)
        _local_step(sync, ctx, x, seen)
        # Where the forward ran: the local view, which the parameters hold between steps.
        assert torch.allclose(seen[-1], shared + residual, rtol=0, atol=1e-7)
        plain_opt.zero_grad()
        plain(x).pow(2).sum().backward()
        plain_opt.step()
    assert sync._replica.residual.abs().max() > 1e-3  # a real lag between the two
    assert torch.allclose(model.weight, plain.weight, rtol=0, atol=1e-6)
    sync.finish(ctx)  # the shared parameters, one residual behind plain training
    final = model.weight.detach() + sync._replica.residual.view_as(model.weight)
    assert torch.allclose(final, plain.weight, rtol=0, atol=1e-6)
    assert not torch.allclose(model.weight, plain.weight, rtol=0, atol=1e-3)
    # DL4J's rule evaluates at the shared parameters: another trajectory.
    shared_rule = SharedGradients(QuantileThreshold(1 / 8), gradients_at="shared")
    other = nn.Linear(16, 1, bias=False)
    other.load_state_dict(model.state_dict() | {"weight": seen[0]})
    other_ctx = StepContext(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.01,
                                                                   momentum=0.9))
    shared_rule.setup(other_ctx)
    other_seen: list[torch.Tensor] = []
    for x in xs:
        _local_step(shared_rule, other_ctx, x, other_seen)
    assert not torch.allclose(other.weight, model.weight)


def test_a_step_that_fails_midway_leaves_the_shared_parameters_not_the_local_view() -> None:
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    ctx = _ctx(model, lr=1.0)
    sync = SharedGradients(FixedThreshold(1.0), encoding="threshold")
    sync.setup(ctx)
    _step(sync, ctx, [[-0.5, 0.25, 0.0, 0.0]])  # below tau: all of it waits in the residual
    shared = model.weight.detach().clone()
    for restart in ("abort_step", "finish", "before_step"):
        sync.before_step(ctx)
        assert model.weight.tolist() == [[0.5, -0.25, 0.0, 0.0]]  # shared + residual
        # The forward raises here (a NaN loss, a bad batch); the next call puts shared back.
        getattr(sync, restart)(ctx)
        if restart != "before_step":
            assert torch.equal(model.weight, shared), restart
    _step(sync, ctx, [[0.0, 0.0, 0.0, 0.0]])
    assert sync._replica.residual.tolist() == [0.5, -0.25, 0.0, 0.0]
    # A state loaded after a failed step is the next fit's start, not undone by setup().
    sync.before_step(ctx)
    model.load_state_dict({"weight": torch.tensor([[7.0, 7.0, 7.0, 7.0]])})
    sync.setup(ctx)
    assert model.weight.tolist() == [[7.0, 7.0, 7.0, 7.0]]


def test_the_training_loop_aborts_a_failed_step_so_the_replica_keeps_the_shared_parameters(
) -> None:
    from paraloom.training.optim import OptimizerSpec
    from paraloom.training.replica import Replica

    model = nn.Linear(4, 2)
    replica = Replica(model, OptimizerSpec.from_user(lambda p: torch.optim.SGD(p, lr=0.5),
                                                     model),
                      loss_fn=nn.CrossEntropyLoss(),
                      synchronizer=SharedGradients(FixedThreshold(64.0)))  # sends nothing
    replica.begin_fit(None, None, None, 0, None)
    replica.step((torch.randn(8, 4), torch.randint(0, 2, (8,))))
    saved = replica.sync.shared_parameters(replica.ctx)
    shared = [saved[id(p)].clone() for p in replica.model.parameters()]
    assert replica.sync._replica.residual.abs().max() > 0  # the local view differs from shared
    assert not all(torch.equal(p, s) for p, s in zip(replica.model.parameters(), shared,
                                                     strict=True))
    with pytest.raises(Exception, match="size|shape"):
        replica.step((torch.randn(8, 5), torch.randint(0, 2, (8,))))  # the wrong width
    assert all(torch.equal(p, s) for p, s in zip(replica.model.parameters(), shared,
                                                 strict=True))


def test_a_skipped_optimizer_step_leaves_the_residual_where_it_was() -> None:
    """Between steps the residual is what the local view holds beyond the shared parameters:
    a step that moves nothing changes it by the parameters' rounding of the view at most, the
    first time, and then not at all, in 16 bits too."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(1)
        model = nn.Linear(64, 1, bias=False).to(dtype)
        ctx = _ctx(model, lr=0.3)
        sync = SharedGradients(FixedThreshold(64.0))  # sends nothing: all stays in the residual
        sync.setup(ctx)
        sync._replica.residual.copy_(torch.randn(64, generator=g) * 0.3)  # unsent float32 updates
        residuals = [sync._replica.residual.clone()]
        for _ in range(2):
            sync.before_step(ctx)
            sync.after_backward(ctx)
            ctx.skip_optimizer_step = True  # e.g. the loss scaler found an inf
            sync.after_step(ctx)
            residuals.append(sync._replica.residual.clone())
        ulp = torch.finfo(dtype).eps * float(model.weight.detach().abs().max())
        assert torch.allclose(residuals[1], residuals[0], rtol=0, atol=ulp), dtype
        assert torch.equal(residuals[2], residuals[1]), dtype


def test_gradients_at_is_checked() -> None:
    with pytest.raises(ValueError, match="gradients_at='global'.*'local'.*'shared'"):
        SharedGradients(gradients_at="global")


def test_a_restored_state_puts_the_saved_local_view_back_bit_for_bit() -> None:
    """A resumed run's forward runs where the saved run's would have, also where the view's
    rounding has drifted from shared + residual."""
    g = torch.Generator().manual_seed(2)
    model = nn.Linear(16, 1, bias=False)
    ctx = _ctx(model, lr=0.1)
    sync = SharedGradients(QuantileThreshold(1 / 8))
    sync.setup(ctx)
    seen: list[torch.Tensor] = []
    for _ in range(3):
        _local_step(sync, ctx, torch.randn(4, 16, generator=g), seen)
    with torch.no_grad():  # a drift as rounding leaves it, made visible
        model.weight.view(-1)[0] += 1e-3
    sync._replica.stamps = sync._replica.current_stamps()
    view = model.weight.detach().clone()
    shared = sync.shared_parameters(ctx)[id(model.weight)].clone()
    state = pickle.loads(pickle.dumps(sync.state_dict()))

    resumed_model = nn.Linear(16, 1, bias=False)
    resumed_model.load_state_dict({"weight": shared})  # a checkpoint holds the shared values
    resumed_ctx = _ctx(resumed_model, lr=0.1)
    resumed = SharedGradients(QuantileThreshold(1 / 8))
    resumed.setup(resumed_ctx)
    resumed.load_state_dict(state)
    resumed.before_step(resumed_ctx)
    assert torch.equal(resumed_model.weight, view)
    assert torch.equal(resumed.shared_parameters(resumed_ctx)[id(resumed_model.weight)], shared)
    assert torch.equal(resumed._replica.residual, sync._replica.residual)


# -- overlap: the exchange runs while the next step computes ---------------------------------

def test_with_overlap_one_replica_trains_as_plain_sgd_and_shares_one_step_later() -> None:
    """With one replica the local view is plain SGD's trajectory with overlap too, and the
    shared parameters after each step are those that an exchange without overlap leaves one
    step earlier: the same messages, applied a step later."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 64, generator=g) for _ in range(8)]
    runs: dict[bool, list[torch.Tensor]] = {}
    views: dict[bool, list[torch.Tensor]] = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(64, 1, bias=False)
        ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01,
                                                                 momentum=0.9))
        sync = SharedGradients(QuantileThreshold(1 / 32, exact_count=True),
                               ResidualPostProcessor(), overlap=overlap)
        sync.setup(ctx)
        runs[overlap], views[overlap] = [], []
        for x in xs:
            _local_step(sync, ctx, x, views[overlap])
            runs[overlap].append(sync.shared_parameters(ctx)[id(model.weight)].clone())
        assert (sync._started is not None) == overlap  # the last exchange still in flight
        sync.finish(ctx)
        assert sync._started is None
    for plain, delayed in zip(views[False], views[True], strict=True):
        assert torch.allclose(plain, delayed, rtol=0, atol=1e-6)
    assert torch.equal(runs[True][0], views[True][0])  # nothing shared after the first step
    for earlier, later in zip(runs[False], runs[True][1:], strict=False):
        assert torch.allclose(earlier, later, rtol=0, atol=1e-6)
    assert not torch.allclose(runs[False][-1], runs[True][-1], rtol=0, atol=1e-4)


def test_overlap_needs_the_local_view_and_messages_of_one_size() -> None:
    assert SharedGradients().overlap and SharedGradients().threshold_algorithm.message_count(
        1600) == 10  # on by default in the dgc recipe, with exact-count messages
    assert not SharedGradients(recipe="dl4j").overlap
    assert not SharedGradients(gradients_at="shared").overlap
    assert not SharedGradients(QuantileThreshold(1 / 300)).overlap  # messages of any size
    assert SharedGradients(encoding="bitmap").overlap  # bitmaps have one size too
    with pytest.raises(ValueError, match="overlap=True with gradients_at='shared'"):
        SharedGradients(overlap=True, gradients_at="shared")
    for options in ({"threshold_algorithm": AdaptiveThreshold()},
                    {"threshold_algorithm": QuantileThreshold(1 / 8)}):
        with pytest.raises(ValueError, match="overlap=True.*exact_count=True"):
            SharedGradients(overlap=True, **options)  # when built, not in the workers
    assert SharedGradients(overlap=True).config()["overlap"] is True


def _overlap_resume_run(rank: int, world_size: int, save_at: int) -> dict[str, Any]:
    """Train ``2 * save_at`` steps, checkpointing after ``save_at`` (with every exchange
    waited for, so the saved state holds the messages in flight); then resume from that
    checkpoint in a fresh model and synchronizer, and train the same steps again."""
    import torch.distributed as dist

    from .replicas import digest

    def fresh(state: dict[str, Any] | None) -> tuple[SharedGradients, StepContext]:
        torch.manual_seed(rank)
        model = make_model(rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx = StepContext(model=model, optimizer=optimizer, group=dist.group.WORLD, rank=rank,
                          world_size=world_size)
        sync = SharedGradients(QuantileThreshold(1 / 32, exact_count=True), overlap=True)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        sync.setup(ctx)
        if state is not None:
            sync.load_state_dict(pickle.loads(state["sync"]))
        return sync, ctx

    def step(sync: SharedGradients, ctx: StepContext, index: int) -> None:
        sync.before_step(ctx)
        ctx.optimizer.zero_grad(set_to_none=True)
        x, y = batch(rank, index)
        nn.functional.cross_entropy(ctx.model(x), y).backward()
        sync.after_backward(ctx)
        ctx.optimizer.step()
        sync.after_step(ctx)

    sync, ctx = fresh(None)
    saved: dict[str, Any] = {}
    for index in range(2 * save_at):
        step(sync, ctx, index)
        if index + 1 == save_at:
            shared = sync.shared_parameters(ctx)
            saved = {"model": {k: shared.get(id(v), v).clone() for k, v
                               in ctx.model.state_dict(keep_vars=True).items()},
                     "optimizer": copy.deepcopy(ctx.optimizer.state_dict()),
                     "sync": pickle.dumps(sync.state_dict())}
    sync.finish(ctx)
    uninterrupted = digest(ctx.model)
    resumed, resumed_ctx = fresh(saved)
    for index in range(save_at, 2 * save_at):
        step(resumed, resumed_ctx, index)
    resumed.finish(resumed_ctx)
    return {"uninterrupted": uninterrupted, "resumed": digest(resumed_ctx.model),
            "in_flight": "in_flight" in pickle.loads(saved["sync"])}


def test_overlap_resumes_bit_for_bit_with_the_exchange_in_flight_saved(pool) -> None:
    results = pool.run(_overlap_resume_run, save_at=5)
    for r in results:
        assert r["in_flight"]
        assert r["resumed"] == r["uninterrupted"]
    assert results[0]["uninterrupted"] == results[1]["uninterrupted"]


def _overlap_run(steps: int, seed: int, *, save: bool = False,
                 ) -> tuple[SharedGradients, StepContext]:
    """``steps`` overlapped steps of a linear model; ``save``: a state_dict after each."""
    torch.manual_seed(0)
    ctx = _ctx(nn.Linear(64, 1, bias=False), lr=0.05)
    sync = SharedGradients(QuantileThreshold(1 / 32, exact_count=True), overlap=True)
    sync.setup(ctx)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _local_step(sync, ctx, torch.randn(4, 64, generator=g), [])
        if save:
            assert "in_flight" in sync.state_dict()
    return sync, ctx


def test_overlap_saving_a_state_does_not_change_the_trajectory() -> None:
    """A checkpoint waits for the exchange in flight but applies it at the step it would
    have been applied anyway."""
    finals = [_overlap_run(6, 4, save=save)[1].model.weight.detach().clone()
              for save in (False, True)]
    assert torch.equal(finals[0], finals[1])


def test_overlap_a_failed_step_drops_the_exchange_in_flight_and_keeps_shared() -> None:
    sync, ctx = _overlap_run(3, 5)
    weight = ctx.model.weight
    shared = sync.shared_parameters(ctx)[id(weight)].clone()
    sync.before_step(ctx)
    sync.abort_step(ctx)
    assert sync._started is None and torch.equal(weight, shared)


def _clipped_view_run(layout: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    # A tau far below the updates: the clip takes from most elements, every step.
    sync = SharedGradients(FixedThreshold(2.0 ** -12), ResidualClipping(2.0, 1),
                           encoding="threshold", overlap=False)
    sync.setup(ctx)
    g = torch.Generator().manual_seed(1)
    from paraloom.sync.sharing import encoder as sharing
    real_scan = sharing.scan
    sharing.scan = lambda v, tau: real_scan(v, tau, chunk=512)  # chunks that split parameters
    try:
        for _ in range(4):
            sync.before_step(ctx)
            # The same gradients in either layout: a conv's backward may round differently
            # in channels_last (another kernel), which is not what this test is about.
            for p in model.parameters():
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g) * 0.1)
            sync.after_backward(ctx)
            ctx.optimizer.step()
            sync.after_step(ctx)
    finally:
        sharing.scan = real_scan
    shared = sync.shared_parameters(ctx)
    residual = sync._replica.residual_views
    for p, r in zip(model.parameters(), residual, strict=True):  # one worker: reach 1
        assert torch.allclose(p, shared[id(p)] + r, rtol=0, atol=1e-6)
    assert sync._replica.residual.abs().max() == 2.0 ** -11  # clipped at 2 tau
    return [p.detach().contiguous().clone() for p in model.parameters()]


def test_what_clipping_takes_from_the_residual_leaves_the_local_view_in_any_layout() -> None:
    """Contiguous parameters take it in a pass over each clipped chunk, channels_last ones at
    the elements it took: the same view either way."""
    dense, strided = _clipped_view_run("contiguous"), _clipped_view_run("channels_last")
    assert all(torch.equal(a, b) for a, b in zip(dense, strided, strict=True))


def _fit_steps(sync: SharedGradients, model: nn.Module, steps: int = 3) -> StepContext:
    """``steps`` steps of a fit on random data, left open (no ``finish``)."""
    ctx = _ctx(model, lr=0.1)
    sync.setup(ctx)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        sync.before_step(ctx)
        ctx.optimizer.zero_grad()
        model(torch.randn(8, 6, generator=g)).square().mean().backward()
        sync.after_backward(ctx)
        ctx.optimizer.step()
        sync.after_step(ctx)
    return ctx


def test_a_fit_lays_the_parameters_end_to_end_and_gives_them_back_their_own_storage() -> None:
    from safetensors.torch import save_file
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    sync = SharedGradients(recipe="dl4j")  # the parameters are the shared ones between steps
    ctx = _fit_steps(sync, model)
    params = list(model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1 and len(sync._replica.parts) == 1  # one tensor per operation
    during = [p.detach().clone() for p in params]
    sync.finish(ctx)
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in params)
    assert all(torch.equal(p, d) for p, d in zip(params, during, strict=True))  # values kept
    save_file(dict(model.state_dict()), "/dev/null")  # refuses tensors that share storage
    _fit_steps(sync, model, steps=1)  # a warm fit lays them again and trains on
    sync.finish(ctx)


def test_parameters_that_cannot_be_laid_end_to_end_train_as_they_are() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2).double())
    model[1].forward = lambda x: nn.functional.linear(x.double(), model[1].weight,  # type: ignore[method-assign]
                                                      model[1].bias)
    sync = SharedGradients()
    before = [p.detach().clone() for p in model.parameters()]
    ctx = _fit_steps(sync, model)
    assert len(sync._replica.parts) == 4 and sync._replica.params_flat is None  # two dtypes
    sync.finish(ctx)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_warm_fit_after_a_dtype_change_keeps_the_new_dtype() -> None:
    model = nn.Linear(6, 2)
    sync = SharedGradients()
    ctx = _fit_steps(sync, model)
    sync.finish(ctx)
    model.double()  # the same parameter objects, with new data
    ctx = _fit_steps(sync, model, steps=0)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    sync.finish(ctx)
