"""training_mode resolution: names, the enum, instances, and errors that list the choices."""

from __future__ import annotations

import importlib.util

import pytest

from paraloom.sync.allreduce import AllReduce
from paraloom.sync.compressed import Fp16AllReduce
from paraloom.sync.registry import build_synchronizer, training_modes
from paraloom.sync.sharing import SharedGradients
from paraloom.sync.thresholds import FixedThreshold, ResidualClipping
from paraloom.training.modes import TrainingMode


@pytest.mark.parametrize("mode", ["shared_gradients", "SHARED_GRADIENTS", "shared-gradients",
                                  TrainingMode.SHARED_GRADIENTS])
def test_names_and_enum_resolve(mode) -> None:
    assert isinstance(build_synchronizer(mode), SharedGradients)


def test_aliases_and_allreduce() -> None:
    assert isinstance(build_synchronizer("allreduce"), AllReduce)
    assert isinstance(build_synchronizer("ddp", bucket_cap_mb=5), AllReduce)


def test_options_reach_the_synchronizer_and_none_means_unset() -> None:
    sync = build_synchronizer("shared_gradients", threshold_algorithm=FixedThreshold(1e-3),
                               residual_post_processor=ResidualClipping(), combine=None)
    assert isinstance(sync.threshold_algorithm, FixedThreshold)
    assert isinstance(sync.residual_post_processor, ResidualClipping)
    assert sync.combine == "mean"


def test_an_instance_is_the_custom_mode() -> None:
    sync = Fp16AllReduce()
    assert build_synchronizer(sync) is sync
    with pytest.raises(TypeError, match="constructor"):
        build_synchronizer(sync, threshold_algorithm=FixedThreshold(1e-3))
    with pytest.raises(ValueError, match="instance"):
        build_synchronizer("custom")
    with pytest.raises(TypeError, match=r"Fp16AllReduce\(\.\.\.\)"):
        build_synchronizer(Fp16AllReduce)


def test_unknown_names_and_options_list_what_is_valid() -> None:
    with pytest.raises(ValueError, match="shared_gradients") as info:
        build_synchronizer("gradient_sharing")
    assert "averaging" in str(info.value) and "allreduce" in str(info.value)
    with pytest.raises(TypeError, match="threshold_algorithm"):
        build_synchronizer("shared_gradients", frequency=3)
    with pytest.raises(TypeError, match="training_mode=3"):
        build_synchronizer(3)
    assert set(training_modes()) == {"averaging", "shared_gradients", "allreduce", "diloco",
                                     "custom"}


@pytest.mark.skipif(importlib.util.find_spec("paraloom.sync.averaging") is None,
                    reason="paraloom.sync.averaging is not written yet")
def test_averaging_is_imported_lazily_and_takes_the_wrapper_option_names() -> None:
    sync = build_synchronizer(TrainingMode.AVERAGING, averaging_frequency=3)
    assert type(sync).__name__ == "Averaging"


def test_wrapper_averaging_options_pass_at_defaults_and_fail_otherwise() -> None:
    # ParallelWrapper passes its averaging options whatever the mode (at their defaults).
    sync = build_synchronizer("shared_gradients", averaging_frequency=1, average_updaters=True,
                             threshold_algorithm=FixedThreshold(1e-3))
    assert isinstance(sync, SharedGradients)
    with pytest.raises(TypeError, match="averaging_frequency=5 applies to"):
        build_synchronizer("allreduce", averaging_frequency=5, average_updaters=True)
