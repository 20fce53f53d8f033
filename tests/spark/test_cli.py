"""``paraloom spark-train`` end to end on the test session's local[2]."""

from __future__ import annotations

import argparse
import re

import pytest
from spark_helpers import accuracy

import paraloom


@pytest.mark.timeout(300)
def test_spark_train_trains_reports_and_saves(spark, tmp_path, capsys, digits_test):
    from paraloom.spark import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--training-master", "averaging", "--epochs", "2",
                              "--averaging-frequency", "8", "--workers", "2",
                              "--stats-html", str(tmp_path / "stats.html"),
                              "--out", str(tmp_path / "model.safetensors")])
    assert args.master == "local[2]"
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"accuracy\s+([0-9.]+)", out).group(1))
    model = paraloom.load(tmp_path / "model.safetensors")
    assert printed == pytest.approx(accuracy(model, digits_test), abs=1e-4)
    assert printed > 0.5
    assert "samples/s" in out and "averaging master" in out
    assert 'class="timeline"' in (tmp_path / "stats.html").read_text()
    assert spark.sparkContext._jsc is not None  # the CLI reused the session, did not stop it


def test_spark_train_rejects_a_bad_conf():
    from paraloom.spark.cli import _confs

    assert _confs(["spark.executor.memory=4g"]) == {"spark.executor.memory": "4g"}
    with pytest.raises(ValueError, match="KEY=VALUE"):  # the CLI's error line, exit 2
        _confs(["spark.executor.memory"])


@pytest.mark.parametrize(("flag", "name"), [("--stats-html", "stats"), ("--out", "model"),
                                            ("--stats-json", "nodir/stats.json")])
def test_spark_train_checks_where_it_writes_before_training(tmp_path, flag, name, monkeypatch):
    """--stats-html naming a folder ended a whole run with IsADirectoryError, and the model
    (saved after the stats) was lost."""
    from paraloom.spark import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stats").mkdir()
    (tmp_path / "model").mkdir()
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=f"{flag} {name}"):  # before any data or Spark
        cli.run(parser.parse_args([flag, name, "--data-dir", str(tmp_path / "none")]))


@pytest.mark.parametrize(("args", "message"), [(["--momentum", "1.5"], "--momentum 1.5"),
                                             (["--lr", "nan"], "--lr nan"),
                                             (["--lr", "0"], "--lr 0.0")])
def test_spark_train_refuses_optimizer_settings_as_train_does(tmp_path, args, message):
    from paraloom.spark import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=message):  # before any data or Spark
        cli.run(parser.parse_args([*args, "--data-dir", str(tmp_path / "none")]))


def test_spark_train_diloco_is_the_averaging_master_with_topk():
    from paraloom.spark import TopK, cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    master = cli._master(parser.parse_args(["--training-master", "diloco"]))
    assert master.encoding == TopK() and master.averaging_frequency == 50
    plain = cli._master(parser.parse_args(["--training-master", "averaging"]))
    assert plain.encoding is None and plain.averaging_frequency == 5


@pytest.mark.parametrize(("args", "message"), [
    (["--training-master", "shared", "--averaging-frequency", "7"],
     "--averaging-frequency is an option of --training-master averaging or diloco"),
    (["--training-master", "averaging", "--threshold", "0.01"],
     "--threshold is an option of --training-master shared, and the master is averaging"),
    (["--training-master", "diloco", "--threshold", "0.01"], "the master is diloco")])
def test_spark_train_refuses_another_masters_option_as_train_does(args, message):
    """They were ignored: the fit ran without them and said nothing."""
    from paraloom.spark import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        cli._master(parser.parse_args(args))
    with pytest.raises(SystemExit):  # a threshold that cannot run: argparse, before Spark
        parser.parse_args(["--threshold", "-1"])


@pytest.mark.timeout(120)
def test_spark_train_with_a_master_spark_cannot_start_names_the_flag(tmp_path):
    """local[0] ended in a Python traceback through py4j's SparkException."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "paraloom", "spark-train", "--master",
                           "local[0]", "--epochs", "1"], capture_output=True, text=True,
                          timeout=110, cwd=tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert last.startswith("paraloom spark-train: error: --master 'local[0]': Spark did not "
                           "start (Asked to run locally with 0 threads)")
    assert "expected local[N] with N >= 1" in last
