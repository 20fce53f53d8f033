"""EarlyStoppingParallelTrainer: every condition, calculator and saver, on real training."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import Scalar, ScalarFrom, accuracy, linear_loss

from paraloom import ParallelWrapper, TrainingListener
from paraloom.early_stopping import (
    AccuracyCalculator,
    BestScore,
    CallableCalculator,
    EarlyStoppingConfig,
    EarlyStoppingParallelTrainer,
    F1Calculator,
    InMemoryModelSaver,
    LocalDirectorySaver,
    LossCalculator,
    MaxEpochs,
    MaxScore,
    MaxTime,
    MSECalculator,
    ScoreImprovement,
)
from paraloom.listeners import CheckpointListener
from paraloom.models import LeNet

pytestmark = pytest.mark.timeout(180)


def _lenet_trainer(config, loader, **kw):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2, progress=False)
    options.update(kw)
    if options.get("training_mode", "averaging") == "averaging":
        options["averaging_frequency"] = 3
    return model, EarlyStoppingParallelTrainer(config, model, loader, **options)


def test_early_stopped_run_returns_the_best_model(digits_loader, digits_test, tmp_path):
    test_loader = DataLoader(digits_test, batch_size=128)
    calc = AccuracyCalculator(test_loader)
    config = EarlyStoppingConfig(
        epoch_conditions=[MaxEpochs(8), ScoreImprovement(patience=2, min_delta=0.001)],
        score_calculator=calc, model_saver=LocalDirectorySaver(tmp_path), save_last_model=True)
    model, trainer = _lenet_trainer(config, digits_loader, training_mode="allreduce")
    result = trainer.fit()
    assert result.termination_reason == "epoch_condition"
    assert result.total_epochs == len(result.scores) <= 8
    assert sorted(result.scores) == list(range(result.total_epochs))
    assert result.best_score == max(result.scores.values())
    assert result.scores[result.best_epoch] == result.best_score
    assert result.best_score >= 0.93
    # The reported best is really the best model's score, re-measured.
    assert calc.score(result.best_model) == result.best_score
    assert accuracy(result.best_model, digits_test) == pytest.approx(result.best_score, abs=1e-6)
    # The latest model is the user's model after the last epoch.
    latest = config.model_saver.latest_model()
    assert accuracy(latest, digits_test) == accuracy(model, digits_test)
    assert set(p.name for p in tmp_path.iterdir()) >= {"best.safetensors", "latest.safetensors"}
    if "ScoreImprovement" in result.termination_details:
        best_then = [e for e in result.scores if e > result.best_epoch]
        assert len(best_then) == 2


def test_best_score_and_loss_calculator(digits_loader, digits_test):
    test_loader = DataLoader(digits_test, batch_size=128)
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(10), BestScore(0.5)],
                                 score_calculator=LossCalculator(test_loader,
                                                                 nn.CrossEntropyLoss()))
    _, trainer = _lenet_trainer(config, digits_loader, workers=1)
    result = trainer.fit()
    assert result.termination_details == "BestScore(0.5)"
    assert result.best_score <= 0.5 and result.total_epochs < 10
    assert result.scores[result.total_epochs - 1] <= 0.5
    assert all(s > 0.5 for e, s in result.scores.items() if e < result.total_epochs - 1)


class _RecordingMaxTime(MaxTime):
    """MaxTime that records each answer, so the test checks when it fired, not how fast we are."""

    def initialize(self) -> None:
        super().initialize()
        self.answers: list[bool] = []

    def terminate(self, iteration: int, loss: float) -> bool:
        self.answers.append(super().terminate(iteration, loss))
        return self.answers[-1]


def test_max_times_clock_starts_at_the_first_round_not_before_the_workers() -> None:
    """The workers' start (1.7 s on this machine) used up MaxTime(1.0) before one round."""
    condition = MaxTime(0.05)
    condition.initialize()
    time.sleep(0.1)  # the workers start
    assert not condition.terminate(0, 1.0)
    time.sleep(0.06)
    assert condition.terminate(1, 1.0)


def test_max_time_stops_within_a_round(digits_loader, digits_test):
    # 1 s: a round takes milliseconds, but on a loaded 2-core machine the first one once took
    # longer than the 0.3 s this test used, and the deadline fell in it.
    max_time = _RecordingMaxTime(1.0)
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(10_000)],
                                 iteration_conditions=[max_time],
                                 score_calculator=F1Calculator(DataLoader(digits_test, 128)))
    _, trainer = _lenet_trainer(config, digits_loader, workers=1)
    result = trainer.fit()
    assert result.termination_reason == "iteration_condition"
    assert result.termination_details == "MaxTime(1.0)"
    # Rounds ran until the deadline, and the first round past it was the last one.
    assert len(max_time.answers) > 1 and max_time.answers[-1]
    assert not any(max_time.answers[:-1])
    assert result.total_epochs < 10_000


def test_a_second_fit_after_an_iteration_condition_trains_again(digits_loader, digits_test):
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(1000)],
                                 iteration_conditions=[MaxTime(0.2)],
                                 score_calculator=F1Calculator(DataLoader(digits_test, 128)))
    _, trainer = _lenet_trainer(config, digits_loader, workers=1)
    assert trainer.fit().termination_reason == "iteration_condition"
    config.iteration_conditions[:] = []  # the watch holds this list: no time limit now
    config.epoch_conditions[:] = [MaxEpochs(2)]
    result = trainer.fit()
    assert result.termination_reason == "epoch_condition" and result.total_epochs == 2
    assert result.best_epoch >= 0 and result.best_model is not None


def test_divergence_ends_with_the_best_model_not_an_error():
    # lr=10 on a quadratic explodes to inf and then NaN within a few rounds.
    model = nn.Linear(1, 1)
    data = [(torch.randn(16, 1), torch.randn(16, 1)) for _ in range(4)]
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(50)],
                                 iteration_conditions=[MaxScore(1e6)],
                                 score_calculator=MSECalculator(data))
    trainer = EarlyStoppingParallelTrainer(config, model, data, loss_fn=nn.MSELoss(), workers=2,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=10.0),
                                           progress=False)
    result = trainer.fit()
    assert result.termination_reason == "iteration_condition"
    assert "MaxScore" in result.termination_details or "non-finite" in result.termination_details
    assert result.total_epochs < 50
    assert math.isfinite(result.best_score)


def test_callable_score_and_validation():
    calls = []

    def score(model):
        calls.append(float(model.w.detach()))
        return abs(float(model.w.detach()) + 3)  # closest to w = -3 is best (lower is better)

    model = Scalar()
    data = [(torch.tensor([[1.0]]), torch.zeros(1))]
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(6)], score_calculator=score)
    trainer = EarlyStoppingParallelTrainer(config, model, data, loss_fn=linear_loss, workers=1,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           progress=False)
    result = trainer.fit()
    assert calls == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert result.best_epoch == 2 and result.best_score == 0.0
    assert float(result.best_model.w.detach()) == -3.0
    with pytest.raises(ValueError, match="score_calculator="):
        EarlyStoppingConfig(epoch_conditions=[MaxEpochs(1)])
    with pytest.raises(ValueError, match="termination condition"):
        EarlyStoppingConfig(score_calculator=score)
    with pytest.raises(ValueError, match="patience"):
        ScoreImprovement(patience=0)


def _first_weight(model: nn.Module) -> float:
    return float(next(model.parameters()).detach())


def _scalar_run(model, saver, **kw):
    """Six epochs moving w by -1 each from 0, scored |w + 3|: the best is epoch 2 (w = -3)."""
    data = [(torch.tensor([[1.0]]), torch.zeros(1))]
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(6)], model_saver=saver,
                                 save_last_model=True,
                                 score_calculator=lambda m: abs(_first_weight(m) + 3))
    return EarlyStoppingParallelTrainer(config, model, data, loss_fn=linear_loss, workers=1,
                                        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                        progress=False, **kw)


@pytest.mark.parametrize("build", [lambda: nn.Sequential(Scalar()), lambda: ScalarFrom(0.0)],
                         ids=["sequential", "constructor_arguments"])
def test_local_directory_saver_gives_back_models_its_files_cannot_rebuild(tmp_path, build):
    model, saver = build(), LocalDirectorySaver(tmp_path)
    with pytest.warns(UserWarning, match=r"cannot rebuild the model on their own.*factory="):
        result = _scalar_run(model, saver).fit()
    assert result.scores == {0: 2.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 2.0, 5: 3.0}
    assert (result.best_epoch, result.best_score, result.total_epochs) == (2, 0.0, 6)
    assert type(result.best_model) is type(model) and _first_weight(result.best_model) == -3.0
    assert _first_weight(saver.latest_model()) == _first_weight(model) == -6.0
    # A later program: a new saver on the directory rebuilds with factory=, or says to pass it.
    assert _first_weight(LocalDirectorySaver(tmp_path, factory=build).best_model()) == -3.0
    with pytest.raises((ValueError, TypeError)):
        LocalDirectorySaver(tmp_path).best_model()


def test_a_saver_that_cannot_give_back_the_best_model_keeps_the_result():
    class Broken(InMemoryModelSaver):
        def best_model(self):
            raise RuntimeError("disk gone")

    with pytest.warns(UserWarning, match=r"Broken.best_model\(\) failed.*disk gone"):
        result = _scalar_run(Scalar(), Broken()).fit()
    assert result.best_model is None
    assert (result.best_epoch, result.best_score, result.scores[5]) == (2, 0.0, 3.0)


def test_a_one_shot_generator_is_refused_before_any_training():
    model = Scalar()
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(3)],
                                 score_calculator=lambda m: 0.0)
    batches = ((torch.tensor([[1.0]]), torch.zeros(1)) for _ in range(4))
    with pytest.raises(ValueError, match="one-shot generator.*re-iterable"):
        EarlyStoppingParallelTrainer(config, model, batches, loss_fn=linear_loss, workers=1,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    assert float(model.w.detach()) == 0.0  # nothing trained


def test_conditions_in_isolation():
    imp = ScoreImprovement(patience=2, min_delta=0.1)
    imp.initialize()
    seq = [imp.terminate(e, s, True) for e, s in enumerate([0.5, 0.55, 0.7, 0.75, 0.78])]
    assert seq == [False, False, False, False, True]
    assert BestScore(0.9).terminate(0, 0.91, True) and not BestScore(0.9).terminate(0, 0.91, False)
    assert MaxScore(10).terminate(0, float("nan")) and MaxScore(10).terminate(0, 11)
    assert not MaxScore(10).terminate(0, 9)
    assert MaxEpochs(3).terminate(2, 0.0, True) and not MaxEpochs(3).terminate(1, 0.0, True)


def test_listeners_see_the_real_epochs_under_early_stopping(tmp_path):
    from paraloom.listeners import CheckpointListener, TrainingListener

    epochs_seen = []

    class Epochs(TrainingListener):
        def on_epoch_end(self, epoch, loss):
            epochs_seen.append(epoch)

    model = Scalar()
    data = [(torch.tensor([[1.0]]), torch.zeros(1))]
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(4)],
                                 score_calculator=lambda m: float(m.w.detach()))
    trainer = EarlyStoppingParallelTrainer(
        config, model, data, loss_fn=linear_loss, workers=1, progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        listeners=[Epochs(), CheckpointListener(tmp_path, every_n_epochs=2)])
    trainer.fit()
    assert epochs_seen == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-epoch1-iter2.safetensors", "checkpoint-epoch3-iter4.safetensors"]


def test_a_nan_score_is_the_worst_and_a_later_score_is_best():
    scores = iter([math.nan, 0.5, 0.9, 0.7])  # higher is better: epoch 2
    model = Scalar()
    data = [(torch.tensor([[1.0]]), torch.zeros(1))]
    config = EarlyStoppingConfig(
        epoch_conditions=[MaxEpochs(4)],
        score_calculator=CallableCalculator(lambda m: next(scores), higher_is_better=True))
    result = EarlyStoppingParallelTrainer(
        config, model, data, loss_fn=linear_loss, workers=1, progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0)).fit()
    assert result.best_epoch == 2 and result.best_score == 0.9
    assert float(result.best_model.w.detach()) == -3.0


def test_a_per_step_schedule_runs_on_across_the_epochs_of_early_stopping():
    """Early stopping runs one fit() per epoch (initial_epoch=k): the replicas' lr_scheduler
    goes on where it stood, as in one fit, rather than starting its schedule again."""
    data = [(torch.tensor([[1.0]]), torch.zeros(1))] * 4  # 2 rounds an epoch with 2 workers
    lrs = []

    def schedule(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step))

    def record(m):
        lrs.append(optimizer.param_groups[0]["lr"])
        return 0.0

    model = Scalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(3)], score_calculator=record)
    EarlyStoppingParallelTrainer(config, model, data, loss_fn=linear_loss, workers=2,
                                 optimizer=optimizer, lr_scheduler=schedule,
                                 progress=False).fit()
    assert lrs == pytest.approx([1 / 3, 1 / 5, 1 / 7])  # one schedule over 6 rounds


def test_the_saver_writes_a_missing_score_as_json_null(tmp_path):
    """An epoch not evaluated has score NaN, which json.dumps wrote as NaN: not JSON (jq and
    JavaScript refuse it)."""
    import json

    from paraloom.early_stopping import LocalDirectorySaver
    from paraloom.models import MLP

    saver = LocalDirectorySaver(tmp_path)
    saver.save_latest(MLP(in_features=4, hidden=[3], num_classes=2), 2, float("nan"))
    text = next(tmp_path.glob("*.json")).read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {"epoch": 2,
                                                                          "score": None}


class _CrashAt(TrainingListener):
    """A crash at round ``at``: the process would die; here fit() raises."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_iteration(self, iteration, epoch, loss):
        if iteration == self.at:
            raise RuntimeError("the machine went down")


def _loss(data):
    return LossCalculator(DataLoader(data, batch_size=256), nn.CrossEntropyLoss())


def _resumable(digits_loader, digits_test, saver_dir, listeners, mode):
    config = EarlyStoppingConfig(
        epoch_conditions=[MaxEpochs(4), ScoreImprovement(patience=1, min_delta=0.5)],
        score_calculator=_loss(digits_test),
        model_saver=LocalDirectorySaver(saver_dir))
    return _lenet_trainer(config, digits_loader, training_mode=mode, listeners=listeners)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("mode", "every", "crash"), [
    ("averaging", 10, 55),   # the last checkpoint in the middle of epoch 2
    ("allreduce", None, 50),  # the last at the end of epoch 1, before it was scored
    # The fit resumed at an epoch's end trains no round: the local view it restored was set
    # over the next fit's parameters (scores of 2e31, or NaN).
    ("shared_gradients", None, 50),
])
def test_early_stopping_resumes_exactly_from_a_checkpoint(digits_loader, digits_test, tmp_path,
                                                          mode, every, crash):
    """There was no resume_from: a crash three epochs into a run started it again."""
    model, trainer = _resumable(digits_loader, digits_test, tmp_path / "ref", [], mode)
    reference = trainer.fit()
    expected = _weights(model)
    assert reference.total_epochs >= 3  # the crash falls before the run's end
    checkpoints = CheckpointListener(tmp_path / "ckpt", every_n_iterations=every)
    _, crashing = _resumable(digits_loader, digits_test, tmp_path / "best",
                             [checkpoints, _CrashAt(crash)], mode)
    with pytest.raises(RuntimeError, match="went down"):
        crashing.fit()
    # A new process would build everything again: fresh conditions, a fresh trainer.
    model, resumed = _resumable(digits_loader, digits_test, tmp_path / "best",
                                [CheckpointListener(tmp_path / "ckpt", every_n_iterations=every)],
                                mode)
    result = resumed.fit(resume_from=tmp_path / "ckpt")
    assert result.scores == reference.scores
    assert (result.best_epoch, result.total_epochs, result.termination_details) == (
        reference.best_epoch, reference.total_epochs, reference.termination_details)
    for key, value in _weights(model).items():
        assert torch.equal(value, expected[key]), key
    best = {k: v for k, v in result.best_model.state_dict().items()}
    for key, value in reference.best_model.state_dict().items():
        assert torch.equal(best[key], value), key


def test_resume_refuses_a_plain_fits_checkpoint_and_changed_conditions(digits_loader,
                                                                       digits_test, tmp_path):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         listeners=[CheckpointListener(tmp_path / "plain")]) as wrapper:
        wrapper.fit(digits_loader)
    _, trainer = _resumable(digits_loader, digits_test, tmp_path / "best", [], "averaging")
    with pytest.raises(ValueError, match="holds no early-stopping scores.*CheckpointListener"):
        trainer.fit(resume_from=tmp_path / "plain")
    # Two epochs scored, then a crash; resumed with MaxEpochs(1), the run had already ended.
    checkpoints = CheckpointListener(tmp_path / "ckpt")
    _, crashing = _resumable(digits_loader, digits_test, tmp_path / "best",
                             [checkpoints, _CrashAt(50)], "averaging")
    with pytest.raises(RuntimeError, match="went down"):
        crashing.fit()
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(1)],
                                 score_calculator=_loss(digits_test))
    _, shorter = _lenet_trainer(config, digits_loader, listeners=[checkpoints])
    with pytest.raises(ValueError, match=r"meet MaxEpochs\(1\) at epoch 0.*conditions differ"):
        shorter.fit(resume_from=tmp_path / "ckpt")
    # An in-memory saver of another process holds no best model: said, not hidden.
    config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(3)],
                                 score_calculator=_loss(digits_test))
    _, in_memory = _lenet_trainer(config, digits_loader, listeners=[checkpoints])
    with pytest.warns(UserWarning, match="cannot give its model back.*LocalDirectorySaver"):
        result = in_memory.fit(resume_from=tmp_path / "ckpt")
    assert sorted(result.scores) == [0, 1, 2]


def test_a_resumed_run_gives_back_a_best_model_its_files_cannot_rebuild(tmp_path):
    """An nn.Sequential's files cannot rebuild it; resumed, the best weights go into a copy of
    the model the resumed run trains, as in the run that saved them."""
    def run(listeners):
        model = nn.Sequential(Scalar())
        config = EarlyStoppingConfig(epoch_conditions=[MaxEpochs(6)],
                                     model_saver=LocalDirectorySaver(tmp_path / "best"),
                                     score_calculator=lambda m: abs(_first_weight(m) + 3))
        return EarlyStoppingParallelTrainer(
            config, model, [(torch.tensor([[1.0]]), torch.zeros(1))], loss_fn=linear_loss,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0), workers=1, progress=False,
            listeners=listeners)

    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(RuntimeError, match="went down"):
        warnings.simplefilter("always")
        run([CheckpointListener(tmp_path / "ckpt"), _CrashAt(4)]).fit()  # best: epoch 2
    assert any("cannot rebuild the model on their own" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run([CheckpointListener(tmp_path / "ckpt")]).fit(resume_from=tmp_path / "ckpt")
    assert [str(w.message) for w in caught if "give" in str(w.message)] == []
    assert (result.best_epoch, result.best_score, result.total_epochs) == (2, 0.0, 6)
    assert type(result.best_model) is nn.Sequential
    assert _first_weight(result.best_model) == -3.0
