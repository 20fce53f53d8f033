"""Checkpoints: exact resume after a kill, atomic writes, refusing foreign checkpoints."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset
from training_helpers import digest

import paraloom
from paraloom import ParallelWrapper, TrainingCheckpoint, TrainingListener, WorkerError
from paraloom.datasets import digits
from paraloom.listeners import CheckpointListener
from paraloom.models import MLP, LeNet

pytestmark = pytest.mark.timeout(240)


class _DieAt(nn.Module):
    """Cross-entropy; the last worker's process SIGKILLs itself on its ``at``-th batch. From
    inside the worker, so the kill lands at that batch however far the parent lags behind."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, out, target):
        self.calls += 1
        if self.calls == self.at and dist.is_initialized() \
                and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return F.cross_entropy(out, target)


class _Halving(TrainingListener):
    """Halves the learning rate at each epoch's end, as a StepLR stepped there would."""

    def __init__(self, opt):
        self.opt = opt

    def on_epoch_end(self, epoch, loss):
        for group in self.opt.param_groups:
            group["lr"] = 0.05 * 0.5 ** (epoch + 1)


def _run(mode, listeners=(), resume_from=None, epochs=3, workers=2, dropout=False,
         generator=False, loss_fn=None, halving=False, **extra):
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=[64], dropout=0.3) if dropout else LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    listeners = [*listeners, _Halving(opt)] if halving else listeners
    loader = DataLoader(digits("train"), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(7) if generator else None)
    options = {"averaging": {"averaging_frequency": 3},
               "diloco": {"sync_every": 4, "density": 0.1}}.get(mode, {})
    with ParallelWrapper(model, loss_fn=loss_fn or nn.CrossEntropyLoss(), optimizer=opt,
                         workers=workers, training_mode=mode, progress=False,
                         listeners=list(listeners), **options, **extra) as w:
        w.fit(loader, epochs=epochs, resume_from=resume_from)
    return digest(model)


@pytest.mark.parametrize("mode", ["averaging", "shared_gradients", "shared_gradients+blocking",
                                  "diloco", "diloco+overlap", "allreduce+three"])
def test_resume_after_a_kill_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, mode):
    mode, _, variant = mode.partition("+")
    # By default shared_gradients' checkpoints save an exchange; with overlap_rounds=2 each
    # checkpoint (every 4 rounds) holds a DiLoCo synchronization in flight (sent every 4).
    # Three workers sum each gradient in an order set by DDP's bucket layout: the resumed DDP
    # must start with the layout the first had settled on.
    extra = {"blocking": {"overlap": False}, "overlap": {"overlap_rounds": 2},
             "three": {"workers": 3}}.get(variant, {})
    reference = _run(mode, dropout=True, **extra)
    # A "random" but reproducible batch; from 14 on, so that a checkpoint was written before it
    # (replies travel in batches of rounds: a kill loses the replies of its batch).
    kill_at = max(14, random.Random(mode).randrange(9, 30))
    with pytest.raises(WorkerError, match="SIGKILL"):
        _run(mode, [CheckpointListener(tmp_path, every_n_iterations=4, every_n_epochs=None)],
             dropout=True, loss_fn=_DieAt(kill_at), **extra)
    latest = TrainingCheckpoint.load(tmp_path)
    # Checkpoints need every worker's state: none from the dying batch on.
    assert 0 < latest.iteration < kill_at and latest.iteration % 4 == 0
    assert len(list(tmp_path.glob("*.safetensors"))) <= 3  # keep_last
    assert _run(mode, resume_from=tmp_path, dropout=True, **extra) == reference


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=36)


def test_resume_with_an_lr_scheduler_is_bitwise_equal(tmp_path):
    """The schedule's position is in each replica's checkpointed state."""
    reference = _run("allreduce", lr_scheduler=_cosine)
    assert reference != _run("allreduce")  # the schedule changes the result
    with pytest.raises(WorkerError, match="SIGKILL"):
        _run("allreduce", [CheckpointListener(tmp_path, every_n_iterations=5,
                                              every_n_epochs=None)],
             loss_fn=_DieAt(23), lr_scheduler=_cosine)
    assert 0 < TrainingCheckpoint.load(tmp_path).iteration < 23
    assert _run("allreduce", resume_from=tmp_path, lr_scheduler=_cosine) == reference


def test_resume_after_an_epoch_whose_end_changed_the_learning_rate_is_bitwise_equal(tmp_path):
    """The epoch-end checkpoint was taken before on_epoch_end ran: the resumed epoch trained
    at the rate before the listener's step (0.05 where the run had 0.025)."""
    reference = _run("allreduce", halving=True)
    assert reference != _run("allreduce")  # the rates change the result
    with pytest.raises(WorkerError, match="SIGKILL"):
        _run("allreduce", [CheckpointListener(tmp_path, every_n_epochs=1)], halving=True,
             loss_fn=_DieAt(18))  # in the second epoch (12 rounds each)
    latest = TrainingCheckpoint.load(tmp_path)
    assert (latest.epoch, latest.batch) == (0, 23)  # all of the first epoch
    assert [r["optimizer"]["param_groups"][0]["lr"] for r in latest.replicas] == [0.025] * 2
    assert _run("allreduce", resume_from=tmp_path, halving=True) == reference


class _FailAt(TrainingListener):
    def __init__(self, at):
        self.at = at

    def on_iteration(self, iteration, epoch, loss):
        if iteration == self.at:
            raise KeyboardInterrupt  # the user pressing Ctrl-C mid-training


def test_resume_in_one_process_with_dropout_is_bitwise_equal(tmp_path):
    # With workers=1 the replica shares the caller's RNG with the data order.
    reference = _run("averaging", workers=1, dropout=True)
    with pytest.raises(KeyboardInterrupt):
        _run("averaging", [CheckpointListener(tmp_path, every_n_iterations=10,
                                              every_n_epochs=None), _FailAt(37)],
             workers=1, dropout=True)
    assert TrainingCheckpoint.load(tmp_path).iteration == 30
    assert _run("averaging", resume_from=tmp_path, workers=1, dropout=True) == reference


@pytest.mark.parametrize("mode", ["averaging", "allreduce"])
def test_resume_in_one_process_from_an_epoch_end_checkpoint_is_bitwise_equal(tmp_path, mode):
    """The checkpoint's RNG went back at the first round, after the next epoch's loader had
    drawn its seed and shuffle from the RNG before it: dropout and the orders moved (0.03 to
    0.2 off); mid-epoch checkpoints were exact."""
    reference = _run(mode, workers=1, dropout=True)
    with pytest.raises(KeyboardInterrupt):
        _run(mode, [CheckpointListener(tmp_path, every_n_iterations=None, every_n_epochs=1),
                    _FailAt(30)], workers=1, dropout=True)
    checkpoint = TrainingCheckpoint.load(tmp_path)
    assert (checkpoint.epoch, checkpoint.batch) == (0, 23)  # the first epoch's end
    assert _run(mode, resume_from=tmp_path, workers=1, dropout=True) == reference


class _CrashingWrite(TrainingListener):
    """Writes a checkpoint whose save dies half-way (as a crash during the write would)."""

    def wants_checkpoint(self, iteration, epoch, epoch_end):
        return iteration == 5

    def on_checkpoint(self, checkpoint):
        from paraloom.training import resume

        def half_write(tensors, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"\x00" * 100)
            raise OSError("disk gone")

        real, resume.save_file = resume.save_file, half_write
        try:
            checkpoint.save(self.path)
        finally:
            resume.save_file = real


def test_a_crash_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    model = MLP(in_features=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(12)]
    keeper = CheckpointListener(tmp_path, every_n_iterations=3, every_n_epochs=None)
    crasher = _CrashingWrite()
    crasher.path = tmp_path / "checkpoint-epoch0-iter3.safetensors"  # overwrite a good one
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=1,
                         progress=False, listeners=[keeper, crasher]) as w:
        with pytest.raises(OSError, match="disk gone"):
            w.fit(batches)
    good = TrainingCheckpoint.load(tmp_path / "checkpoint-epoch0-iter3.safetensors")
    assert good.iteration == 3 and good.batch == 3
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_checkpoint_from_another_configuration_is_refused(tmp_path):
    batches = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(4)]
    model = MLP(in_features=64)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                         listeners=[CheckpointListener(tmp_path)]) as w:
        w.fit(batches)
    other = MLP(in_features=64, hidden=[32])
    w2 = ParallelWrapper(other, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(other.parameters(), lr=0.01))
    with pytest.raises(ValueError, match="another model or configuration.*parameters"):
        w2.fit(batches, resume_from=tmp_path)
    w3 = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                         averaging_frequency=5)
    with pytest.raises(ValueError, match="synchronizer"):
        w3.fit(batches, resume_from=tmp_path)
    with pytest.raises(ValueError, match="not a paraloom training checkpoint"):
        import paraloom

        paraloom.save(model, tmp_path / "model.safetensors")
        w3.fit(batches, resume_from=tmp_path / "model.safetensors")
    header = (tmp_path / "checkpoint-epoch0-iter4.safetensors").read_bytes()[:4096]
    assert b"pickle" not in header


def test_a_checkpoint_from_another_optimizer_is_refused_up_front(tmp_path):
    batches = [(torch.rand(8, 64), torch.randint(0, 10, (8,))) for _ in range(4)]

    def fit(make_optimizer, resume_from=None, epochs=2, listeners=()):
        torch.manual_seed(0)
        model = MLP(in_features=64)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                             optimizer=make_optimizer(model), listeners=list(listeners)) as w:
            w.fit(batches, epochs=epochs, resume_from=resume_from)
        return model

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    fit(sgd, epochs=1, listeners=[CheckpointListener(tmp_path)])
    with pytest.raises(ValueError, match=r"optimizer: checkpoint has 'SGD', this run has 'Adam'"
                                         r".*same model, optimizer class"):
        fit(lambda m: torch.optim.Adam(m.parameters()), resume_from=tmp_path)
    with pytest.raises(ValueError, match=r"optimizer_param_groups: checkpoint has \[6\], this "
                                         r"run has \[2\]"):
        fit(lambda m: torch.optim.SGD(list(m.parameters())[:2], lr=0.1), resume_from=tmp_path)
    # A checkpoint written before the optimizer was fingerprinted still resumes.
    path = tmp_path / "checkpoint-epoch0-iter4.safetensors"
    old = TrainingCheckpoint.load(path)
    for key in ("optimizer", "optimizer_param_groups"):
        del old.fingerprint[key]
    old.save(path)
    assert digest(fit(sgd, resume_from=path)) == digest(fit(sgd))


def test_resume_restores_a_dataloaders_own_generator(tmp_path):
    reference = _run("averaging", generator=True)
    with pytest.raises(WorkerError, match="SIGKILL"):
        _run("averaging", [CheckpointListener(tmp_path, every_n_iterations=5,
                                              every_n_epochs=None)],
             generator=True, loss_fn=_DieAt(23))
    iteration = TrainingCheckpoint.load(tmp_path).iteration
    assert 0 < iteration < 23 and iteration % 5 == 0
    assert _run("averaging", resume_from=tmp_path, generator=True) == reference
    with pytest.raises(ValueError, match="generator="):
        _run("averaging", resume_from=tmp_path, generator=False)


class _Shards(IterableDataset):
    """60 rows, each replica every world_size-th."""

    def __iter__(self):
        info = paraloom.replica_info() or paraloom.ReplicaInfo(0, 1)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(60, 4, generator=g), torch.randn(60, 1, generator=g)
        for i in range(info.rank, 60, info.world_size):
            yield x[i], y[i]


class _Stop(Exception):
    pass


def _stream_run(listeners, resume=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    iterations: list[tuple[int, int]] = []
    with ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         training_mode="allreduce",
                         listeners=[*listeners, lambda it, ep, loss: iterations.append((it, ep))],
                         ) as w:
        w.fit(DataLoader(_Shards(), batch_size=7), epochs=3, resume_from=resume)
    return model.weight.detach().clone(), iterations


def test_resume_of_a_stream_from_an_epoch_end_checkpoint_is_exact(tmp_path):
    """Resuming where a stream's epoch ended starts the next epoch: no round in which every
    replica is idle (with allreduce, momentum would still move the weights in it)."""
    whole, iterations = _stream_run([])

    def interrupt(iteration, epoch, loss):
        if iteration == 5:  # epoch 1's first round: epoch 0's checkpoint is written
            raise _Stop()

    with pytest.raises(_Stop):
        _stream_run([CheckpointListener(tmp_path, every_n_epochs=1), interrupt])
    resumed, rest = _stream_run([], resume=tmp_path)
    assert rest == iterations[5:]  # epoch 1 on, numbered as before
    assert torch.equal(resumed, whole)


def test_an_accumulate_mismatch_is_refused_either_way() -> None:
    from paraloom import TrainingCheckpoint

    base = {"model": "Net", "workers": 2}
    written = TrainingCheckpoint(fingerprint=base, epoch=0, batch=0, iteration=4,
                                 data_rng=None, replicas=[])
    with pytest.raises(ValueError, match=r"accumulate: checkpoint has 1, this run has 2"):
        written.check({**base, "accumulate": 2})
    accumulated = TrainingCheckpoint(fingerprint={**base, "accumulate": 3}, epoch=0, batch=0,
                                     iteration=4, data_rng=None, replicas=[])
    with pytest.raises(ValueError, match=r"accumulate: checkpoint has 3, this run has 1"):
        accumulated.check(base)
    accumulated.check({**base, "accumulate": 3})


def test_an_optimizer_known_on_one_side_only_is_not_compared() -> None:
    from paraloom import TrainingCheckpoint

    base = {"model": "Net", "workers": 2}
    written = TrainingCheckpoint(fingerprint={**base, "optimizer": "SGD",
                                              "optimizer_param_groups": [2]},
                                 epoch=0, batch=0, iteration=4, data_rng=None, replicas=[])
    written.check(base)  # a factory's optimizer is not known before it is built


def test_resuming_a_checkpoint_past_the_epochs_asked_for_warns_that_nothing_is_trained(
        tmp_path):
    _run("allreduce", [CheckpointListener(tmp_path, every_n_epochs=1)], epochs=2, workers=1)
    with pytest.warns(UserWarning, match=r"checkpoint is of 2 whole epochs, as many as "
                                         r"fit\(epochs=2\) asks for or more: nothing is left"
                      ) as caught:
        _run("allreduce", resume_from=tmp_path, epochs=2, workers=1)
    assert caught[0].filename == __file__  # the line that called fit(), not paraloom's


class _Epochs(TrainingListener):
    """Records the epoch hooks; ``stop_after`` stops the fit at that epoch's end."""

    def __init__(self, stop_after=None):
        self.events, self.stop_after, self.wrapper = [], stop_after, None

    def on_fit_start(self, wrapper):
        self.wrapper = wrapper

    def on_epoch_start(self, epoch):
        self.events.append(f"start {epoch}")

    def on_epoch_end(self, epoch, loss):
        self.events.append(f"end {epoch}")
        if epoch == self.stop_after:
            self.wrapper.stop()


def test_resume_from_an_epoch_end_checkpoint_starts_at_the_next_epoch(tmp_path):
    """Its epoch's hooks ran before the checkpoint: they do not run again (an epoch-level
    scheduler stepped in on_epoch_end would step twice), and the result is still exact."""
    reference = _run("averaging", epochs=3)
    first = _Epochs(stop_after=0)
    _run("averaging", [CheckpointListener(tmp_path, every_n_epochs=1), first], epochs=3)
    assert first.events == ["start 0", "end 0"]
    resumed = _Epochs()
    assert _run("averaging", [resumed], resume_from=tmp_path, epochs=3) == reference
    assert resumed.events == ["start 1", "end 1", "start 2", "end 2"]


class _Augmented(torch.utils.data.Dataset):
    """Rows with noise drawn in ``__getitem__`` from torch's global RNG, as torchvision's
    random transforms draw it."""

    def __init__(self, rows=96):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, 10, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 1).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(10), self.y[i]


def _small_run(mode, data, resume=None, listeners=(), epochs=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         training_mode=mode, listeners=list(listeners)) as w:
        w.fit(DataLoader(data, batch_size=16), epochs=epochs, resume_from=resume)
    return digest(model)


def test_resume_is_exact_when_the_dataset_draws_random_numbers(tmp_path):
    """The first batch after a resume is built from the checkpoint's RNG state, as the
    uninterrupted run built it (it was built before the RNG was restored)."""
    data = _Augmented()
    reference = _small_run("allreduce", data, listeners=[CheckpointListener(
        tmp_path, every_n_iterations=2, every_n_epochs=None, keep_last=10)])
    assert _small_run("allreduce", data) == reference  # the run itself is reproducible
    assert _small_run("allreduce", data,
                      resume=tmp_path / "checkpoint-epoch0-iter2.safetensors") == reference


def test_shared_gradients_resume_before_a_short_last_round_is_exact(tmp_path):
    """13 batches on 2 workers: the epoch's 7th round leaves worker 1 idle. Resumed just before
    it, worker 1 must hold its restored local view through that idle round."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 10, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long())
    reference = _small_run("shared_gradients", data, epochs=2, listeners=[CheckpointListener(
        tmp_path, every_n_iterations=6, every_n_epochs=None, keep_last=10)])
    assert _small_run("shared_gradients", data, epochs=2,
                      resume=tmp_path / "checkpoint-epoch0-iter6.safetensors") == reference


def _quick_fit(directory, epochs, resume_from=None, lr=0.05, batch_size=64, keep_last=2,
               every=5, lr_scheduler=None):
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=[16])
    loader = DataLoader(digits("train"), batch_size=batch_size)
    listener = CheckpointListener(directory, every_n_iterations=every, every_n_epochs=None,
                                  keep_last=keep_last)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                         listeners=[listener], lr_scheduler=lr_scheduler) as w:
        w.fit(loader, epochs=epochs, resume_from=resume_from)
    return model


def test_resume_refuses_an_lr_scheduler_added_or_dropped(tmp_path):
    """Accepted silently: an added schedule started at its first step mid-run (a warm-up
    again), a dropped one left the rate where it was."""
    def step(opt):
        return torch.optim.lr_scheduler.StepLR(opt, 10, gamma=0.5)

    _quick_fit(tmp_path / "plain", 1)
    with pytest.raises(ValueError, match="without an lr_scheduler, and this run has one"):
        _quick_fit(tmp_path / "plain", 2, resume_from=tmp_path / "plain", lr_scheduler=step)
    _quick_fit(tmp_path / "scheduled", 1, lr_scheduler=step)
    with pytest.raises(ValueError, match="with an lr_scheduler, and this run has none"):
        _quick_fit(tmp_path / "scheduled", 2, resume_from=tmp_path / "scheduled")
    _quick_fit(tmp_path / "scheduled", 2, resume_from=tmp_path / "scheduled", lr_scheduler=step)


def test_keep_last_holds_across_resumed_runs(tmp_path):
    """Each resumed run's listener pruned only its own files: 2, then 4, then 6 at keep_last=2."""
    _quick_fit(tmp_path, 1)
    for epochs in (2, 3):
        _quick_fit(tmp_path, epochs, resume_from=tmp_path)
        assert len(list(tmp_path.glob("*.safetensors"))) == 2, epochs


def test_resume_from_a_reused_directory_takes_the_newest_written_not_the_highest_iteration(
        tmp_path):
    """An old run's files (higher iterations) were taken over the fresh run's own."""
    from paraloom.training.resume import latest_checkpoint

    _quick_fit(tmp_path, 3, lr=0.01)  # an old run: up to iteration 60
    old = {p.name for p in tmp_path.glob("*.safetensors")}
    with pytest.warns(UserWarning, match="already holds checkpoints past this one"):
        _quick_fit(tmp_path, 1, lr=0.05)  # a fresh run in the same directory
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.name not in old
    assert TrainingCheckpoint.load(tmp_path).iteration == 20  # the fresh run's last
    assert old <= {p.name for p in tmp_path.glob("*.safetensors")}  # another run's: kept


def test_a_copied_directory_resumes_from_its_highest_iteration_whatever_the_file_times(
        tmp_path):
    """A copy without timestamps (cp -r, a download) gives the files new times in any order."""
    from paraloom.training.resume import latest_checkpoint

    _quick_fit(tmp_path, 1, keep_last=4)
    files = sorted(tmp_path.glob("*.safetensors"), key=lambda p: -int(p.stem.rsplit("r", 1)[1]))
    for i, path in enumerate(files):  # the highest iteration copied first: the oldest time
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.name.endswith("iter20.safetensors")


def test_two_checkpoint_listeners_sharing_a_directory_and_prefix_are_refused(tmp_path):
    model = MLP(in_features=64, hidden=[16])
    listeners = [CheckpointListener(tmp_path, every_n_iterations=3, keep_last=1),
                 CheckpointListener(tmp_path, every_n_epochs=1, keep_last=5)]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         listeners=listeners) as w:
        with pytest.raises(ValueError, match="two CheckpointListeners write"):
            w.fit(DataLoader(digits("train"), batch_size=64))
    listeners[1].prefix = "epochs"  # their own prefixes: both keep their files
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         listeners=listeners) as w:
        w.fit(DataLoader(digits("train"), batch_size=64), epochs=2)
    assert len(list(tmp_path.glob("checkpoint-*"))) == 1
    assert len(list(tmp_path.glob("epochs-*"))) == 2


def test_resume_with_other_data_is_refused_naming_the_batches_per_epoch(tmp_path):
    """Another batch size moved the position: the rest of the epoch was skipped silently."""
    _quick_fit(tmp_path, 1, every=10)
    with pytest.raises(ValueError, match="batches_per_epoch: checkpoint has 23, this run has 12"):
        _quick_fit(tmp_path, 2, resume_from=tmp_path, batch_size=128)


@pytest.mark.parametrize("batch_norm", [False, True])
@pytest.mark.parametrize("mode", ["averaging", "allreduce"])
def test_a_checkpoints_model_state_is_the_model_fit_returns(tmp_path, mode, batch_norm):
    """replicas[0]['model'], which the docs advised, is one replica's weights: in averaging
    0.013 away from the model after the final averaging. In allreduce a BatchNorm's running
    statistics are rank 0's (DDP broadcasts them): their mean was 0.04 off."""
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=[16]) if not batch_norm else nn.Sequential(
        nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    loader = DataLoader(digits("train"), batch_size=64)
    options = {"averaging_frequency": 5} if mode == "averaging" else {}  # 12 rounds
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         training_mode=mode, listeners=[CheckpointListener(tmp_path)],
                         **options) as w:
        w.fit(loader, epochs=1)
    checkpoint = TrainingCheckpoint.load(tmp_path)
    state = checkpoint.model_state()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-5)
    if mode == "averaging":  # one replica's weights are not the model
        spread = max((checkpoint.replicas[0]["model"][k] - v).abs().max().item()
                     for k, v in model.state_dict().items())
        assert spread > 1e-4


def test_a_home_relative_checkpoint_directory_is_one_folder_for_writes_prunes_and_resume(
        tmp_path, monkeypatch):
    """The writer expands '~' (since 2026-12-03): the listener's pruning and glob must look in
    the same folder, or keep_last silently deletes nothing."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _quick_fit("~/ckpt", 2, keep_last=2)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 2
    assert not (tmp_path / "~").exists()
    assert TrainingCheckpoint.load("~/ckpt").iteration == 45  # 46 rounds, every 5th
