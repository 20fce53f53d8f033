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
    from paraloom.bench.arguments import wait, whole

    assert whole("0") == 0 and wait("0") == 0.0
