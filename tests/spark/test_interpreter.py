"""The executors' Python: the driver's on a local master; the fix when it lacks paraloom."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from paraloom.spark.runtime.interpreter import missing_paraloom_hint, use_driver_python
from paraloom.spark.training.jobs import SparkTrainingError, run_job


def _context(master: str, conf: dict[str, str] | None = None):
    return SimpleNamespace(master=master, pythonExec="python3",
                           getConf=lambda: SimpleNamespace(get=(conf or {}).get))


def test_a_local_master_runs_the_drivers_interpreter(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    sc = _context("local[2]")
    assert use_driver_python(sc) and sc.pythonExec == sys.executable
    # told otherwise, or not local: left alone
    sc = _context("local[2]", {"spark.pyspark.python": "/opt/py/bin/python"})
    assert not use_driver_python(sc) and sc.pythonExec == "python3"
    sc = _context("spark://head:7077")
    assert not use_driver_python(sc) and sc.pythonExec == "python3"
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/py/bin/python")
    sc = _context("local[*]")
    assert not use_driver_python(sc) and sc.pythonExec == "python3"


def test_an_executor_without_paraloom_gets_the_fix():
    error = ("py4j.protocol.Py4JJavaError: An error occurred while calling o42.collect.\n"
             "org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage "
             "1.0 failed 1 times\nModuleNotFoundError: No module named 'paraloom'")
    assert missing_paraloom_hint("ValueError: bad", "python3") is None
    assert "cannot import torch" in missing_paraloom_hint(
        "ModuleNotFoundError: No module named 'torch'", "/usr/bin/python3")

    def fail():
        raise RuntimeError(error)

    tracker = SimpleNamespace(getJobIdsForGroup=lambda group: [])
    sc = SimpleNamespace(pythonExec="python3", setJobGroup=lambda *a, **k: None,
                         setLocalProperty=lambda *a: None, statusTracker=lambda: tracker)
    with pytest.raises(SparkTrainingError) as info:
        run_job(sc, fail, "training")
    message = str(info.value)
    assert "No module named 'paraloom'" in message
    assert "executors' Python ('python3') cannot import paraloom" in message
    assert "export PYSPARK_PYTHON=/path/to/venv/bin/python" in message
