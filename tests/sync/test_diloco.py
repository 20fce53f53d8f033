"""DiLoCo: the algorithm on one replica (plain training when the outer step is SGD at lr 1),
error feedback, two ranks in one gloo group, exact state round trips, and bad options."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from paraloom.sync.averaging import Averaging
from paraloom.sync.base import StepContext
from paraloom.sync.diloco import DiLoCo, split_fragments
from paraloom.sync.pseudo_gradients import entries, message_bytes

from .replicas import batch, flat, make_model, train

PLAIN = functools.partial(torch.optim.SGD, lr=1.0)  # the outer step that just averages


def _one_replica(sync: DiLoCo | None, steps: int, model: torch.nn.Module | None = None
                 ) -> tuple[torch.nn.Module, StepContext]:
    model = model or make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx = StepContext(model=model, optimizer=optimizer)
    if sync is not None:
        sync.setup(ctx)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(0, step)
        F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
        optimizer.step()
        if sync is not None:
            sync.after_step(ctx)
    if sync is not None:
        sync.finish(ctx)
    return model, ctx


def test_one_replica_with_a_plain_outer_step_is_plain_training() -> None:
    plain, _ = _one_replica(None, 10)
    diloco, _ = _one_replica(DiLoCo(sync_every=3, outer_optimizer=PLAIN, density=1.0), 10)
    assert torch.allclose(torch.tensor(flat(diloco)), torch.tensor(flat(plain)), atol=1e-6)
    nesterov, _ = _one_replica(DiLoCo(sync_every=3, density=1.0,
                                      outer_optimizer=functools.partial(
                                          torch.optim.SGD, lr=0.7, momentum=0.9,
                                          nesterov=True)), 10)
    assert max(abs(a - b) for a, b in zip(flat(nesterov), flat(plain), strict=True)) > 1e-3


def test_what_a_message_leaves_out_is_sent_later() -> None:
    """Error feedback: after a synchronization the anchor moved by exactly what was sent, and
    the residual holds the rest of the pseudo-gradient."""
    sync = DiLoCo(sync_every=4, outer_optimizer=PLAIN, density=0.1, values="fp32")
    model, ctx = _one_replica(None, 0)
    sync.setup(ctx)
    start = [a.clone() for a in sync._anchors]
    model, ctx = _one_replica(None, 4, model=model)  # 4 local steps, as between two syncs
    pseudo = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(
        start, model.parameters(), strict=True)])
    sync.sync_steps = 3
    sync.after_step(ctx)  # the 4th round: a synchronization
    moved = torch.cat([(s - a).reshape(-1) for s, a in zip(start, sync._anchors, strict=True)])
    residual = torch.cat([r.reshape(-1) for r in sync._residuals])  # type: ignore[union-attr]
    assert int((moved != 0).sum()) == entries(pseudo.numel(), 0.1)
    assert torch.allclose(moved + residual, pseudo, atol=1e-6)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                       torch.cat([a.reshape(-1) for a in sync._anchors]))


def _two_ranks(rank: int, world_size: int, kind: str, idle: bool = False) -> dict[str, Any]:
    sync = (Averaging(frequency=4, average_updaters=False) if kind == "averaging"
            else DiLoCo(sync_every=4, outer_optimizer=PLAIN, density=1.0) if kind == "dense"
            else DiLoCo(sync_every=4, density=0.05))
    return train(rank, world_size, sync, 10, seed=0, idle={9: [1]} if idle else {})


def test_two_ranks_end_identical_and_dense_plain_diloco_is_averaging(pool) -> None:
    averaged = pool.run(_two_ranks, kind="averaging")
    dense = pool.run(_two_ranks, kind="dense")
    for a, b in zip(averaged, dense, strict=True):
        assert torch.allclose(torch.tensor(a["params"]), torch.tensor(b["params"]), atol=1e-5)
    # A replica idle in round 9: averaging leaves its stale weights out of the last average;
    # DiLoCo counts its pseudo-gradient (one step, not two) in a plain mean, as DDP's Join
    # counts an idle rank's zero gradient.
    averaged = pool.run(_two_ranks, kind="averaging", idle=True)
    dense = pool.run(_two_ranks, kind="dense", idle=True)
    assert averaged[0]["params"] == averaged[1]["params"]
    assert dense[0]["params"] == dense[1]["params"]
    assert not torch.allclose(torch.tensor(averaged[0]["params"]),
                              torch.tensor(dense[0]["params"]), atol=1e-4)
    compressed = pool.run(_two_ranks, kind="compressed", idle=True)
    assert compressed[0]["final"] == compressed[1]["final"]  # finish: every replica equal
    numel = len(compressed[0]["params"])
    per_sync = message_bytes(entries(numel, 0.05), "int8", numel)  # one peer, one message
    assert compressed[0]["stats"]["bytes_sent"] == 3 * per_sync  # rounds 4, 8 and finish
    assert compressed[0]["stats"]["synchronizations"] == 3


def _sharded(rank: int, world_size: int, density: float) -> dict[str, Any]:
    from paraloom.sync.sharded_exchange import sharded_average

    flat = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    average, residual, kept, sent, received = sharded_average(
        flat, None, density, "fp32", None, rank, world_size)
    return {"flat": flat.tolist(), "average": average.tolist(), "residual": residual.tolist(),
            "kept": kept.tolist(), "sent": sent, "received": received}


def test_the_sharded_exchange_loses_nothing_and_averages_exactly_when_dense(pool) -> None:
    from paraloom.sync.sharded_exchange import packed_size

    dense = pool.run(_sharded, density=1.0)
    mean = (torch.tensor(dense[0]["flat"]) + torch.tensor(dense[1]["flat"])) / 2
    for r in dense:
        torch.testing.assert_close(torch.tensor(r["average"]), mean)
    sparse = pool.run(_sharded, density=0.05)
    assert sparse[0]["average"] == sparse[1]["average"]  # every rank steps the same way
    average = torch.tensor(sparse[0]["average"])
    assert int((average != 0).sum()) == 2 * entries(500, 0.05)  # re-selected per shard
    # Error feedback at both ends: sent + the senders' residuals + the shard owners' kept
    # remainder add up to the exact mean.
    residuals = (torch.tensor(sparse[0]["residual"]) + torch.tensor(sparse[1]["residual"])) / 2
    kept = torch.cat([torch.tensor(sparse[0]["kept"]), torch.tensor(sparse[1]["kept"])])
    torch.testing.assert_close(average + residuals + kept, mean)
    size = packed_size(500, 0.05, "fp32")
    assert sparse[0]["sent"] == sparse[0]["received"] == 2 * size  # one shard out, one back


def _ranks_sharded(rank: int, world_size: int) -> dict[str, Any]:
    return train(rank, world_size, DiLoCo(sync_every=4, density=0.05, exchange="sharded"), 10,
                 seed=0, idle={9: [1]})


def test_sharded_diloco_ends_with_identical_replicas(pool) -> None:
    from paraloom.sync.sharded_exchange import packed_size

    result = pool.run(_ranks_sharded)
    assert result[0]["final"] == result[1]["final"]
    numel = len(result[0]["params"])
    half = [packed_size(numel // 2, 0.05, "int8"), packed_size(numel - numel // 2, 0.05, "int8")]
    per_sync = half[1] + max(half)  # rank 0: rank 1's shard out, then its own to rank 1
    assert result[0]["stats"]["bytes_sent"] == 3 * per_sync
    assert result[0]["stats"]["bytes_received"] == 3 * (half[0] + max(half))


def _steps(model: torch.nn.Module, ctx: StepContext, sync: DiLoCo, first: int,
           count: int) -> None:
    for step in range(first, first + count):
        ctx.optimizer.zero_grad(set_to_none=True)
        x, y = batch(0, step)
        F.cross_entropy(model(x), y).backward()
        ctx.optimizer.step()
        sync.after_step(ctx)


def test_an_overlapped_synchronization_keeps_what_was_learned_meanwhile() -> None:
    # One replica, dense, plain outer step: the landed anchor is the parameters as sent, and
    # the rounds trained while it was in flight are kept on top: plain training again.
    plain, _ = _one_replica(None, 11)
    overlapped, _ = _one_replica(DiLoCo(sync_every=4, outer_optimizer=PLAIN, density=1.0,
                                        overlap_rounds=2), 11)
    assert torch.allclose(torch.tensor(flat(overlapped)), torch.tensor(flat(plain)), atol=1e-6)


def test_a_checkpoint_taken_while_a_synchronization_is_in_flight_resumes_exactly() -> None:
    def start() -> tuple[torch.nn.Module, StepContext, DiLoCo]:
        model = make_model(0)
        ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        sync = DiLoCo(sync_every=4, density=0.2, values="fp32", overlap_rounds=3)
        sync.setup(ctx)
        return model, ctx, sync

    model, ctx, sync = start()
    _steps(model, ctx, sync, 0, 5)  # sent after round 4, lands after round 7
    assert sync._in_flight is not None and sync._in_flight.due == 7
    saved_sync, saved_model = sync.state_dict(), {k: v.clone() for k, v in
                                                  model.state_dict().items()}
    _steps(model, ctx, sync, 5, 6)
    again, again_ctx, again_sync = start()
    again.load_state_dict(saved_model)
    again_sync.load_state_dict(saved_sync)
    _steps(again, again_ctx, again_sync, 5, 6)
    assert flat(again) == flat(model) and sync.synchronizations == again_sync.synchronizations
    with pytest.raises(ValueError, match="overlap_rounds=4 must be below"):
        DiLoCo(sync_every=8, fragments=2, overlap_rounds=4)
    with pytest.raises(ValueError, match="exchange='gather'"):
        DiLoCo(overlap_rounds=1, exchange="sharded")


def _ranks_overlapped(rank: int, world_size: int) -> dict[str, Any]:
    return train(rank, world_size, DiLoCo(sync_every=4, density=0.05, overlap_rounds=2), 10, seed=0,
                 idle={9: [1]})


def test_overlapped_ranks_end_identical_with_the_same_bytes(pool) -> None:
    result = pool.run(_ranks_overlapped)
    assert result[0]["final"] == result[1]["final"]
    numel = len(result[0]["params"])
    per_sync = message_bytes(entries(numel, 0.05), "int8", numel)
    assert result[0]["stats"]["bytes_sent"] == 3 * per_sync  # rounds 4, 8 and finish
    assert result[0]["stats"]["synchronizations"] == 3


def test_state_round_trip_continues_exactly() -> None:
    sync = DiLoCo(sync_every=3, density=0.2)
    model, ctx = _one_replica(sync, 7)  # finish() ran: one more synchronization
    saved = sync.state_dict()
    again = DiLoCo(sync_every=3, density=0.2)
    again.setup(StepContext(model=make_model(5), optimizer=ctx.optimizer))
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(again._anchors, sync._anchors, strict=True))
    assert again.state_dict()["outer"]["state"].keys() == saved["outer"]["state"].keys()
    assert again.synchronizations == sync.synchronizations == 3


def test_fragments_are_balanced_and_staggered() -> None:
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="4 trainable parameter tensors"):
        split_fragments([1, 1, 1, 1], 5)
    sync = DiLoCo(sync_every=4, fragments=2, outer_optimizer=PLAIN)
    due = []
    for _ in range(8):
        sync.sync_steps += 1
        due.append(sync._due())
    assert due == [None, 0, None, 1, None, 0, None, 1]


@pytest.mark.parametrize("options, message", [
    ({"sync_every": 0}, "sync_every=0"),
    ({"density": 0.0}, "density=0.0"),
    ({"density": 1.5}, "density=1.5"),
    ({"values": "int4"}, "values='int4'"),
    ({"fragments": 0}, "fragments=0"),
    ({"sync_every": 2, "fragments": 3}, "at most sync_every"),
    ({"outer_optimizer": lambda params: "SGD"}, "returned str"),
    ({"outer_optimizer": 0.7}, "expected a callable"),
    ({"sync_every": 10, "fragments": 5}, "4 trainable parameter tensors"),
    ({"exchange": "ring"}, "exchange='ring'"),
])
def test_bad_options_are_refused_before_any_worker_starts(options: dict[str, Any],
                                                          message: str) -> None:
    from paraloom import ParallelWrapper

    with pytest.raises(ValueError, match=message):
        ParallelWrapper(make_model(0), loss_fn=torch.nn.CrossEntropyLoss(), workers=2,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        training_mode="diloco", **options)


def test_options_of_other_modes_are_refused_with_diloco() -> None:
    from paraloom import ParallelWrapper

    with pytest.raises(TypeError, match="averaging_frequency"):
        ParallelWrapper(make_model(0), loss_fn=torch.nn.CrossEntropyLoss(), workers=2,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        training_mode="diloco", averaging_frequency=3)
    with pytest.raises(TypeError, match="comm_hook"):
        ParallelWrapper(make_model(0), loss_fn=torch.nn.CrossEntropyLoss(), workers=2,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        training_mode="diloco", comm_hook="powersgd")


def test_a_selection_round_trips_positions_across_blocks() -> None:
    from paraloom.sync.pseudo_gradients import BLOCK, select, sum_selections

    full = torch.zeros(3 * BLOCK + 5)
    spots = [0, 7, BLOCK - 1, BLOCK, 2 * BLOCK + 32768, 3 * BLOCK + 4]
    full[spots] = torch.tensor([5.0, -4.0, 3.0, -2.5, 2.0, -1.5])
    chosen = select(full, len(spots), "fp32")
    assert chosen.index.tolist() == spots and chosen.counts.tolist() == [3, 1, 1, 1]
    assert torch.equal(sum_selections([chosen, chosen], full.numel(), full.device), 2 * full)
    int8 = sum_selections([select(full, len(spots), "int8")], full.numel(), full.device)
    assert torch.allclose(int8, full, atol=5.0 / 127)


def test_fp16_values_past_its_range_are_scaled_not_infinite() -> None:
    """An fp16 message of a pseudo-gradient entry past 65504 was inf: a NaN loss next."""
    from paraloom.sync.pseudo_gradients import decoded, select

    small = torch.tensor([3.0, -0.5, 1e-3])
    assert torch.equal(decoded(select(small, 3, "fp16")), small.half().float())  # unscaled
    big = torch.tensor([1e6, -2e5, 7.0, 0.0])
    got = decoded(select(big, 3, "fp16"))
    assert torch.isfinite(got).all()
    assert torch.allclose(got, big[:3], rtol=1e-3, atol=0.1 * 1e6 / 60000)


def test_a_nan_in_a_message_reaches_every_replica_instead_of_being_rounded_away() -> None:
    from paraloom.sync.pseudo_gradients import decoded, select

    full = torch.tensor([0.5, float("nan"), -0.25, 0.0])
    assert decoded(select(full, 3, "int8")).isnan().all()
    assert torch.equal(decoded(select(torch.zeros(4), 2, "int8")), torch.zeros(2))


def test_the_outer_optimizer_is_described_the_same_in_every_process() -> None:
    from paraloom.sync.diloco import describe_factory

    def mine(params):
        return torch.optim.SGD(params, lr=0.5)

    assert describe_factory(mine) == f"{__name__}.test_the_outer_optimizer_is_described_the_" \
        "same_in_every_process.<locals>.mine"
    assert "0x" not in describe_factory(lambda p: torch.optim.SGD(p, lr=1.0))
    assert describe_factory(functools.partial(torch.optim.SGD, lr=0.7)) == \
        "torch.optim.sgd.SGD(lr=0.7)"


def test_a_float64_model_is_averaged_in_float64() -> None:
    model = make_model(0, dtype=torch.float64)
    sync = DiLoCo(sync_every=3, outer_optimizer=PLAIN, density=1.0)
    _, ctx = _one_replica(sync, 6, model=model)
    assert all(a.dtype == torch.float64 for a in sync._anchors)
    assert all(torch.equal(a, p) for a, p in zip(sync._anchors, model.parameters(), strict=True))
