"""The typed protocol between a launcher and its replicas, exercised in this process."""

from __future__ import annotations

import os
import pickle
import queue

import pytest
import torch
from torch import nn

from paraloom.sync.base import NoSync
from paraloom.training.messages import (
    Begin,
    CheckpointReply,
    CheckpointRequest,
    Failed,
    Finish,
    Finished,
    IdleRound,
    IndexRound,
    Pickled,
    Ready,
    Round,
    StepDone,
    Stop,
)
from paraloom.training.optim import OptimizerSpec
from paraloom.training.packing import PackedTensors, unpack_tensors
from paraloom.training.runner import ReplicaRunner, WorkerSpec, pickle_spec
from paraloom.training.transport import pack as _pack
from paraloom.training.worker import WorkerConfig, worker_main


def _boom() -> None:
    raise RuntimeError("cannot rebuild this batch")


class Unloadable:
    """Pickles fine, fails when unpickled (as a batch whose class a worker cannot load)."""

    def __reduce__(self):
        return (_boom, ())


def _spec() -> tuple[WorkerSpec, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return WorkerSpec(model, OptimizerSpec.from_user(opt, model), nn.MSELoss(), None,
                      NoSync()), model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(4, 2), torch.zeros(4, 1)


def _serve(*messages) -> list:
    """Run a worker's loop in this process over ``messages``; its replies, in order."""
    spec, model = _spec()
    tasks, results = queue.Queue(), queue.Queue()
    for m in (Begin(model.state_dict()), *messages, Stop()):
        tasks.put(m)
    cfg = WorkerConfig(rank=0, world_size=1, store_port=0, backend="gloo", device="cpu",
                       threads=torch.get_num_threads(), timeout_s=10.0, parent_pid=os.getppid())
    worker_main(cfg, pickle_spec(spec), tasks, results, [0.0])
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def test_the_worker_loop_answers_each_message_in_order():
    replies = _serve(_pack(Round(0, _batch())), IdleRound(1), CheckpointRequest(7), Finish())
    kinds = [type(r) for r in replies]
    assert kinds == [Ready, StepDone, StepDone, CheckpointReply, Finished]
    assert replies[1].round_id == 0 and replies[1].rows == 4 and replies[1].loss is not None
    assert replies[2].loss is None and replies[2].rows == 0
    assert replies[3].tag == 7 and isinstance(replies[3].state, PackedTensors)
    assert set(unpack_tensors(replies[3].state)) >= {"model", "optimizer", "rng"}
    assert replies[4].result.state is not None  # rank 0 sends the trained parameters


def test_a_batch_that_fails_to_load_is_reported_on_its_own_round():
    good = _pack(Round(0, _batch()))
    bad = _pack(Round(1, (_batch(), Unloadable())))
    replies = _serve(good, bad)
    failed = replies[-1]
    assert isinstance(failed, Failed)
    assert failed.round_id == 1 and "cannot rebuild this batch" in failed.message


def test_an_unknown_message_is_refused_not_ignored():
    spec, _ = _spec()
    runner = ReplicaRunner(spec)
    with pytest.raises(TypeError, match="got a Ready"):
        runner.handle(Ready(0))  # type: ignore[arg-type]


def test_a_pickled_message_must_hold_a_message():
    with pytest.raises(TypeError, match="held a list"):
        Pickled(pickle.dumps([1, 2])).unpack()


def test_messages_are_frozen_and_survive_pickling():
    m = IndexRound(3, [1, 2, 3])
    assert pickle.loads(pickle.dumps(m)) == m
    with pytest.raises(AttributeError):
        m.round_id = 4  # type: ignore[misc]


def test_replica_runner_serves_the_in_process_pool_the_same_way():
    spec, model = _spec()
    runner = ReplicaRunner(spec)
    assert runner.handle(Begin(model.state_dict())) is None
    done = runner.handle(Round(0, _batch()))
    assert isinstance(done, StepDone) and done.synced  # NoSync: every round is in sync
    finished = runner.handle(Finish())
    assert isinstance(finished, Finished) and finished.result.steps == 1
    assert not torch.equal(finished.result.state["weight"], model.state_dict()["weight"])
