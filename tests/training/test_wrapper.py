"""ParallelWrapper end to end: convergence, closed-form averaging, failures, lifecycle."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training_helpers import (
    Scalar,
    TwoInputs,
    accuracy,
    digest,
    linear_loss,
    make_recording_averaging,
    pid_alive,
    scalar_batches,
)

from paraloom import NotPicklableError, ParallelWrapper, TrainingListener, WorkerError
from paraloom.models import MLP, LeNet

pytestmark = pytest.mark.timeout(120)


def scalar_wrapper(workers, frequency=1, **kw):
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=workers,
                                  averaging_frequency=frequency, progress=False, **kw)


def test_lenet_on_digits_reaches_95_percent_and_replicas_match(digits_loader, digits_test):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode=make_recording_averaging(3), progress=False) as w:
        stats = w.fit(digits_loader, epochs=5)
    assert accuracy(model, digits_test) >= 0.95
    assert stats["batches"] == 5 * len(digits_loader)
    assert stats["samples"] == 5 * len(digits_loader.dataset)
    r0, r1 = (w["record"] for w in stats["per_worker"])
    assert len(r0) == len(r1) == stats["rounds"] // 3 + (stats["rounds"] % 3 != 0)
    for (step0, before0, after0), (step1, before1, after1) in zip(r0, r1, strict=True):
        assert step0 == step1
        assert before0 != before1, "replicas trained on different batches must differ"
        assert after0 == after1, "replicas must be bit-identical right after averaging"
    assert digest(model) == r0[-1][2], "the user's model must hold the final average"


def _simulate_averaging(values, targets, workers, frequency, lr):
    """The specification in plain Python: one scalar replica per worker, SGD on 0.5*(w*x-t)^2,
    one batch per worker per round; every `frequency` rounds and at the end, a mean weighted by
    the rounds each replica trained since the last one (an idle replica's stale weight is left
    out)."""
    w = [0.0] * workers
    trained = [0] * workers
    rounds = [list(range(i, min(i + workers, len(values)))) for i in range(0, len(values),
                                                                            workers)]

    def average():
        mean = sum(t * v for t, v in zip(trained, w, strict=True)) / sum(trained)
        trained[:] = [0] * workers
        return [mean] * workers

    for r, batch in enumerate(rounds, start=1):
        for rank, i in enumerate(batch):
            w[rank] -= lr * (w[rank] * values[i] - targets[i]) * values[i]
            trained[rank] += 1
        if r % frequency == 0:
            w = average()
    if len(rounds) % frequency:
        w = average()
    return w[0]


@pytest.mark.parametrize("frequency", [1, 2, 3])
def test_averaging_frequency_matches_the_specification(frequency):
    from training_helpers import quadratic_loss

    values, targets = [1.0, 2.0, 0.5, 1.5, 1.0, 0.5, 2.0], [1.0, -1.0, 2.0, 0.0, 1.0, 3.0, -2.0]
    batches = [(torch.tensor([[v]], dtype=torch.float64), torch.tensor([[t]], dtype=torch.float64))
               for v, t in zip(values, targets, strict=True)]
    model = Scalar().double()
    with ParallelWrapper(model, loss_fn=quadratic_loss, workers=2, progress=False,
                         averaging_frequency=frequency,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.3)) as w:
        w.fit(batches)
    expected = _simulate_averaging(values, targets, 2, frequency, 0.3)
    assert model.w.item() == pytest.approx(expected, abs=1e-12)
    others = {f: _simulate_averaging(values, targets, 2, f, 0.3) for f in (1, 2, 3)}
    assert len({round(v, 9) for v in others.values()}) == 3, "the frequencies must differ"


@pytest.mark.parametrize("frequency", [1, 2])
def test_averaging_matches_closed_form(frequency):
    # Worker 0 trains on 1 and 5, worker 1 on 3 and 7; SGD lr=1 moves w by -x each step.
    model, wrapper = scalar_wrapper(2, frequency)
    with wrapper:
        wrapper.fit(scalar_batches([1, 3, 5, 7]))
    assert model.w.item() == -8.0  # mean of -(1+5) and -(3+7)


def test_uneven_last_round_trains_every_batch():
    # 5 batches on 2 workers: rounds of 2, 2 and 1. DL4J would drop the last worker's work.
    model, wrapper = scalar_wrapper(2, frequency=10)
    with wrapper:
        stats = wrapper.fit(scalar_batches([1, 3, 5, 7, 9]))
    assert stats["batches"] == 5 and stats["rounds"] == 3
    # -(1+5+9) after 3 steps and -(3+7) after 2, weighted by the steps: (3*-15 + 2*-10) / 5
    assert model.w.item() == pytest.approx(-13.0, abs=1e-6)


def test_a_replica_idle_in_the_last_round_is_left_out_of_the_average():
    # 3 batches on 2 workers, averaging every round: worker 1 is idle in round 2, so the
    # average after it is worker 0's weight (a plain mean would halve that round's step).
    model, wrapper = scalar_wrapper(2, frequency=1)
    with wrapper:
        wrapper.fit(scalar_batches([1, 3, 5]), epochs=2)
    # epoch 1: round 1 -> mean(-1, -3) = -2; round 2 -> -2 - 5 = -7; epoch 2 likewise
    assert model.w.item() == -14.0


def test_one_worker_trains_in_the_calling_process():
    model, wrapper = scalar_wrapper(1)
    with wrapper:
        returned = wrapper.fit(scalar_batches([1, 3, 5, 7, 9]))
        assert wrapper.worker_pids == []
        # stats() is a copy each time: changing one changed the next (a shallow copy)
        returned["per_worker"][0]["changed"] = True
        returned["bytes_sent_per_step"].append(-1.0)
        again = wrapper.stats()
        assert "changed" not in again["per_worker"][0]
        assert -1.0 not in again["bytes_sent_per_step"]
    assert model.w.item() == -25.0


def test_workers_persist_across_fits_and_stop_on_close():
    model, wrapper = scalar_wrapper(2)
    with wrapper:
        wrapper.fit(scalar_batches([1, 3]))
        pids = wrapper.worker_pids
        wrapper.fit(scalar_batches([1, 3]))
        assert wrapper.worker_pids == pids and len(pids) == 2
    assert model.w.item() == -4.0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids)


class _KillAt(TrainingListener):
    def __init__(self, wrapper_ref, at):
        self.wrapper_ref, self.at, self.killed_at = wrapper_ref, at, None

    def on_iteration(self, iteration, epoch, loss):
        if iteration == self.at:
            self.pids = self.wrapper_ref[0].worker_pids
            os.kill(self.pids[1], signal.SIGKILL)
            self.killed_at = time.monotonic()


def test_sigkill_of_a_worker_raises_worker_error_quickly(digits_train):
    model = LeNet(image_size=8)
    before = digest(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref: list = []
    killer = _KillAt(ref, at=5)
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                              listeners=[killer], progress=False)
    ref.append(wrapper)
    with wrapper:
        with pytest.raises(WorkerError, match=r"worker 1 .*SIGKILL") as info:
            wrapper.fit(DataLoader(digits_train, batch_size=16), epochs=200)
        elapsed = time.monotonic() - killer.killed_at
        pids = wrapper.worker_pids
    assert elapsed < 10, f"took {elapsed:.1f} s to notice a dead worker"
    assert info.value.worker == 1
    assert pids == [], "the pool must be torn down after a failure"
    assert digest(model) == before, "a failed fit must leave the user's model untouched"
    assert len(killer.pids) == 2 and not any(pid_alive(p) for p in killer.pids), \
        "every worker must be gone (none orphaned) when fit() raises"


def test_bad_batches_give_clear_errors_and_the_wrapper_recovers():
    model = MLP(in_features=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    good = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(4)]
    wrong_shape = good[:3] + [(torch.rand(8, 1, 9, 9), torch.randint(0, 10, (8,)))]
    wrong_dtype = [(x.double(), y) for x, y in good]
    nan = good[:1] + [(torch.full((8, 1, 8, 8), float("nan")), good[0][1])]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         progress=False) as w:
        with pytest.raises(WorkerError, match=r"Tensor\(8, 1, 9, 9\)") as info:
            w.fit(wrong_shape)
        assert info.value.worker == 1 and "epoch 0, batch 3" in str(info.value)
        with pytest.raises(WorkerError, match=r"float64 .*x\.float\(\)"):
            w.fit(wrong_dtype)
        with pytest.raises(WorkerError, match=r"loss is nan"):
            w.fit(nan)
        with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
            w.fit([torch.rand(8, 64) for _ in range(2)])
        stats = w.fit(good)  # the pool restarts after a failure
    assert stats["batches"] == 4


def test_a_bad_batch_found_mid_fit_stops_the_workers_quietly(capfd):
    # The workers are well: they skip what is queued and stop. Killed while reading a batch's
    # shared memory, they left multiprocessing's descriptor server printing tracebacks here.
    model = MLP(in_features=64)
    good = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(6)]
    third = good[0] + (good[0][1],)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01)) as w:
        for _ in range(3):
            with pytest.raises(TypeError, match=r"must be a pair"):
                w.fit(good + [third])
        assert w.fit(good)["batches"] == 6
    assert "Traceback" not in capfd.readouterr().err


class _Locked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.lock = threading.Lock()


def test_unpicklable_model_says_what_to_do():
    model = _Locked()
    wrapper = ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotPicklableError, match=r"model.*module level"):
        wrapper.fit([(torch.rand(2, 2), torch.rand(2, 2))])


def test_dict_inputs_optimizer_factory_and_listeners():
    torch.manual_seed(0)
    model = TwoInputs()
    x, e = torch.rand(64, 1, 8, 8), torch.rand(64, 3)
    y = (x.flatten(1)[:, :10].argmax(1) + (e[:, 0] > 0.5).long()) % 10
    batches = [({"image": x[i:i + 16], "extra": e[i:i + 16]}, y[i:i + 16])
               for i in range(0, 64, 16)]
    epoch_loss = {}

    class Record(TrainingListener):
        def on_epoch_end(self, epoch, loss):
            epoch_loss[epoch] = loss

    iterations = []
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
                         listeners=[Record(), lambda i, ep, loss: iterations.append(i)]) as w:
        w.fit(batches, epochs=30)
    assert iterations == list(range(30 * 2))  # one call per round, not per worker
    assert sorted(epoch_loss) == list(range(30))
    assert epoch_loss[29] < 0.5 * epoch_loss[0]


def _dict_step(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def test_a_step_fn_takes_dict_batches_from_a_list():
    """A step_fn gets batches of any structure: not only (inputs, targets) pairs."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(64, 3)
    batches = [{"x": x[i:i + 16], "y": x[i:i + 16].sum(1, keepdim=True)}
               for i in range(0, 64, 16)]
    with ParallelWrapper(model, step_fn=_dict_step, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        stats = w.fit(batches, epochs=20)
    assert stats["batches"] == 80
    torch.testing.assert_close(model.weight.detach(), torch.ones(1, 3), atol=0.05, rtol=0)


def _weighted_step(model, batch):
    x, y, weight = batch
    return (nn.functional.cross_entropy(model(x), y, reduction="none") * weight).mean()


def test_weighted_triplets_need_a_step_fn_and_the_error_says_so():
    """(x, y, weight) batches, as a DataLoader over a three-tensor dataset yields them: without
    step_fn the error names it; with one they train."""
    torch.manual_seed(0)
    x = torch.randn(128, 4)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(torch.utils.data.TensorDataset(x, y, torch.ones(128)), batch_size=16)
    model = nn.Linear(4, 2)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.5)) as w:
        with pytest.raises(WorkerError, match=r"must be a pair.*\(x, y, weight\).*step_fn="):
            w.fit(loader, epochs=1)
    model = nn.Linear(4, 2)
    with ParallelWrapper(model, step_fn=_weighted_step, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.5)) as w:
        w.fit(loader, epochs=10)
    assert (model(x).argmax(1) == y).float().mean() > 0.9


@pytest.mark.parametrize("options", [{}, {"find_unused_parameters": True},
                                     {"static_graph": True}])
@pytest.mark.parametrize("idle", [False, True], ids=["full-rounds", "idle-round"])
def test_allreduce_step_fn_gets_the_users_model_and_its_gradients_are_all_reduced(options, idle):
    """As in Lightning, step_fn gets the user's module (its training_step works) and runs inside
    DDP's forward: the result is one process's SGD on the merged batches, replicas identical."""
    from training_helpers import SelfTraining, call_training_step, make_weight_reporting

    pairs = [(1.0, 1.0), (2.0, -1.0), (0.5, 2.0), (1.5, 0.0), (2.0, 3.0)][:5 if idle else 4]
    batches = [(torch.tensor([[v]]), torch.tensor([[t]])) for v, t in pairs]
    model = SelfTraining()
    with ParallelWrapper(model, step_fn=call_training_step, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.5), timeout=60,
                         training_mode=make_weight_reporting("allreduce", **options)) as w:
        stats = w.fit(batches)
    reference = SelfTraining()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for i in range(0, len(batches), 2):
        pair = batches[i:i + 2]
        merged = (torch.cat([x for x, _ in pair]), torch.cat([t for _, t in pair]))
        opt.zero_grad()
        # An idle replica all-reduces zeros: the lone batch's gradient counts half.
        (reference.training_step(merged) * len(pair) / 2).backward()
        opt.step()
    first, second = (r["weights"] for r in stats["per_worker"])
    assert first == second, "the replicas must stay bit-identical"
    trained = float(model.w.detach())
    assert trained == pytest.approx(float(reference.w.detach()), abs=1e-6) and trained != 0.0


@pytest.mark.parametrize("workers", [1, 2])
def test_an_optimizer_whose_constructor_requires_lr_is_rebuilt_from_its_defaults(workers):
    from training_helpers import SignSGD

    model = Scalar()
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=SignSGD(model.parameters(), lr=0.25),
                         workers=workers, progress=False, timeout=60) as w:
        w.fit(scalar_batches([3, 1, 2, 5]))
    # Every gradient is positive: each replica takes 4 / workers sign steps of 0.25.
    assert float(model.w.detach()) == -1.0 / workers


class _RenamedLr(torch.optim.SGD):
    """Its constructor's learning_rate is not a key of its defaults (SGD's "lr" is)."""

    def __init__(self, params, learning_rate: float) -> None:
        super().__init__(params, lr=learning_rate)


def test_an_optimizer_that_cannot_be_rebuilt_is_refused_with_a_factory_hint():
    model = Scalar()
    hint = r"optimizer=lambda params: _RenamedLr\(params, lr=\.\.\.\)"
    with pytest.raises(ValueError, match=r"_RenamedLr.*requires \['learning_rate'\].*" + hint):
        ParallelWrapper(model, loss_fn=linear_loss, workers=2, progress=False,
                        optimizer=_RenamedLr(model.parameters(), learning_rate=0.1))
    with ParallelWrapper(model, loss_fn=linear_loss, workers=2, progress=False, timeout=60,
                         optimizer=lambda params: _RenamedLr(params, learning_rate=1.0)) as w:
        w.fit(scalar_batches([3, 1]))  # the factory the message suggests works
    assert float(model.w.detach()) == -2.0


def test_lbfgs_which_steps_with_a_closure_is_refused_clearly():
    model = Scalar()
    with pytest.raises(ValueError, match="LBFGS needs a closure"):
        ParallelWrapper(model, loss_fn=linear_loss, workers=2, progress=False,
                        optimizer=torch.optim.LBFGS(model.parameters()))
    with ParallelWrapper(model, loss_fn=linear_loss, workers=1, progress=False,
                         optimizer=lambda params: torch.optim.LBFGS(params)) as w:
        with pytest.raises(ValueError, match="LBFGS needs a closure"):
            w.fit(scalar_batches([3, 1]))
    assert float(model.w.detach()) == 0.0


def test_optimizer_state_comes_back_to_the_users_optimizer():
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                         progress=False) as w:
        w.fit(scalar_batches([1, 3]))
    # Each replica's momentum buffer is its gradient; average_updaters averages them.
    assert opt.state[model.w]["momentum_buffer"].item() == 2.0


def test_stop_from_a_listener_ends_the_fit_early():
    holder: list = []

    class StopAt(TrainingListener):
        def on_iteration(self, iteration, epoch, loss):
            if iteration == 2:
                holder[0].stop()

    model, wrapper = scalar_wrapper(1, listeners=[StopAt()])
    holder.append(wrapper)
    with wrapper:
        stats = wrapper.fit(scalar_batches([1] * 10))
    assert stats["rounds"] == 3


def test_invalid_arguments_are_rejected_with_the_fix():
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="workers=0"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=0)
    with pytest.raises(ValueError, match="'averaging'"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, training_mode="bogus")
    with pytest.raises(ValueError, match="loss_fn="):
        ParallelWrapper(model, optimizer=opt)
    with pytest.raises(ValueError, match="averaging_frequency=0"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, averaging_frequency=0)
    with pytest.raises(ValueError, match="averaging_frequency=True"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, averaging_frequency=True)
    with pytest.raises(TypeError, match="optimizer"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer="sgd")
    _, wrapper = scalar_wrapper(1)

    class OncePerObject:
        """Re-iterable in form, but its second pass is empty (a dataset over a consumed stream)."""

        def __init__(self) -> None:
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter(scalar_batches([1, 2]) if self.passes == 1 else [])

    with pytest.raises(ValueError, match="no batches in epoch 1"):
        wrapper.fit(OncePerObject(), epochs=2)


@pytest.mark.parametrize("mode", ["averaging", "allreduce", "shared_gradients"])
def test_fit_arguments_given_to_the_constructor_are_sent_to_fit(mode):
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(TypeError, match=r"^epochs= is not a ParallelWrapper option; it goes to "
                                        r"fit\(\): wrapper\.fit\(data, epochs=3\)$"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, training_mode=mode, epochs=3)
    with pytest.raises(TypeError, match=r"batch_size=, shuffle= are not ParallelWrapper options"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, training_mode=mode,
                        batch_size=4, shuffle=True)


def test_an_unknown_option_names_the_modes_options_as_parallel_wrapper_takes_them():
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(TypeError, match=r"\['lr'\] do not apply to training_mode='averaging': "
                                        r"they are neither ParallelWrapper arguments nor options"
                                        r" of this mode, which takes \['average_updaters', "
                                        r"'averaging_frequency'\]$"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, lr=0.1)


class _SaysNone(list):
    """A sampler that yields its indices but says it has none."""

    def __len__(self) -> int:
        return 0


def test_data_without_batches_is_refused_before_training_saying_why():
    from torch.utils.data import TensorDataset

    rows = TensorDataset(torch.ones(3, 1), torch.zeros(3))
    cases = [([], r"no batches at all: the list is empty"),
             (DataLoader(TensorDataset(torch.ones(0, 1), torch.zeros(0)), batch_size=4),
              r"no batches at all: the DataLoader's TensorDataset has no rows"),
             (DataLoader(rows, batch_size=4, sampler=_SaysNone(range(3))),  # yet it yields
              r"sampler is 0, though its TensorDataset has 3 rows: .*must say how many"),
             (DataLoader(rows, batch_size=4, drop_last=True),
              r"3 row\(s\), fewer than batch_size=4, and drop_last=True.*drop_last=False")]
    model, wrapper = scalar_wrapper(2)
    with wrapper:
        for data, message in cases:
            with pytest.raises(ValueError, match=message):
                wrapper.fit(data)
        assert wrapper.worker_pids == []  # refused before any worker started
    assert float(model.w.detach()) == 0.0


_ORPHAN_SCRIPT = """
import sys, time, torch
from torch import nn
from paraloom import ParallelWrapper
model = nn.Linear(4, 2)
w = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
w.fit([(torch.rand(8, 4), torch.randint(0, 2, (8,)))] * 4)
print(*w.worker_pids, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"  # no __main__ guard: workers must not re-run it
    script.write_text(_ORPHAN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "workers outlived their parent"


_UNCLOSED_SCRIPT = """
import multiprocessing, torch
from torch import nn
from paraloom import ParallelWrapper

class HoldsASemaphore(nn.Linear):
    \"\"\"Makes what torch.compile's compile workers make in a worker: a named semaphore
    that Python's resource tracker is told of and that the worker releases when it exits.\"\"\"
    def forward(self, x):
        if not hasattr(HoldsASemaphore, "held"):
            HoldsASemaphore.held = multiprocessing.get_context("spawn").Semaphore()
        return super().forward(x)

if __name__ == "__main__":
    model = HoldsASemaphore(4, 2)
    w = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    w.fit([(torch.rand(8, 4), torch.randint(0, 2, (8,)))] * 4)
    print(*w.worker_pids, flush=True)  # and exits without close()
"""


def test_a_wrapper_left_open_stops_its_workers_at_exit_as_close_does(tmp_path):
    """Killed at exit, the workers left what they had started to the resource tracker, which
    warned of leaked semaphores (compile=True's compile workers); now they are asked to stop."""
    import subprocess
    import sys

    script = tmp_path / "unclosed.py"
    script.write_text(_UNCLOSED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert "leaked semaphore" not in done.stderr, done.stderr


class _LockedDataset(torch.utils.data.Dataset):
    """A map-style dataset that cannot be pickled (it holds a lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.x, self.y = torch.rand(64, 4), torch.randint(0, 2, (64,))

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_an_unpicklable_dataset_is_streamed_through_the_parent(caplog):
    model = nn.Linear(4, 2)
    with caplog.at_level("INFO", logger="paraloom"):
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
            stats = w.fit(DataLoader(_LockedDataset(), batch_size=8), epochs=2)
    assert stats["batches"] == 16 and stats["samples"] == 128
    assert any("go through the parent" in r.message for r in caplog.records)


def test_a_stuck_worker_is_named_within_the_timeout():
    from training_helpers import stuck_on_rank_one

    model = nn.Linear(2, 1)
    wrapper = ParallelWrapper(model, step_fn=stuck_on_rank_one, workers=2, progress=False,
                              timeout=3, averaging_frequency=1000,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    with wrapper, pytest.raises(WorkerError, match="worker 1 has answered nothing for 3 s"):
        wrapper.fit([(torch.rand(4, 2), torch.rand(4, 1))] * 100)
    assert time.monotonic() - started < 30


def test_a_source_that_refills_one_buffer_loses_no_batch():
    # Each batch is the same tensor object, refilled: every dealt batch must keep its values.
    def refilled():
        buf, y = torch.zeros(1, 1), torch.zeros(1)
        for v in (1, 3, 5, 7, 9):
            buf.fill_(v)
            yield buf, y

    class Source:
        def __iter__(self):
            return refilled()

    for workers in (1, 2):
        model, wrapper = scalar_wrapper(workers, frequency=10)
        with wrapper:
            wrapper.fit(Source())
        # Two workers: -(1+5+9) in 3 steps and -(3+7) in 2, weighted by the steps.
        expected = -25.0 if workers == 1 else -13.0
        assert model.w.item() == pytest.approx(expected, abs=1e-6), workers


def test_routed_parameters_average_only_the_optimizer_state_every_replica_has():
    from training_helpers import TwoHeads

    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    # Round 0: worker 0 trains head a on x=1, worker 1 trains head b on x=3.
    batches = [((torch.tensor([[1.0]]), torch.tensor(0)), torch.zeros(1)),
               ((torch.tensor([[3.0]]), torch.tensor(1)), torch.zeros(1))]
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                         progress=False) as w:
        w.fit(batches)
    assert (model.a.item(), model.b.item()) == (-0.5, -1.5)
    # a's momentum exists on worker 0 only: it is not mixed with b's (which would give 2.0).
    assert opt.state[model.a]["momentum_buffer"].item() == 1.0
    assert model.b not in opt.state or "momentum_buffer" not in opt.state[model.b]


def test_the_users_optimizer_is_the_master_copy_across_fits_and_restarts():
    def run(restart):
        model = Scalar()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                             progress=False) as w:
            w.fit(scalar_batches([1, 3]))
            if restart:
                w.close()  # new workers must continue with the same momentum
            w.fit(scalar_batches([1, 3]))
            before = model.w.item()
            for group in opt.param_groups:
                group["lr"] = 0.0  # a learning-rate change between fits applies
            w.fit(scalar_batches([1, 3]))
        assert model.w.item() == before and opt.param_groups[0]["lr"] == 0.0
        return before

    assert run(restart=False) == run(restart=True)


def test_torch_manual_seed_makes_dropout_in_workers_reproducible():
    def run(seed):
        torch.manual_seed(seed)
        model = MLP(in_features=64, dropout=0.5)
        batches = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(4)]
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
            w.fit(batches, epochs=2)
        return digest(model)

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_an_empty_generator_is_refused_as_empty_not_as_one_shot() -> None:
    model = Scalar()
    with ParallelWrapper(model, loss_fn=linear_loss, workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=1.0)) as wrapper:
        with pytest.raises(ValueError, match="no batches at all"):
            wrapper.fit(b for b in [])


class _FrozenNorm(nn.Module):
    """A conv net whose BatchNorm is frozen with ``bn.eval()``; ``keep_frozen`` overrides
    ``train()`` to keep it so, as the README shows."""

    def __init__(self, keep_frozen: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(144, 3)
        self.keep_frozen = keep_frozen
        with torch.no_grad():
            self.bn.running_mean.fill_(0.3)
            self.bn.running_var.fill_(2.0)
        self.bn.requires_grad_(False)
        self.bn.eval()

    def train(self, mode: bool = True) -> _FrozenNorm:
        super().train(mode)
        if self.keep_frozen:
            self.bn.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("keep_frozen", [False, True])
def test_a_frozen_batchnorm_stays_frozen_only_through_an_overridden_train(keep_frozen):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(4)]
    model, reference = _FrozenNorm(keep_frozen), _FrozenNorm(keep_frozen)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as w:
        w.fit(batches)
    reference.train()
    reference.bn.eval()  # a plain loop freezes it after train()
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    frozen_mean = torch.full((4,), 0.3)
    # README: fit() calls model.train(), which undoes bn.eval() unless train() keeps it.
    assert torch.equal(model.bn.running_mean, frozen_mean) is keep_frozen
    assert torch.equal(model.head.weight, reference.head.weight) is keep_frozen
    assert not model.bn.training  # the user's own model's modes are left as they were


def test_one_worker_is_plain_training_and_shared_gradients_returns_its_local_view():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
               for _ in range(6)]
    torch.manual_seed(0)
    reference = MLP(in_features=64, hidden=[256])
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    trained = {}
    for mode in ("allreduce", "shared_gradients"):
        model = MLP(in_features=64, hidden=[256])
        model.load_state_dict(initial)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             training_mode=mode) as w:
            trained[mode] = (model, w.fit(batches)["per_worker"][0])
    assert digest(trained["allreduce"][0]) == digest(reference)
    # README: one replica still threshold-encodes, about 1/160 of the elements a step, and
    # fit() returns its local view, near plain training (the residual clipping takes from
    # it; the shared parameters alone had moved under 1/10 of the elements).
    model, stats = trained["shared_gradients"]
    assert 1 / 200 < stats["mean_sparsity"] < 1 / 120
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=5e-3)
    moved = sum(int((p != initial[k]).sum()) for k, p in model.state_dict().items())
    assert moved > sum(v.numel() for v in initial.values()) / 2


def test_one_worker_with_dropout_is_the_plain_loop_bit_for_bit():
    """The one worker runs on the caller's RNG: fit() draws nothing from it first (a seed for
    workers drawn there would shift every dropout mask)."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(8)]
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3))
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(11)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        torch.manual_seed(11)
        w.fit(batches)
    assert digest(model) == digest(reference)


@pytest.mark.parametrize("mode", ["averaging", "allreduce"])
def test_one_worker_over_a_shuffling_dataloader_is_the_plain_loop_bit_for_bit(mode):
    """Each iter(DataLoader) draws a seed from torch's RNG before its sampler (none given:
    from torch's RNG too) shuffles: the fit skipped it, so the order and every dropout mask
    after it were not the loop's (0.14 and 0.45 apart)."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3))
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(11)
    for _ in range(3):
        for x, y in DataLoader(data, batch_size=8, shuffle=True):
            opt.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            opt.step()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         training_mode=mode) as w:
        torch.manual_seed(11)
        w.fit(DataLoader(data, batch_size=8, shuffle=True), epochs=3)
    assert digest(model) == digest(reference)


@pytest.mark.parametrize(("lr", "diverges"), [(1.2, True), (0.05, False)])
def test_a_loss_that_keeps_growing_is_warned_about(lr, diverges):
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    y = 3 * x[:, :1] + 1
    model = nn.Linear(5, 1)
    wrapper = ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=1, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapper.fit([(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)], epochs=4)
    said = [str(w.message) for w in caught if "diverging" in str(w.message)]
    assert len(said) == int(diverges), said
    if diverges:
        assert "Lower the learning rate" in said[0]


def test_models_paraloom_cannot_replicate_as_they_are_are_refused_with_the_fix() -> None:
    from torch.nn.parallel import DataParallel

    inner = nn.Linear(4, 2)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"model is a DataParallel.*pass the wrapped module, "
                                        r"model\.module"):
        ParallelWrapper(DataParallel(inner), loss_fn=nn.MSELoss(), optimizer=opt)
    lazy = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 1))
    with pytest.raises(TypeError, match=r"lazy tensors .*\['0.weight', '0.bias'\].*run one "
                                        r"forward pass"):
        ParallelWrapper(lazy, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(
            lazy.parameters(), lr=0.1))
    norm = nn.Sequential(nn.Linear(4, 3), nn.LazyBatchNorm1d(affine=False))  # lazy buffers
    with pytest.raises(TypeError, match=r"lazy tensors .*running_mean"):
        ParallelWrapper(norm, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(
            norm.parameters(), lr=0.1))
    complex_model = nn.Linear(4, 2, dtype=torch.complex64)
    for mode in ("shared_gradients", "diloco"):
        with pytest.raises(ValueError, match=f"training_mode='{mode}' takes real parameters"):
            ParallelWrapper(complex_model, loss_fn=nn.MSELoss(), training_mode=mode,
                            optimizer=torch.optim.SGD(complex_model.parameters(), lr=0.1))


def test_a_one_shot_generator_for_several_epochs_is_refused_before_workers_start():
    model = nn.Linear(4, 2)
    batches = ((torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3))
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with wrapper:
        with pytest.raises(ValueError, match="one-shot generator.*asks for 2 epochs.*"
                                             "re-iterable source"):
            wrapper.fit(batches, epochs=2)
        assert wrapper._pool is None  # refused before any worker started
        assert wrapper.fit(batches, epochs=1)["rounds"] == 2  # one pass is what it holds
