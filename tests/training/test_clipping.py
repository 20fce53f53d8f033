"""gradient_clip_val / gradient_clip_algorithm: clipped as Lightning clips, closed form per mode.

``Scalar`` with ``linear_loss`` has gradient mean(x) and SGD lr=1 moves w by minus the (clipped)
gradient, so every expected weight below is known (to torch's 1e-6 in the norm's divisor). Two
workers deal round by round: worker 0 takes the first batch of a round, worker 1 the second.
"""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import Scalar, linear_loss, make_weight_reporting, scalar_batches

from paraloom import ParallelWrapper

pytestmark = pytest.mark.timeout(120)


def _fit(values: list[float], workers: int = 2, **options) -> tuple[float, dict]:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=workers,
                         progress=False, timeout=60, **options) as wrapper:
        stats = wrapper.fit(scalar_batches(values))
    return float(model.w.detach()), stats


@pytest.mark.parametrize(("algorithm", "expected"), [("norm", -0.5), ("value", -0.5)])
def test_allreduce_clips_the_averaged_gradient(algorithm: str, expected: float) -> None:
    # DDP averages (3 + -1) / 2 = 1 first; clipped to 0.5, as after loss.backward() in DDP.
    w, _ = _fit([3.0, -1.0], training_mode="allreduce", gradient_clip_val=0.5,
                gradient_clip_algorithm=algorithm)
    assert w == pytest.approx(expected, abs=1e-5)
    w, _ = _fit([3.0, -1.0], training_mode="allreduce")
    assert w == -1.0  # unclipped


def test_averaging_clips_each_replicas_own_gradient() -> None:
    # Locally: 3 -> 1.5 and -1 stays; the replicas step -1.5 and +1, then average to -0.25.
    w, _ = _fit([3.0, -1.0], training_mode="averaging", gradient_clip_val=1.5)
    assert w == pytest.approx(-0.25, abs=1e-5)


def test_an_idle_replica_steps_with_gradients_clipped_like_its_peers() -> None:
    # Round 2 has one batch: DDP averages (4 + 0) / 2 = 2 on both replicas; each clips it to
    # 0.5 (the idle one too), so both end at -0.5 - 0.5.
    w, stats = _fit([3.0, -1.0, 4.0], training_mode=make_weight_reporting("allreduce"),
                    gradient_clip_val=0.5)
    assert w == pytest.approx(-1.0, abs=1e-5)
    first, second = (r["weights"] for r in stats["per_worker"])
    assert first == second  # bit-identical: an unclipped idle step would end at -2.5


def test_one_worker_clips_too() -> None:
    w, _ = _fit([3.0], workers=1, gradient_clip_val=1.0)
    assert w == pytest.approx(-1.0, abs=1e-5)


def test_clipping_happens_on_unscaled_gradients_under_fp16_loss_scaling() -> None:
    # The GradScaler multiplies the loss by 2**16: clipping the scaled gradients would step by
    # 0.5 / 2**16, not 0.5.
    w, _ = _fit([3.0, -1.0], training_mode="allreduce", precision="16-mixed",
                gradient_clip_val=0.5)
    assert w == pytest.approx(-0.5, abs=1e-3)  # fp16 forward


def test_shared_gradients_encode_the_update_of_the_clipped_gradient() -> None:
    # Each replica clips its own gradient (3 -> 1.5, -1 stays), so the updates it accumulates
    # are -1.5 / 2 and +1 / 2 (combine="mean"); each one's quantile tau is its whole residual,
    # so both are sent whole: -0.25 (unclipped: -1.0). Value clipping: exact, no 1e-6 divisor.
    w, stats = _fit([3.0, -1.0], training_mode=make_weight_reporting("shared_gradients"),
                    gradient_clip_val=1.5, gradient_clip_algorithm="value")
    assert w == -0.25
    assert [r["weights"] for r in stats["per_worker"]] == [[[-0.25]], [[-0.25]]]
    assert [r["residual_norm"] for r in stats["per_worker"]] == [0.0, 0.0]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1"])
def test_a_bad_clip_value_is_refused(value) -> None:
    model = Scalar()
    with pytest.raises(ValueError, match="gradient_clip_val"):
        ParallelWrapper(model, loss_fn=linear_loss, workers=1,
                        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                        gradient_clip_val=value)


def test_an_unknown_clip_algorithm_is_refused() -> None:
    model = Scalar()
    with pytest.raises(ValueError, match="gradient_clip_algorithm='l2'.*'norm', 'value'"):
        ParallelWrapper(model, loss_fn=linear_loss, workers=1,
                        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                        gradient_clip_val=1.0, gradient_clip_algorithm="l2")
