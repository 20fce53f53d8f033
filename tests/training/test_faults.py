"""Fault injection: a worker that raises, exits, is killed or stopped mid-fit.

With max_failures=0 the fit ends with a WorkerError, quickly and with no worker left behind;
with max_failures=1 it completes, and its parameters equal those of an uninterrupted run with
the same seed and data order (every mode: the pool restarts from a full restore point of every
replica and replays the rounds since).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fault_helpers import HOWS, FailOnce, FailWhenArmed, digits_loader
from torch import nn
from training_helpers import pid_alive

from paraloom import ParallelWrapper, TrainingListener, WorkerError
from paraloom.training import recovery

pytestmark = pytest.mark.timeout(60)  # a broken recovery fails in a minute, not 300 s


class Failures(TrainingListener):
    def __init__(self) -> None:
        self.seen: list[tuple[int | None, str, bool]] = []

    def on_worker_failure(self, rank, error, recovered):
        self.seen.append((rank, type(error).__name__, recovered))


class Pids(TrainingListener):
    """The worker (and spare) process ids at each iteration."""

    def __init__(self) -> None:
        self.wrapper: ParallelWrapper | None = None
        self.workers: list[list[int]] = []
        self.spares: set[int] = set()

    def on_fit_start(self, w):
        self.wrapper = w

    def on_iteration(self, iteration, epoch, loss):
        assert self.wrapper is not None
        self.workers.append(self.wrapper.worker_pids)
        self.spares.update(self.wrapper._pool.spare_pids)  # type: ignore[union-attr]

    def kept_and_replaced(self) -> tuple[set[int], set[int]]:
        """Ranks whose process stayed the whole fit, and ranks whose process changed."""
        first, last = self.workers[0], self.workers[-1]
        return ({r for r in range(len(first)) if first[r] == last[r]},
                {r for r in range(len(first)) if first[r] != last[r]})


def _train(model: nn.Module, mode: str, epochs: int = 2, resume_from=None, workers: int = 2,
           **options) -> tuple[ParallelWrapper, dict]:
    torch.manual_seed(0)
    options = {**{"averaging": {"averaging_frequency": 3},
                  "diloco": {"sync_every": 4, "density": 0.1}}.get(mode, {}), **options}
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              workers=workers, training_mode=mode, progress=False, **options)
    with wrapper:
        stats = wrapper.fit(digits_loader(), epochs=epochs, resume_from=resume_from)
    return wrapper, stats


def _reference(mode: str, **options) -> nn.Module:
    torch.manual_seed(1)
    model = FailOnce()
    _train(model, mode, **options)
    return model


@pytest.fixture(scope="module")
def references() -> dict[str, nn.Module]:
    return {}


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values(), strict=True))


@pytest.mark.parametrize("how", HOWS)
def test_a_failure_without_max_failures_raises_quickly_and_leaves_no_worker(tmp_path, how):
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how=how, at=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    failures = Failures()
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              workers=2, training_mode="allreduce", progress=False,
                              heartbeat_timeout=1.0, listeners=[failures])
    pids: list[int] = []

    class Pids(TrainingListener):
        def on_fit_start(self, w):
            pids.extend(w.worker_pids)

    wrapper.listeners.append(Pids())
    started = time.monotonic()
    expected = {"raise": "injected failure", "exit": "exited with code 0",
                "kill": "SIGKILL", "stop": "no heartbeat"}[how]
    with pytest.raises(WorkerError, match=expected) as info:
        wrapper.fit(digits_loader(), epochs=3)
    assert time.monotonic() - started < 30
    assert info.value.worker == 1
    # Its 4th round (0-based: 3), whichever way it failed; rank 1 trains batch 2 * 3 + 1.
    assert info.value.batch == 3 and str(info.value).endswith("(at epoch 0, batch 7)")
    assert failures.seen == [(1, "WorkerError", False)]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _PidRecording(torch.utils.data.Dataset):
    """Digits, each loader process writing its pid into ``folder`` when it loads a row."""

    def __init__(self, folder: str) -> None:
        self.data, self.folder = digits_loader().dataset, folder

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        open(os.path.join(self.folder, str(os.getpid())), "w").close()
        return self.data[i]


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_failed_workers_dataloader_processes_go_with_it(tmp_path, how):
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how=how, at=4)
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              workers=2, training_mode="allreduce", progress=False)
    (tmp_path / "pids").mkdir()
    loader = torch.utils.data.DataLoader(_PidRecording(str(tmp_path / "pids")), batch_size=32,
                                         num_workers=1)
    with pytest.raises(WorkerError):
        wrapper.fit(loader, epochs=3)
    loaders = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(loaders) == 2  # one loader process per worker
    deadline = time.monotonic() + 1.5  # an orphan's own check of its parent takes 5 s
    while any(pid_alive(p) for p in loaders) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in loaders)


@pytest.mark.parametrize("spares", [1, 0])
@pytest.mark.parametrize("how", HOWS)
def test_allreduce_recovers_to_the_uninterrupted_result(tmp_path, how, spares, references):
    references.setdefault("allreduce", _reference("allreduce"))
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how=how, at=7)
    failures, pids = Failures(), Pids()
    _, stats = _train(model, "allreduce", max_failures=1, heartbeat_timeout=1.0,
                      listeners=[failures, pids], spares=spares)
    assert (tmp_path / "failed").exists()  # the failure did happen
    assert failures.seen == [(1, "WorkerError", True)]
    assert pids.kept_and_replaced() == ({0}, {1})  # the survivor kept its process
    assert stats["failures"] == 1 and stats["seconds_lost"] > 0
    if how == "stop":  # the wait for the frozen worker to be found counts (it was left out)
        assert stats["seconds_lost"] >= 1.0
    assert stats["batches"] == 2 * len(digits_loader())  # every batch once in the caller's count
    assert _same(model, references["allreduce"])


@pytest.mark.parametrize("mode", ["averaging", "shared_gradients", "shared_gradients+blocking",
                                  "diloco"])
def test_other_modes_recover_from_a_restore_point(tmp_path, mode, monkeypatch, references):
    name, _, blocking = mode.partition("+")
    extra = {"overlap": False} if blocking else {}  # by default they save an exchange too
    references.setdefault(mode, _reference(name, **extra))
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 0.0)  # a restore point every round
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how="kill", at=20)
    pids = Pids()
    _, stats = _train(model, name, max_failures=1, listeners=[pids], **extra)
    assert stats["failures"] == 1
    assert pids.kept_and_replaced() == ({0}, {1})
    assert _same(model, references[mode])


@pytest.mark.parametrize("how", ["raise", "stop"])
def test_three_workers_keep_both_survivors(tmp_path, how):
    # The survivors' collectives end in errors once the failed worker dies, a survivor waiting
    # on another survivor's part included; the group forms again with a spare as worker 1.
    torch.manual_seed(1)
    reference = FailOnce()
    _train(reference, "allreduce", workers=3)
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how=how, at=6)
    pids = Pids()
    _, stats = _train(model, "allreduce", workers=3, max_failures=1, heartbeat_timeout=1.0,
                      listeners=[pids])
    assert stats["failures"] == 1
    assert pids.kept_and_replaced() == ({0, 2}, {1})
    assert _same(model, reference)


@pytest.mark.parametrize("second_fit", [False, True])
def test_three_workers_restored_mid_fit_sum_as_the_lost_ones_did(tmp_path, monkeypatch,
                                                                 second_fit):
    # With three workers DDP's bucket layout sets the order in which each gradient's parts
    # are added: the new group's DDPs must start with the layout the lost ones had settled on
    # (from the restore point, or from what the replicas carried over from the first fit).
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 0.0)  # a restore point every round

    def two_fits(model: nn.Module, **options) -> list:
        torch.manual_seed(0)
        failures = Failures()
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             workers=3, training_mode="allreduce", progress=False,
                             listeners=[failures], **options) as wrapper:
            wrapper.fit(digits_loader(), epochs=2)
            (tmp_path / "armed").touch()
            wrapper.fit(digits_loader(batch_size=16), epochs=1)
        return failures.seen

    torch.manual_seed(1)
    reference = FailOnce()
    two_fits(reference)
    (tmp_path / "armed").unlink()
    torch.manual_seed(1)
    # 8 rounds an epoch: round 12 of the first fit, or round 3 of the second
    model = FailWhenArmed(tmp_path / "failed", tmp_path / "armed", at=3) if second_fit \
        else FailOnce(tmp_path / "failed", how="kill", at=12)
    assert two_fits(model, max_failures=1, heartbeat_timeout=1.0) == [(1, "WorkerError", True)]
    assert _same(model, reference)


def test_failures_beyond_max_failures_raise(tmp_path):
    class FailTwice(FailOnce):
        def forward(self, x):
            if self.training and self.calls == 3 and self.marker is not None \
                    and torch.distributed.get_rank() == 0:
                raise RuntimeError("always fails here")
            self.calls += 1
            return self.net(x)

    model = FailTwice(tmp_path / "never-used")
    failures = Failures()
    with pytest.raises(WorkerError, match="always fails here"):
        _train(model, "allreduce", max_failures=2, listeners=[failures])
    assert [s[2] for s in failures.seen] == [True, True, False]


def test_a_slow_healthy_step_is_not_a_failure():
    """A step far longer than heartbeat_timeout: the heartbeat thread keeps beating."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def slow(m, batch):
        time.sleep(1.5)
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    wrapper = ParallelWrapper(model, step_fn=slow, optimizer=torch.optim.SGD(model.parameters(),
                                                                             lr=0.1),
                              workers=2, training_mode="allreduce", progress=False,
                              heartbeat_timeout=0.5)
    with wrapper:
        stats = wrapper.fit(list(digits_loader(rows=128, batch_size=32)), epochs=1)
    assert stats["batches"] == 4 and stats["failures"] == 0


def test_step_timeout_names_a_hung_worker():
    from training_helpers import stuck_on_rank_one

    model = nn.Linear(4, 1)
    # Averaging rarely: rank 0 keeps training, so only rank 1 is silent (in allreduce mode
    # rank 0 would wait for it inside the collective, and both would be silent).
    wrapper = ParallelWrapper(model, step_fn=stuck_on_rank_one,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2,
                              averaging_frequency=1000, progress=False, step_timeout=2.0)
    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(40)]
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 has answered nothing .*step_timeout"):
        wrapper.fit(batches)
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("mode", ["allreduce", "averaging"])
def test_step_timeout_finds_a_hang_mid_epoch_while_the_parent_deals(mode):
    """Rank 1 hangs at its 30th of 100 steps: the parent, blocked putting rounds into its
    full queue, never checked step_timeout there, so the fit waited for the hang (or for the
    collectives' timeout, 300 s by default, then named worker 0's gloo timeout)."""
    from torch.utils.data import DataLoader, TensorDataset
    from training_helpers import HangsOnRankOne

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3200, 8, generator=g)
    model = HangsOnRankOne()
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              training_mode=mode, progress=False, heartbeat_timeout=1.0,
                              step_timeout=2.0, timeout=60,
                              prefetch_buffer=2)  # queues of 2: the parent soon blocks dealing
    started = time.monotonic()
    with wrapper, pytest.raises(WorkerError, match=r"worker 1 has answered nothing .*step_t"):
        wrapper.fit(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16), 2)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("mode", ["allreduce", "shared_gradients"])
def test_step_timeout_names_the_hung_worker_not_the_peer_waiting_for_it(mode):
    """Rank 1 hangs in its step while rank 0 waits for it in a collective: both are silent,
    and rank 1, which never got to its loss, is the one named."""
    from training_helpers import stuck_on_rank_one

    model = nn.Linear(4, 1)
    wrapper = ParallelWrapper(model, step_fn=stuck_on_rank_one,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2,
                              training_mode=mode, progress=False, step_timeout=2.0)
    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(40)]
    with pytest.raises(WorkerError, match=r"worker 1 has answered nothing .*in the model or the "
                                          r"loss .*never got to this round's loss.*\[0\] were "
                                          r"waiting") as failed:
        wrapper.fit(batches)
    assert failed.value.worker == 1


class _HangsOnRankOne(torch.utils.data.Dataset):
    """Rows of 4 features; on rank 1, the 9th row never comes (a data call that hangs)."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        from paraloom import replica_info

        info = replica_info()
        if info is not None and info.rank == 1 and i >= 8:
            time.sleep(3600)
        return torch.full((4,), float(i % 7)), torch.tensor(i % 2)


def test_step_timeout_names_a_worker_hung_in_its_data_not_the_peer_in_ddps_broadcast():
    """With buffers, DDP's forward starts with a broadcast: rank 0 waits there, short of its
    loss, while rank 1 never got its batch; rank 1 is named, and its data blamed."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2,
                              training_mode="allreduce", progress=False, step_timeout=2.0)
    loader = torch.utils.data.DataLoader(_HangsOnRankOne(), batch_size=4)
    with pytest.raises(WorkerError, match=r"worker 1 has answered nothing .*its data.*never "
                                          r"got this round's batch.*\[0\] were waiting"
                       ) as failed:
        wrapper.fit(loader)
    assert failed.value.worker == 1


@pytest.mark.parametrize("bad", [{"heartbeat_timeout": 0}, {"step_timeout": -1.0}, {"spares": -1},
                                 {"spares": True}, {"heartbeat_timeout": 0.05},
                                 {"timeout": float("inf")}, {"timeout": 1e300},
                                 {"max_failures": -1}, {"max_failures": 1.5}])
def test_bad_fault_options_are_refused(bad):
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=next(iter(bad))):
        ParallelWrapper(model, loss_fn=nn.MSELoss(),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **bad)


def test_checkpoints_written_across_a_recovery_resume_exactly(tmp_path, references):
    from paraloom.listeners import CheckpointListener

    references.setdefault("allreduce", _reference("allreduce"))
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how="kill", at=10)
    saver = CheckpointListener(tmp_path / "ckpt", every_n_iterations=4, every_n_epochs=None,
                               keep_last=100)
    _, stats = _train(model, "allreduce", max_failures=1, listeners=[saver])
    assert stats["failures"] == 1
    iterations = [int(p.stem.rsplit("iter", 1)[1]) for p in saver.written]
    rounds = stats["rounds"]
    assert iterations == list(range(4, rounds + 1, 4))  # each once, none lost to the failure
    # Resuming from one written after the failure gives the uninterrupted result too.
    late = saver.written[len(saver.written) // 2]
    torch.manual_seed(1)
    resumed = FailOnce()
    _train(resumed, "allreduce", resume_from=late)
    assert _same(resumed, references["allreduce"])


def test_a_failure_early_in_a_second_fit_keeps_what_replicas_carried_over(tmp_path):
    """Between fits the workers keep state that Begin does not send (the sharing residual and
    threshold): a restart must restore it, not start it from zero."""
    armed = tmp_path / "armed"

    def two_fits(model: nn.Module) -> None:
        torch.manual_seed(0)
        wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9),
                                  workers=2, training_mode="shared_gradients", progress=False,
                                  max_failures=1)
        with wrapper:
            wrapper.fit(digits_loader(rows=256), epochs=1)
            armed.touch()
            stats = wrapper.fit(digits_loader(rows=256), epochs=1)
        armed.unlink()
        return stats

    torch.manual_seed(1)
    reference = FailWhenArmed(tmp_path / "never", tmp_path / "not-armed")
    two_fits(reference)
    torch.manual_seed(1)
    model = FailWhenArmed(tmp_path / "failed", armed, how="kill", at=3)
    stats = two_fits(model)
    assert (tmp_path / "failed").exists() and stats["failures"] == 1
    assert not stats["model_sent"], "the restart must restore the model the Begin left out"
    assert _same(model, reference)


def test_native_code_that_holds_the_gil_is_not_taken_for_dead():
    from fault_helpers import gil_holding_step

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    wrapper = ParallelWrapper(model, step_fn=gil_holding_step,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=2,
                              training_mode="allreduce", progress=False, heartbeat_timeout=0.3)
    with wrapper:
        stats = wrapper.fit(list(digits_loader(rows=128, batch_size=32)), epochs=1)
    assert stats["batches"] == 4 and stats["failures"] == 0


def test_a_spare_takes_the_failed_workers_place_and_none_is_left_behind(tmp_path):
    """The spare process started ahead becomes worker 1 after its failure; after the fit,
    neither the workers nor the spares (the used one's replacement) are alive."""
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how="kill", at=12)
    pids = Pids()
    wrapper, stats = _train(model, "allreduce", epochs=3, max_failures=1, listeners=[pids])
    assert stats["failures"] == 1
    before, after = pids.workers[0], pids.workers[-1]
    assert after[0] == before[0] and after[1] in pids.spares
    seen = {pid for row in pids.workers for pid in row} | pids.spares
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in seen)


class StopTheSpares(Pids):
    """SIGSTOPs the waiting spares at the third iteration, once."""

    def on_iteration(self, iteration, epoch, loss):
        super().on_iteration(iteration, epoch, loss)
        if iteration == 3:
            for pid in self.wrapper._pool.spare_pids:  # type: ignore[union-attr]
                os.kill(pid, signal.SIGSTOP)


def test_a_stopped_spare_is_passed_over_and_the_result_is_exact(tmp_path, references):
    """The stopped spare was given the failed worker's rank and the regroup waited out its
    20 s for it (stats' seconds_lost 20.2); now it is killed and a new worker takes the rank."""
    references.setdefault("allreduce", _reference("allreduce"))
    torch.manual_seed(1)
    model = FailOnce(tmp_path / "failed", how="kill", at=7)
    stopper = StopTheSpares()
    _, stats = _train(model, "allreduce", max_failures=1, heartbeat_timeout=1.0,
                      listeners=[stopper])
    assert stats["failures"] == 1 and stats["seconds_lost"] < 10.0, stats["seconds_lost"]
    assert (tmp_path / "failed").exists() and _same(model, references["allreduce"])
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in stopper.spares) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in stopper.spares)


class FailEverywhere(FailOnce):
    """Every rank is SIGKILLed at the same training call: two failures at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized():
            self.calls += 1
            marker = f"{self.marker}.{dist.get_rank()}"
            if self.calls == self.at and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def test_two_workers_failing_at_once_are_one_failure(tmp_path, references):
    references.setdefault("allreduce", _reference("allreduce"))
    torch.manual_seed(1)
    model = FailEverywhere(tmp_path / "failed", at=7)
    _, stats = _train(model, "allreduce", max_failures=1)
    assert (tmp_path / "failed.0").exists() and (tmp_path / "failed.1").exists()
    assert stats["failures"] == 1  # one recovery restarts every worker
    assert _same(model, references["allreduce"])


class DiesWhileStarting(nn.Module):
    """The third worker process to unpickle it is killed; every one records its pid."""

    def __init__(self, pids: str) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.pids = pids

    def __setstate__(self, state):
        super().__setstate__(state)
        if multiprocessing.parent_process() is not None:  # in a worker, not the test
            Path(self.pids, str(os.getpid())).touch()
            if len(os.listdir(self.pids)) == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    def forward(self, x):
        return self.net(x.flatten(1))


def test_a_worker_that_dies_while_the_pool_starts_takes_no_other_with_it(tmp_path):
    # With max_failures the pool kills only a failed worker once it runs; while it starts, a
    # failure kills every worker (nothing would hold the others: they would idle until exit).
    (tmp_path / "pids").mkdir()
    model = DiesWhileStarting(str(tmp_path / "pids"))
    with pytest.raises(WorkerError, match="while starting") as failed:
        _train(model, "allreduce", max_failures=1, workers=3)
    # Its traceback holds the pool that failed to start, as a user's handler would: the
    # workers must be gone without waiting for the pool to be collected.
    assert failed.value.__traceback__ is not None
    started = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(started) == 3  # two that started well, and the one killed
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in started)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_worker_killed_or_frozen_between_fits_gets_a_fresh_pool(sig):
    """With max_failures=0: a fit right after a worker was killed between fits raised
    WorkerError (a 50 ms later one started a fresh pool), and one after a SIGSTOP always
    raised ("sent no heartbeat"): whether it trained depended on a race."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with wrapper:
        wrapper.fit(digits_loader(rows=128, batch_size=32))
        victim = wrapper.worker_pids[1]
        os.kill(victim, sig)  # while nothing runs; the next fit at once
        with pytest.warns(UserWarning, match="a worker stopped between fits.*starts again"):
            stats = wrapper.fit(digits_loader(rows=128, batch_size=32))
        assert stats["batches"] == 4 and stats["failures"] == 0 and stats["model_sent"]
        assert victim not in wrapper.worker_pids
    deadline = time.monotonic() + 5
    while pid_alive(victim) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(victim)  # the frozen one was killed, not left behind


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_with_max_failures_workers_lost_between_fits_begin_where_the_last_fit_ended(sig):
    """A fresh pool began from the model and optimizer alone: the residuals of shared
    gradients and a factory-built optimizer's momentum, which only the workers hold, started
    again, silently, though the end-of-fit carry-over held them."""
    def train(lose: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                             training_mode="shared_gradients", max_failures=1) as wrapper:
            wrapper.fit(digits_loader(rows=128, batch_size=16))
            victim = wrapper.worker_pids[1]
            if lose:
                os.kill(victim, sig)
            stats = wrapper.fit(digits_loader(rows=128, batch_size=16))
            assert stats["failures"] == 0 and (victim not in wrapper.worker_pids) == lose
        return [p.detach().clone() for p in model.parameters()]

    kept, lost = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(kept, lost, strict=True))
