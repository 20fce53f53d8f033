"""report_score_after_averaging=True shows the score where no logging is configured (as DL4J)."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper
from paraloom.training.tracker import score_log


@pytest.fixture
def no_logging_setup(monkeypatch):
    """As in a fresh script: no handler anywhere (pytest's own, added to the root logger as
    the test body starts, are taken off by ``clear_root()``)."""
    monkeypatch.setattr(score_log, "handlers", [])
    monkeypatch.setattr(score_log, "propagate", True)
    monkeypatch.setattr(score_log, "level", logging.NOTSET)
    monkeypatch.setattr(logging.root, "level", logging.WARNING)
    parent = logging.getLogger("paraloom")  # nothing an earlier test left on the parent either
    monkeypatch.setattr(parent, "handlers", [])
    monkeypatch.setattr(parent, "level", logging.NOTSET)
    logging.Logger.manager._clear_cache()
    yield
    logging.Logger.manager._clear_cache()


def clear_root(monkeypatch) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])


def _fit(progress: bool) -> list[float]:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    model = nn.Linear(4, 1)
    losses: list[float] = []
    ParallelWrapper(model, loss_fn=nn.MSELoss(),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1), workers=1,
                    report_score_after_averaging=True, averaging_frequency=2, progress=progress,
                    listeners=[lambda i, e, loss: losses.append(loss)]
                    ).fit([(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])
    return losses


def test_the_averaged_score_is_shown_without_any_logging_setup(no_logging_setup, monkeypatch,
                                                               capsys):
    clear_root(monkeypatch)
    losses = _fit(progress=False)
    shown = re.findall(r"paraloom: Averaged score: ([\d.]+) \(iteration (\d)",
                       capsys.readouterr().err)
    # every second round is an averaging round; its score is that round's loss
    assert shown == [(f"{losses[1]:.6f}", "1"), (f"{losses[3]:.6f}", "3")]
    _fit(progress=True)  # through the progress bar, and the handler is not installed twice
    err = capsys.readouterr().err
    assert err.count("paraloom: Averaged score:") == 2 and "batch" in err


def test_the_score_follows_a_stderr_redirected_after_the_handler_was_made(no_logging_setup,
                                                                          monkeypatch):
    clear_root(monkeypatch)
    _fit(progress=False)  # installs the handler, writing to the stderr of that moment
    later = io.StringIO()
    with contextlib.redirect_stderr(later):
        losses = _fit(progress=False)
    assert re.findall(r"Averaged score: ([\d.]+)", later.getvalue()) == \
        [f"{losses[1]:.6f}", f"{losses[3]:.6f}"]


def test_a_user_logging_setup_is_respected(no_logging_setup, monkeypatch, capsys):
    clear_root(monkeypatch)
    logging.basicConfig(level=logging.WARNING)
    _fit(progress=False)
    assert "Averaged score" not in capsys.readouterr().err
