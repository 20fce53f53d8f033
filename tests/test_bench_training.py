"""``paraloom bench training`` end to end on a tiny MLP: the sweep's flags, paired repeats,
the fixed cost per round, accumulation and compile in every contender."""

from __future__ import annotations

import json

import pytest

from paraloom.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # a real (small) benchmark run: DDP and paraloom twice each
def test_a_width_with_repeats_reports_bracketed_ratios_and_the_fixed_cost(tmp_path, capsys):
    out = tmp_path / "training.json"
    assert main(["bench", "training", "--model", "mlp", "--width", "16", "--samples", "512",
                 "--epochs", "1", "--modes", "allreduce", "--repeat", "2", "--accumulate", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mlp16: " in printed and "fixed cost per" in printed
    result = json.loads(out.read_text())["models"]["mlp16"]
    runs = result["ratio_to_ddp_runs"]
    assert runs["ddp"] == [1.0] * 4  # DDP before and after the mode, twice
    assert len(runs["paraloom_allreduce"]) == 2 and all(r > 0 for r in runs["paraloom_allreduce"])
    assert result["ratio_to_ddp"]["paraloom_allreduce"] == pytest.approx(
        sum(runs["paraloom_allreduce"]) / 2)  # the median of two
    cost = result["fixed_cost"]["paraloom_allreduce"]
    assert 0 < cost["parent_cpu"] < cost["round"] and 0 <= cost["share"] < 1
    assert "compile_seconds" not in result  # nothing compiled, nothing reported
    assert result["parameters"] == 784 * 16 + 16 + 2 * (16 * 16 + 16) + 16 * 10 + 10


def test_compile_seconds_of_the_warm_up_are_reported_apart(monkeypatch):
    """--compile's cost is the warm-up's (``compile_seconds`` of the first fit), reported beside
    the rates; torch.compile itself is tested in tests/training/test_accumulate.py."""
    import argparse

    from paraloom.bench import training

    seen = {}

    def fake_wrapper(args, data, mode):
        seen["compile"] = args.compile
        return {"samples_per_s": 100.0, "whole_fit_30_samples_per_s": 90.0,
                "bytes_per_step_per_worker": 8.0, "fixed_cost": {}, "compile_seconds": 2.5,
                "sync_seconds_per_step": {}, "step_seconds": 0.01, "fit_samples_per_s": 95.0}

    monkeypatch.setattr(training, "_wrapper", fake_wrapper)
    results = {"samples_per_s": {}, "whole_fit_30_samples_per_s": {},
               "bytes_per_step_per_worker": {}}
    training._measure_mode(argparse.Namespace(compile=True), None, "allreduce", results)
    assert seen == {"compile": True}
    assert results["compile_seconds"] == {"paraloom_allreduce": 2.5}


def test_a_width_applies_to_the_mlp_only(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "training", "--model", "lenet", "--width", "64"])
    assert exited.value.code == 2
    assert "--width 64 applies to --model mlp only" in capsys.readouterr().err


def test_the_steady_rate_counts_rounds_answered_together_once():
    from paraloom.bench.common import steady_rate

    # Rounds 0-1 alone, then groups of 4 answered together every 0.4 s (0.1 s a round): the
    # first group kept ends at 1.0, and 8 rounds ran in the 0.8 s after it.
    times = [0.1, 0.2] + [1.0] * 4 + [1.4] * 4 + [1.8] * 4
    assert steady_rate(times, rows_per_round=10, skip=2) == pytest.approx(8 * 10 / 0.8)
    with pytest.raises(ValueError, match="fewer than two groups"):
        steady_rate([0.1, 0.2, 1.0, 1.0], rows_per_round=10)
