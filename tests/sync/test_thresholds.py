"""Threshold algorithms and residual post-processors."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from paraloom.sync.encoding import Format, decode, encode
from paraloom.sync.thresholds import (
    DEFAULT_DECAY,
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    ResidualClipping,
    ResidualPostProcessor,
    TargetSparsityThreshold,
    ThresholdAlgorithm,
    adapt_threshold,
    clip_residual_,
    sampled_quantile,
)


def _stream(algorithm: ThresholdAlgorithm, scales: list[float], n: int = 20_000,
            seed: int = 0) -> list[float]:
    """Encode a residual fed with Gaussian updates of the given scale per step; sparsities."""
    g = torch.Generator().manual_seed(seed)
    residual = torch.zeros(n)
    fmt, sparsities = Format.THRESHOLD, []
    for step, scale in enumerate(scales):
        residual += torch.randn(n, generator=g) * scale
        msg = encode(residual, algorithm.tau, previous=fmt, half_sign=1 if step % 2 else -1)
        decode(msg, residual, sign=-1)
        fmt = msg.format
        sparsities.append(msg.moved / n)
        algorithm.update(msg.moved / n)
    return sparsities


def _in_band(values: list[float], low: float, high: float) -> float:
    return sum(low <= v <= high for v in values) / len(values)


def test_adaptive_threshold_stays_in_band_on_a_stationary_stream() -> None:
    # Updates ~100x the initial tau: it must climb ~100x (about 130 steps at DL4J's decay).
    algorithm = AdaptiveThreshold(initial=1e-3)
    sparsities = _stream(algorithm, [1e-2] * 450)
    assert _in_band(sparsities[200:], 1e-4, 1e-2) >= 0.95
    assert 0.03 < algorithm.tau < 0.3


def test_adaptive_threshold_follows_a_change_of_scale() -> None:
    algorithm = AdaptiveThreshold(initial=1e-3)
    sparsities = _stream(algorithm, [1e-4] * 250 + [1e-2] * 350, seed=1)
    assert _in_band(sparsities[100:250], 1e-4, 1e-2) >= 0.95
    assert _in_band(sparsities[450:], 1e-4, 1e-2) >= 0.95


def test_target_sparsity_threshold_settles_near_its_target() -> None:
    algorithm = TargetSparsityThreshold(sparsity=1e-3, initial=1e-3)
    sparsities = _stream(algorithm, [1e-2] * 450, seed=2)
    mean = sum(sparsities[250:]) / 200
    assert 3e-4 < mean < 3e-3


def test_fixed_threshold_never_moves() -> None:
    algorithm = FixedThreshold(2e-3)
    for sparsity in (0.0, 0.5, 1e-3):
        assert algorithm.update(sparsity) == 2e-3


def test_adapt_threshold_is_dl4j_rule() -> None:
    assert adapt_threshold(1.0, 1e-5, 1e-4, 1e-2, 0.5) == 0.5
    assert adapt_threshold(1.0, 0.1, 1e-4, 1e-2, 0.5) == 2.0
    assert adapt_threshold(1.0, 1e-3, 1e-4, 1e-2, 0.5) == 1.0
    assert DEFAULT_DECAY ** 20 == pytest.approx(0.5)


@pytest.mark.parametrize("make, match", [
    (lambda: AdaptiveThreshold(initial=0), "initial|tau"),
    (lambda: AdaptiveThreshold(min_sparsity=0.1, max_sparsity=0.01), "min_sparsity"),
    (lambda: AdaptiveThreshold(max_sparsity=1.5), "max_sparsity"),
    (lambda: AdaptiveThreshold(decay=1.0), "decay"),
    (lambda: TargetSparsityThreshold(sparsity=0), "sparsity"),
    (lambda: FixedThreshold(float("nan")), "tau"),
    (lambda: ResidualClipping(ratio=0.5), "ratio"),
    (lambda: ResidualClipping(frequency=0), "frequency"),
])
def test_bad_settings_are_refused_with_the_rule(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_wrong_types_are_type_errors() -> None:
    with pytest.raises(TypeError, match="expected a number"):
        FixedThreshold("1e-3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exact_count='no'; expected True or False"):
        QuantileThreshold(0.01, exact_count="no")  # type: ignore[arg-type]


def test_target_above_one_sixteenth_warns() -> None:
    with pytest.warns(UserWarning, match="1/16"):
        TargetSparsityThreshold(sparsity=0.1)


def test_state_round_trips_through_pickle_and_state_dict() -> None:
    algorithm = AdaptiveThreshold(initial=1e-3)
    algorithm.update(0.5)
    clone = pickle.loads(pickle.dumps(algorithm))
    assert repr(clone) == repr(algorithm)
    fresh = AdaptiveThreshold()
    fresh.load_state_dict(algorithm.state_dict())
    assert fresh.tau == algorithm.tau
    clip = pickle.loads(pickle.dumps(ResidualClipping(3.0, 2)))
    assert (clip.ratio, clip.frequency) == (3.0, 2)


def test_residual_clipping_clamps_every_frequency_steps_but_not_step_zero() -> None:
    clip = ResidualClipping(ratio=5.0, frequency=5)
    residual = torch.tensor([100.0, -100.0, 3.0])
    clip.process(residual, tau=1.0, step=0)
    assert residual.tolist() == [100.0, -100.0, 3.0]
    clip.process(residual, tau=1.0, step=4)
    assert residual.tolist() == [100.0, -100.0, 3.0]
    clip.process(residual, tau=1.0, step=5)
    assert residual.tolist() == [5.0, -5.0, 3.0]
    assert clip_residual_(torch.tensor([-3.0, 3.0]), 2.0).tolist() == [-2.0, 2.0]
    ResidualPostProcessor().process(residual, 1.0, 5)  # the base class does nothing
    assert residual.tolist() == [5.0, -5.0, 3.0]


@pytest.mark.parametrize("density", [1 / 300, 1e-2])
def test_quantile_threshold_moves_about_density_of_the_elements(density: float) -> None:
    g = torch.Generator().manual_seed(0)
    residual, algorithm, moved = torch.zeros(300_000), QuantileThreshold(density), []
    for step in range(30):
        residual += torch.randn(residual.numel(), generator=g) * 10.0 ** -(step % 3)
        msg = encode(residual, algorithm.choose(residual))
        decode(msg, residual, sign=-1)
        moved.append(msg.moved / residual.numel())
    assert algorithm.calls == 30
    # A sampled quantile: each message within 25% of the target, their mean within 5%.
    assert all(0.75 * density <= m <= 1.25 * density for m in moved), moved
    assert sum(moved) / len(moved) == pytest.approx(density, rel=0.05)


def test_sampled_quantile_is_exact_on_a_full_sample_and_deterministic() -> None:
    v = torch.arange(1.0, 1001.0) * torch.tensor([1.0, -1.0]).repeat(500)
    assert sampled_quantile(v, 0.01, sample=10_000) == 990.0  # 10 elements are >= 990 in size
    picked = [sampled_quantile(v, 0.1, sample=100, offset=k) for k in range(3)]
    assert picked == [sampled_quantile(v, 0.1, sample=100, offset=k) for k in range(3)]
    assert len(set(picked)) == 3, "the offset should move the sample"
    assert sampled_quantile(torch.zeros(50), 0.1, sample=100) == 0.0


@pytest.mark.parametrize("density", [1 / 320, 1 / 160, 1 / 64, 1 / 16, 0.5])
def test_sampled_quantile_is_kthvalue_of_the_sample_with_or_without_nonfinite(
        density: float) -> None:
    g = torch.Generator().manual_seed(7)
    for values in (torch.randn(200_003, generator=g),
                   torch.randn(200_003, generator=g).index_fill_(0, torch.tensor([5, 77]),
                                                                 float("nan")),
                   torch.randn(200_003, generator=g).index_fill_(0, torch.arange(0, 600, 3),
                                                                 float("inf"))):
        picked = values[1::3].abs()  # sample=65536 of 200,003: stride 3, offset 1
        rank = min(picked.numel(), max(1, math.ceil(picked.numel() * (1 - density))))
        expected = float(picked.kthvalue(rank).values)
        got = sampled_quantile(values, density, sample=65536, offset=1)
        assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_quantile_threshold_keeps_its_tau_on_zero_or_nonfinite_residuals() -> None:
    algorithm = QuantileThreshold(0.01, initial=0.5)
    assert algorithm.choose(torch.zeros(1000)) == 0.5
    assert algorithm.choose(torch.full((1000,), float("nan"))) == 0.5
    assert algorithm.choose(torch.full((1000,), 2.0)) == 2.0


def test_quantile_threshold_state_round_trips() -> None:
    algorithm = QuantileThreshold(0.01, sample=1000)
    algorithm.choose(torch.randn(5000))
    fresh = QuantileThreshold(0.01, sample=1000)
    fresh.load_state_dict(algorithm.state_dict())
    assert (fresh.tau, fresh.calls) == (algorithm.tau, 1)
    assert repr(pickle.loads(pickle.dumps(algorithm))) == repr(algorithm)
    assert algorithm.config() == {"type": "QuantileThreshold", "initial": 1e-3,
                                  "density": 0.01, "sample": 1000, "exact_count": False}


@pytest.mark.parametrize("kwargs, match", [
    ({"density": 0}, "density"), ({"density": 1.0}, "density"),
    ({"sample": 8}, "sample"), ({"density": 1e-4, "sample": 1000}, "fewer than 4"),
])
def test_quantile_threshold_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        QuantileThreshold(**kwargs)
