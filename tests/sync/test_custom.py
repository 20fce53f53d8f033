"""A custom synchronizer end to end: the shipped fp16 example and the one in the docs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paraloom.sync.base import StepContext, Synchronizer
from paraloom.sync.compressed import Fp16AllReduce

from .replicas import reference_sgd, train

STEPS = 8
DOCS = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "custom-synchronizer.md"


def _fp16_run(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    sync = Fp16AllReduce(dtype)
    out = train(rank, world_size, sync, STEPS, idle={STEPS - 1: [0]})
    out["numel"] = len(out["params"])
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_allreduce_keeps_replicas_identical_and_halves_the_bytes(pool, dtype) -> None:
    a, b = pool.run(_fp16_run, dtype=dtype)
    assert a["digests"] == b["digests"] and a["final"] == b["final"]
    expected = torch.tensor(reference_sgd(2, STEPS, {STEPS - 1: [0]}), dtype=torch.float64)
    got = torch.tensor(a["params"], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=2e-2)  # 16-bit gradients, 8 steps
    assert a["stats"]["bytes_sent_per_step"] == 2 * a["numel"]  # half of float32's 4 bytes


def test_fp16_allreduce_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float16"):
        Fp16AllReduce(torch.float32)


def _docs_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    examples = [b for b in blocks if "class SignAllReduce(Synchronizer)" in b]
    assert examples, f"{DOCS} lost its custom synchronizer example"
    return examples[0]


def _docs_run(rank: int, world_size: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(_docs_example(), str(DOCS), "exec"), namespace)  # noqa: S102 - our own docs
    out = train(rank, world_size, namespace["SignAllReduce"](), STEPS, lr=0.01, seed=0,
                idle={3: [1]})
    out["numel"] = len(out["params"])
    return out


def test_the_docs_example_keeps_replicas_identical_with_a_byte_per_element(pool) -> None:
    a, b = pool.run(_docs_run)
    assert a["digests"] == b["digests"] and a["params"] != a["initial"]
    assert a["stats"]["bytes_sent_per_step"] == a["numel"]  # int8 votes, 2(n-1)/n = 1


def test_the_docs_example_runs_in_one_process() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(_docs_example(), str(DOCS), "exec"), namespace)  # noqa: S102 - our own docs
    sync = namespace["SignAllReduce"]()
    assert isinstance(sync, Synchronizer)
    model = nn.Linear(3, 1)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    sync.setup(ctx)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        sync.before_step(ctx)
        sync.after_backward(ctx)
        ctx.optimizer.step()
        sync.after_step(ctx)
    sync.idle_step(ctx)
    sync.finish(ctx)
    assert sync.stats()["bytes_sent"] == 0 and sync.sync_steps == 4


class _NoIdle(Synchronizer):
    name = "no_idle"

    def after_backward(self, ctx: StepContext) -> None:
        pass


class _WithIdle(_NoIdle):
    def idle_step(self, ctx: StepContext) -> None:
        pass


def test_a_synchronizer_with_step_hooks_but_no_idle_step_is_warned_about_where_it_is_built():
    """Without idle_step, a replica idle in a short last round hung its peers until
    step_timeout (300 s by default), with nothing naming the cause."""
    from paraloom import ParallelWrapper

    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="_NoIdle overrides after_backward but not idle_step") \
            as caught:
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), training_mode=_NoIdle(),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2)
    assert caught[0].filename == __file__  # points at the user's line
    with warnings.catch_warnings():  # one replica has no peers to hang
        warnings.simplefilter("error")
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), training_mode=_NoIdle(),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), training_mode=_WithIdle(),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2)


def test_the_idle_step_warning_names_the_user_line_through_early_stopping_and_spark():
    """Raised where the wrapper is built, several calls deep: the warning still names the
    user's line; Spark's SharedTrainingMaster(synchronizer=) gets it too."""
    from paraloom import EarlyStoppingConfig, EarlyStoppingParallelTrainer
    from paraloom.early_stopping import MaxEpochs
    from paraloom.spark import SharedTrainingMaster

    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="_NoIdle overrides") as caught:
        EarlyStoppingParallelTrainer(
            EarlyStoppingConfig(epoch_conditions=[MaxEpochs(1)],
                                score_calculator=lambda m: 0.0), model,
            [(torch.randn(2, 4), torch.tensor([0, 1]))], loss_fn=nn.CrossEntropyLoss(),
            training_mode=_NoIdle(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            workers=2)
    assert [w.filename for w in caught] == [__file__]
    with pytest.warns(UserWarning, match="_NoIdle overrides") as caught:
        SharedTrainingMaster(batch_size_per_worker=8, workers=2, synchronizer=_NoIdle())
    assert [w.filename for w in caught] == [__file__]


def test_warn_names_the_first_frame_outside_paraloom():
    from paraloom import ParallelInference
    from paraloom._warnings import warn

    def here() -> None:
        warn("deep")  # a test module is outside paraloom: this line is named
    with pytest.warns(UserWarning, match="deep") as caught:
        here()
    assert (caught[0].filename, caught[0].lineno) == (__file__, here.__code__.co_firstlineno + 1)
    with pytest.warns(UserWarning, match="max_wait_ms only applies") as caught:
        ParallelInference(nn.Linear(4, 2), inference_mode="sequential", max_wait_ms=5).close()
    assert [w.filename for w in caught] == [__file__]  # three calls deep in paraloom
