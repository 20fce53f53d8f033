"""The inference benchmark runs end to end on a tiny setting and writes its JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from paraloom.bench import inference


@pytest.mark.timeout(60)
def test_benchmark_writes_ratios_and_config(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    inference.add_arguments(parser)
    out = tmp_path / "inference.json"
    args = parser.parse_args(["--clients", "4", "--requests", "5", "--image-size", "8",
                              "--offline-seconds", "0.05", "--output", str(out)])
    assert inference.run(args) == 0
    result = json.loads(out.read_text())
    batched, naive, offline = result["batched"], result["naive"], result["offline"]
    assert batched["requests"] == naive["requests"] == 20
    assert batched["latency_ms"]["p50"] <= batched["latency_ms"]["p99"]
    assert result["ratios"]["batched_vs_naive"] == pytest.approx(
        batched["throughput"] / naive["throughput"])
    assert result["ratios"]["batched_vs_offline"] == pytest.approx(
        batched["throughput"] / offline["throughput"])
    config = result["config"]
    assert config["workers"] * config["threads_per_worker"] <= result["machine"]["cores"]
    assert "batched / offline" in capsys.readouterr().out
