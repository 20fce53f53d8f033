"""``paraloom bench`` refuses counts and durations that cannot run, and unknown names, by
the option's name before anything is measured (they were a ZeroDivisionError traceback, an
empty error, a silent default, or a benchmark run on a name that does not exist)."""

from __future__ import annotations

import pytest

from paraloom.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["inference", "--clients", "0"], "argument --clients: 0 is not an int >= 1"),
    (["inference", "--clients", "-1"], "argument --clients: -1 is not an int >= 1"),
    (["inference", "--workers", "0"], "argument --workers: 0 is not an int >= 1"),
    (["inference", "--offline-seconds", "0"], "--offline-seconds: 0.0 is not a duration > 0"),
    (["inference", "--max-wait-ms", "-1"], "--max-wait-ms: -1.0 is not a duration >= 0"),
    (["training", "--workers", "0"], "argument --workers: 0 is not an int >= 1"),
    (["training", "--modes", "bogus"], "--modes: 'bogus': expected comma-separated modes"),
    (["training", "--modes", "allreduce+fast"], "'allreduce+fast'"),
    (["data", "--configs", "bogus"], "--configs: ['bogus']: expected comma-separated names"),
    (["serving", "--concurrency", "abc"], "argument --concurrency: 'abc' is not an int"),
    (["serving", "--concurrency", "1,0"], "argument --concurrency: 0 is not an int >= 1"),
    (["faults", "--spares", "-1"], "argument --spares: -1 is not an int >= 0"),
    (["faults", "--every", "nan"], "argument --every: 'nan' is not a finite number"),
])
def test_a_value_that_cannot_run_is_refused_by_its_option(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["bench", *argv])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_where_it_means_none_is_taken() -> None:
    from paraloom.arguments import wait, whole

    assert whole("0") == 0 and wait("0") == 0.0


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--workers", "0"], "train: error: argument --workers: 0 is not an int >= 1"),
    (["train", "--epochs", "0"], "argument --epochs: 0 is not an int >= 1"),
    (["train", "--sync-every", "-3"], "argument --sync-every: -3 is not an int >= 1"),
    (["train", "--averaging-frequency", "x"], "argument --averaging-frequency: 'x' is not an int"),
    (["serve", "--workers", "0", "m.safetensors"], "argument --workers: 0 is not an int >= 1"),
    (["serve", "--batch-limit", "0", "m.safetensors"], "argument --batch-limit: 0 is not"),
    (["serve", "--queue-limit", "-1", "m.safetensors"], "argument --queue-limit: -1 is not"),
    (["serve", "--processes", "0", "m.safetensors"], "argument --processes: 0 is not"),
    (["serve", "--threads-per-worker", "0", "m.safetensors"], "--threads-per-worker: 0 is not"),
    (["serve", "--max-wait-ms", "-1", "m.safetensors"], "--max-wait-ms: -1.0 is not a duration"),
])
def test_the_commands_refuse_a_count_by_its_option_before_loading_anything(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`paraloom serve --workers 0 --models-dir EMPTY` used to serve (no model ever built the
    pool that would refuse it), and with a model the error read `workers=0`, a keyword the
    command line does not have."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
