"""The Spark package's pure parts, without a cluster: state bytes, data plans, rendezvous,
the barrier task under a fake context, the averaging task, metrics and the stats page."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from spark_helpers import read_page
from torch import nn

from paraloom.spark.data import Features, batch_count, join_chunks
from paraloom.spark.data.partitions import chunk_rows
from paraloom.spark.evaluation.metrics import RegressionEvaluation, merge_evaluations
from paraloom.spark.runtime.state import (
    flatten,
    pack,
    split_optimizer_state,
    state_digest,
    unflatten,
    unpack,
)
from paraloom.spark.stats import PHASES, TimedSynchronizer, TrainingStats, split_round
from paraloom.spark.training.averaging_task import (
    AveragingRound,
    add_results,
    averaging_task,
    weighted,
)
from paraloom.spark.training.board import ErrorBoard, settle
from paraloom.spark.training.messages import WorkerFailed, WorkerFinished, WorkerRerun
from paraloom.spark.training.rendezvous import bounded_call, local_rank, meet, task_host
from paraloom.spark.training.shared_task import SharedConfig, checkpoint_path, shared_task
from paraloom.spark.training.task import pickle_spec
from paraloom.sync.base import NoSync
from paraloom.sync.sharing import SharedGradients
from paraloom.training.optim import OptimizerSpec
from paraloom.training.runner import WorkerSpec


def _trained_optimizer(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.9)) if kind == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_pack_round_trips_model_and_optimizer_state(kind):
    model, opt = _trained_optimizer(kind)
    data = pack(model.state_dict(), opt.state_dict(), {"epoch": 3})
    back = unpack(data)
    assert back.meta == {"epoch": 3}
    assert state_digest(back.model) == state_digest(model.state_dict())
    fresh = type(opt)(model.parameters(), lr=1.0)
    fresh.load_state_dict(back.optimizer)  # a real optimizer accepts it
    for p in model.parameters():
        for key, value in opt.state[p].items():
            torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_layout_is_the_same_whatever_the_dicts_order(kind):
    # Averaging sums replicas' optimizer vectors; their layouts must match key for key.
    model, opt = _trained_optimizer(kind)
    state = opt.state_dict()
    shuffled = {"state": {i: dict(reversed(list(v.items())))
                          for i, v in reversed(list(state["state"].items()))},
                "param_groups": state["param_groups"]}
    assert flatten(split_optimizer_state(state)[0])[1] == \
        flatten(split_optimizer_state(shuffled)[0])[1]
    again = unpack(pack(model.state_dict(), shuffled)).optimizer
    assert list(split_optimizer_state(again)[0]) == list(split_optimizer_state(state)[0])


def test_unpack_refuses_foreign_bytes():
    from safetensors.torch import save

    with pytest.raises(ValueError, match="no paraloom header"):
        unpack(save({"w": torch.zeros(2)}))


def test_digest_sees_one_changed_bit():
    state = {"w": torch.ones(3), "n": torch.tensor(2)}
    other = {"w": torch.ones(3).clone(), "n": torch.tensor(2)}
    assert state_digest(state) == state_digest(other)
    other["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert state_digest(state) != state_digest(other)


def test_flatten_round_trips_dtypes_and_shapes():
    tensors = {"w": torch.randn(2, 3), "count": torch.tensor(7), "d": torch.randn(4).double()}
    vector, layout = flatten(tensors)
    assert vector.dtype == np.float64 and vector.size == 11
    back = unflatten(vector, layout)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    with pytest.raises(ValueError, match="layout"):
        unflatten(np.zeros(12), layout)
    # A complex tensor kept its real parts only (1+2j came back 1+0j after every averaging).
    for complex_dtype in (torch.complex64, torch.complex128):
        phase = torch.tensor([[1 + 2j, 3 - 4j]], dtype=complex_dtype)
        vector, layout = flatten({"phase": phase, "w": torch.randn(3)})
        assert vector.size == 7
        back = unflatten(vector, layout)["phase"]
        assert back.dtype == complex_dtype and torch.equal(back, phase)


def test_chunks_stack_rows_in_the_order_given():
    keyed = [((i % 3, i), (np.full(2, i, np.float32), i)) for i in range(10)]
    chunks = list(chunk_rows(keyed, size=4))
    assert [len(c[1]) for c in chunks] == [4, 4, 2]
    x, y = join_chunks(chunks)
    assert y.tolist() == list(range(10)) and x[:, 0].tolist() == list(range(10))


def test_batch_count():
    assert batch_count(10, 4) == 3 and batch_count(8, 4) == 2 and batch_count(0, 4) == 0


def test_features_reshape_and_dtypes():
    f = Features((1, 2, 2), "float32")
    x = f.features(np.arange(8, dtype=np.float64).reshape(2, 4))
    assert x.shape == (2, 1, 2, 2) and x.dtype == torch.float32
    assert f.labels(np.array([1, 2])).dtype == torch.int64
    assert f.labels(np.array([0.5])).dtype == torch.float32
    assert Features(label_dtype="int64").labels(np.array([1.0])).dtype == torch.int64
    with pytest.raises(ValueError, match="feature_shape"):
        Features((3, 3)).features(np.zeros((2, 4), np.float32))


def test_task_host_and_local_rank():
    assert task_host("10.0.0.5:40123") == "10.0.0.5"
    assert task_host("[::1]:7077") == "::1"
    with pytest.raises(ValueError, match="host:port"):
        task_host("no-port")
    addresses = ["a:1", "b:1", "a:2", "a:3"]
    assert [local_rank(addresses, r) for r in range(4)] == [(0, 3), (0, 1), (1, 3), (2, 3)]


def test_bounded_call_gives_up_in_time():
    gate = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rendezvous"):
        bounded_call(lambda: gate.wait(30), 0.3, "the rendezvous")
    assert time.monotonic() - start < 5
    gate.set()
    assert bounded_call(lambda: 42, 5, "x") == 42
    with pytest.raises(KeyError):
        bounded_call(lambda: {}["missing"], 5, "x")


class FakeBarrier:
    """A one-task barrier context: what shared_task needs from BarrierTaskContext."""

    def __init__(self) -> None:
        self.calls = 0

    def partitionId(self) -> int:  # noqa: N802 (Spark's name)
        return 0

    def getTaskInfos(self) -> list:  # noqa: N802
        return [SimpleNamespace(address="127.0.0.1:7077")]

    def allGather(self, message: str) -> list[str]:  # noqa: N802
        self.calls += 1
        return [message]


def test_meet_reports_setup_errors():
    rdv, store = meet(FakeBarrier(), "ValueError: bad rows", 10)
    assert rdv.errors == ((0, "ValueError: bad rows"),)
    assert rdv.port == store.port > 0 and rdv.run_id


def test_error_board_relays_causes_and_reraises_dead_peers():
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    boards = [ErrorBoard(store, r, 3, "run1") for r in range(3)]
    assert boards[0].causes(wait_s=0.1) == []
    own = settle(ValueError("bad row 7"), boards[2], rank=2, linger_s=0.1)
    assert isinstance(own, WorkerFailed) and own.symptom is False
    dead = RuntimeError("[gloo] Read error: Connection reset by peer")
    info = settle(dead, boards[1], rank=1, linger_s=0.1)
    assert (type(info), info.rank, info.cause_rank, info.symptom) == (WorkerFailed, 1, 2, True)
    assert info.message == "ValueError: bad row 7" and "bad row 7" in info.traceback
    lonely = ErrorBoard(store, 1, 3, "run2")  # another stage attempt: nothing posted there
    with pytest.raises(RuntimeError, match="reset by peer"):
        settle(dead, lonely, rank=1, linger_s=0.1)
    with pytest.raises(RuntimeError, match="reset by peer"):
        settle(dead, None, rank=1)


def test_a_partial_rerun_reports_instead_of_waiting():
    cfg = SharedConfig(fit_id="partial", world_size=2, epochs=1, batch_size=8, seed=0,
                       origin=time.time(), features=Features(), rendezvous_timeout_s=5)
    context = FakeBarrier()
    [record] = list(shared_task(b"", b"", cfg, context, _chunk(8)))
    assert (type(record), record.rank, context.calls) == (WorkerRerun, 0, 0)


def _linear_spec(sync) -> tuple[WorkerSpec, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return WorkerSpec(model, OptimizerSpec.from_user(opt, model), nn.CrossEntropyLoss(), None,
                      sync), model


def _chunk(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, 4)).astype(np.float32)
    return [(x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0))]


@pytest.mark.timeout(120)
def test_barrier_task_trains_checkpoints_and_resumes(tmp_path):
    spec, model = _linear_spec(SharedGradients())
    cfg = SharedConfig(fit_id="unit", world_size=1, epochs=3, batch_size=8, seed=0,
                       origin=time.time(), features=Features(), timeout_s=30,
                       rendezvous_timeout_s=30, checkpoint_dir=str(tmp_path),
                       checkpoint_every=4, collect_stats=True)
    state = pack(model.state_dict())
    context = FakeBarrier()
    [record] = list(shared_task(pickle_spec(spec), state, cfg, context, _chunk(40)))
    assert isinstance(record, WorkerFinished)
    info = record.report
    assert (record.rank, context.calls) == (0, 1)  # exactly one allGather
    assert info.steps == 15 and info.samples == 120 and info.resumed_from_step is None
    losses = [info.losses[e][0] / info.losses[e][1] for e in range(3)]
    assert losses[-1] < losses[0]
    rounds = info.stats["rounds"]
    assert len(rounds["start"]) == 15 and set(PHASES) <= set(rounds)
    assert sum(rounds["compute"]) > 0
    final = unpack(record.state)
    assert state_digest(final.model) == info.digest != state_digest(model.state_dict())
    assert checkpoint_path(str(tmp_path), "unit").exists()
    # A re-run of the same fit (Spark's retry) starts from the checkpoint: nothing left to do.
    [again] = list(shared_task(pickle_spec(spec), state, cfg, FakeBarrier(), _chunk(40)))
    assert isinstance(again, WorkerFinished)
    assert again.report.resumed_from_step == 15 and again.report.steps == 0
    assert state_digest(unpack(again.state).model) == info.digest


@pytest.mark.timeout(60)
def test_barrier_task_reports_a_bad_spec_without_hanging():
    cfg = SharedConfig(fit_id="bad", world_size=1, epochs=1, batch_size=8, seed=0,
                       origin=time.time(), features=Features(), rendezvous_timeout_s=10)
    [record] = list(shared_task(b"not a pickle", pack({}), cfg, FakeBarrier(), _chunk(8)))
    assert isinstance(record, WorkerFailed) and record.rank == 0
    assert "UnpicklingError" in record.message or "pickle" in record.message + record.traceback


def test_averaging_tasks_average_weighted_by_examples():
    spec, model = _linear_spec(NoSync())
    spec_bytes, state = pickle_spec(spec), pack(model.state_dict())
    cfg = AveragingRound(fit_id="avg-unit", epoch=0, index=0, batch_size=8, frequency=5,
                         seed=0, origin=time.time(), features=Features(), save_updater=True)
    [big] = list(averaging_task(spec_bytes, state, cfg, 0, _chunk(40, seed=1)))
    [small] = list(averaging_task(spec_bytes, state, cfg, 1, _chunk(8, seed=2)))
    assert (big.n, small.n, big.steps, small.steps) == (40, 8, 5, 1)
    p0, p1 = big.model.astype(np.float64), small.model.astype(np.float64)
    assert not np.allclose(p0, p1)
    total = weighted(add_results(add_results(None, big), small))
    np.testing.assert_allclose(total.model / total.n, (40 * p0 + 8 * p1) / 48, rtol=1e-12)
    later = AveragingRound(**{**cfg.__dict__, "index": 1})
    [idle] = list(averaging_task(spec_bytes, state, later, 1, _chunk(8, seed=2)))
    assert idle.n == 0 and add_results(total, idle).n == 48


def test_regression_evaluation_matches_numpy_and_merges():
    g = torch.Generator().manual_seed(0)
    pred, true = torch.randn(50, 2, generator=g), torch.randn(50, 2, generator=g)
    whole = RegressionEvaluation(2)
    whole.update(pred, true)
    parts = [RegressionEvaluation(2) for _ in range(2)]
    parts[0].update(pred[:20], true[:20])
    parts[1].update(pred[20:], true[20:])
    merged = merge_evaluations(merge_evaluations(None, parts[0]), parts[1])
    p, t = pred.double().numpy(), true.double().numpy()
    mse = ((p - t) ** 2).mean(0)
    r2 = 1 - mse / t.var(0)
    for m in (whole.metrics(), merged.metrics()):
        assert m["count"] == 50
        np.testing.assert_allclose(m["mse"], mse.mean(), rtol=1e-10)
        np.testing.assert_allclose(m["mae"], np.abs(p - t).mean(), rtol=1e-10)
        np.testing.assert_allclose(m["r2"], r2.mean(), rtol=1e-8)
    with pytest.raises(ValueError, match=r"column\(s\) per row"):
        whole.update(pred, true[:, :1])


def test_timed_synchronizer_delegates_and_splits_rounds():
    inner = SharedGradients()
    timed = TimedSynchronizer(inner)
    assert timed.name == "shared_gradients" and timed.bytes_sent == 0
    assert timed.stats() == inner.stats()
    copy_ = __import__("copy").deepcopy(timed)
    assert isinstance(copy_.inner, SharedGradients) and copy_.inner is not inner
    phases = split_round(1.0, {"sync": 0.4, "encode": 0.1, "communicate": 0.2}, idle=False)
    assert phases == pytest.approx({"compute": 0.6, "encode": 0.1, "communicate": 0.2,
                                    "apply": 0.1})
    assert split_round(0.5, {"sync": 0.5, "encode": 0, "communicate": 0.5}, True) == \
        {"wait": 0.5}


def test_every_synchronizer_hook_of_a_timed_synchronizer_reaches_the_wrapped_one():
    """Hooks added to the base class reach the wrapped synchronizer without being listed
    (a Spark checkpoint once saved rank 0's local view because two were not)."""
    import inspect

    from paraloom.sync.base import Synchronizer

    hooks = [name for name, member in vars(Synchronizer).items()
             if not name.startswith("_") and inspect.isfunction(member)]
    calls = []

    def recording(name):
        def method(self, *args):
            calls.append((name, args))
            return name
        return method

    Recording = type("Recording", (Synchronizer,), {name: recording(name) for name in hooks})
    timed = TimedSynchronizer(Recording())
    for i, name in enumerate(hooks):
        arity = len(inspect.signature(getattr(Synchronizer, name)).parameters) - 1
        args = tuple(range(i, i + arity))
        result = getattr(timed, name)(*args)
        assert calls[-1] == (name, args), name
        if name not in ("setup", "after_step", "idle_step"):  # timed: they return None
            assert result == name
    assert {"abort_step", "shared_parameters", "config", "state_dict"} <= set(hooks)


def test_timed_synchronizer_runs_step_fn_the_inner_synchronizers_way():
    """AllReduce runs a step_fn on the user's module inside DDP: timing must not bypass it."""
    from paraloom.sync.base import StepContext, Synchronizer

    class Unwrapping(Synchronizer):
        def run_step_fn(self, step_fn, module, batch, ctx):
            return step_fn(ctx.model, batch) * 2

    model = torch.nn.Linear(1, 1)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    loss = TimedSynchronizer(Unwrapping()).run_step_fn(
        lambda m, b: seen.append(m) or torch.tensor(float(b)), torch.nn.Identity(), 3, ctx)
    assert seen == [model] and loss.item() == 6.0


def test_stats_page_from_synthetic_rounds(tmp_path):
    n = 2500  # more rounds than bars: the page buckets them
    rounds = {"start": [i * 0.01 for i in range(n)], **{p: [0.001] * n for p in PHASES}}
    stats = TrainingStats("test", [{"rank": 0, "host": "h", "pid": 1, "rounds": rounds,
                                    "events": [{"name": "rendezvous", "start": 0.0,
                                                "duration": 1.0}]}],
                          [{"name": "job", "start": 0.0, "duration": 25.0}], {"workers": 1})
    text, page = read_page(stats.export_html(tmp_path / "s.html"))
    assert set(page.timelines) == {"0", "driver"}
    assert 1000 < page.timelines["0"] <= 1000 * len(PHASES) + 1
    assert "script" not in page.tags and page.urls == [] and "http" not in text
    assert json.loads((stats.export_json(tmp_path / "s.json")).read_text())["phase_totals"][
        "0"]["compute"] == pytest.approx(n * 0.001)


def test_a_cluster_master_with_local_checkpoints_is_warned_about_once():
    import warnings

    from paraloom.spark import SharedTrainingMaster

    master = SharedTrainingMaster(batch_size_per_worker=8, workers=2)
    with pytest.warns(UserWarning, match="checkpoint_dir is not set.*spark://host:7077"):
        master._local_checkpoint_dir("spark://host:7077")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        master._local_checkpoint_dir("spark://host:7077")  # once is enough
        SharedTrainingMaster(batch_size_per_worker=8, workers=2)._local_checkpoint_dir("local[2]")


def test_the_shared_master_takes_a_sharing_recipe_as_it_is():
    from paraloom import FixedThreshold, SharingRecipe
    from paraloom.spark import SharedTrainingMaster

    recipe = SharingRecipe("dl4j", FixedThreshold(1e-3), combine="mean")
    master = SharedTrainingMaster(batch_size_per_worker=8, workers=2, recipe=recipe)
    assert master.synchronizer.recipe is recipe
    assert master.synchronizer.residual_post_processor is None  # as given, not Spark DL4J's
    by_name = SharedTrainingMaster(batch_size_per_worker=8, workers=2, recipe="dl4j")
    assert by_name.synchronizer.config()["residual_post_processor"] == {
        "type": "ResidualClipping", "ratio": 5.0, "frequency": 5}
    with pytest.raises(TypeError, match="beside recipe=SharingRecipe"):
        SharedTrainingMaster(batch_size_per_worker=8, workers=2, recipe=recipe,
                             residual_post_processor=None)


@pytest.mark.parametrize(("cause", "fix"), [
    ("RuntimeError: expected scalar type Long but found Float", "label_dtype=torch.long"),
    ("RuntimeError: expected scalar type Long but found Double", "label_dtype=torch.long"),
    ("RuntimeError: Expected tensor for argument #1 'indices' to have one of the following "
     "scalar types: Long, Int; but got torch.FloatTensor instead (while checking arguments "
     "for embedding)", "feature_dtype=torch.long"),
    ("IndexError: Target 6 is out of bounds.", "class labels must be 0 .. classes - 1"),
    ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x3 and 4x2)", None),
    ("RuntimeError: Expected floating point type for target with class probabilities, got Long",
     "store the label column as array<float>"),
])
def test_a_worker_error_names_the_dtype_fix_when_that_is_what_failed(cause, fix):
    from paraloom.spark.model import _label_hint

    hint = _label_hint(cause)
    assert (fix in hint) if fix else hint == ""


def test_root_cause_keeps_the_python_errors_own_lines_not_the_jvms() -> None:
    from paraloom.spark.training.jobs import root_cause

    text = ("py4j.protocol.Py4JJavaError: An error occurred\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
            "paraloom.training.step_checks.BatchError: ValueError: bad batch\n"
            "(on a batch with inputs float32 (1, 8))\nA minibatch of one row: drop it\n\n"
            "\tat org.apache.spark.api.python.BasePythonRunner.read(PythonRunner.scala:1)\n"
            "\tat java.base/java.lang.Thread.run(Thread.java:1)\n")
    assert root_cause(text).splitlines() == [
        "paraloom.training.step_checks.BatchError: ValueError: bad batch",
        "(on a batch with inputs float32 (1, 8))", "A minibatch of one row: drop it"]


def test_root_cause_of_a_job_spark_refused_is_its_exception_not_a_frame() -> None:
    from paraloom.spark.training.jobs import root_cause

    text = ("py4j.protocol.Py4JJavaError: An error occurred while calling o1.collect.\n"
            ": org.apache.spark.scheduler.BarrierJobUnsupportedRDDChainException: "
            "[SPARK-24820][SPARK-24821]: Barrier execution mode does not allow ...\n"
            "\tat org.apache.spark.scheduler.DAGScheduler.checkBarrierStageWithRDDChainPattern"
            "(DAGScheduler.scala:1)\n\tat java.base/java.lang.Thread.run(Thread.java:840)\n")
    assert root_cause(text) == (
        "org.apache.spark.scheduler.BarrierJobUnsupportedRDDChainException: "
        "[SPARK-24820][SPARK-24821]: Barrier execution mode does not allow ...")
    frames_only = "\tat org.apache.Foo(Foo.scala:1)\n\tat java.base/Thread.run(Thread.java:1)"
    assert root_cause(frames_only) == "at java.base/Thread.run(Thread.java:1)"


def test_rdd_values_of_decimals_train_as_numbers_and_nulls_or_text_are_named():
    """df.rdd of a decimal column gives Decimal objects: torch failed on numpy's object array
    ("can't convert np.ndarray of type numpy.object_"), naming neither the cause nor the fix."""
    from decimal import Decimal

    from paraloom.spark.data.rows import to_array

    assert to_array((Decimal("1.5"), 2.0)).tolist() == [1.5, 2.0]  # beside a double column
    got = to_array([Decimal("1.5"), Decimal("2")])
    assert got.dtype == np.float64 and got.tolist() == [1.5, 2.0]
    assert to_array(Decimal("3")).tolist() == 3.0
    for bad, kinds in (([1.0, None], "['NoneType', 'float']"), (["a", "b"], "['str_']")):
        with pytest.raises(TypeError, match=re.escape(kinds) + ".*cast or fill the column"):
            to_array(bad)


def test_a_null_inside_an_array_is_named_with_a_fix_that_removes_it():
    """It read "drop or fill them first (df.na.drop() / df.na.fill())", which leave a null
    element of an array in place."""
    import pyarrow as pa

    from paraloom.spark.data.arrow import arrow_column

    with pytest.raises(ValueError, match=r"1 null element\(s\) inside its arrays.*F\.exists"):
        arrow_column(pa.array([[0.1, None], [0.2, 0.3]]), "features")
    with pytest.raises(ValueError, match=r"1 null value\(s\).*df\.na\.drop\(\)"):
        arrow_column(pa.array([[0.1, 0.2], None]), "features")
