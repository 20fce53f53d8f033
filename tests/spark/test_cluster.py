"""A real standalone cluster on 127.0.0.1: a master and two worker JVMs, started with
``spark-class`` from the pyspark install, a fit from Parquet, evaluate and predict.

Slow (a minute or more on 2 cores): left out of the default run, which ``scripts/test.sh -m slow``
(and CI, after the suite) adds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_class() -> str:
    import pyspark

    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    if not path.exists():
        pytest.skip(f"no spark-class in the pyspark install ({path})")
    return str(path)


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Spark master exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the Spark master did not listen on port {port} in {timeout:g} s")


def _stop(proc: subprocess.Popen) -> None:
    """The daemon and everything it started (executors, Python workers): its process group."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            break
    with contextlib.suppress(ProcessLookupError):  # stragglers of the group
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture()
def cluster(tmp_path):
    """``spark://127.0.0.1:PORT`` with two one-core workers; stopped (group-killed) after."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("the Spark tests need Java 17 or later")
    import paraloom

    src = str(Path(paraloom.__file__).parent.parent)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([src, str(HERE)]), "SPARK_NO_DAEMONIZE": "1",
           "SPARK_LOG_DIR": str(tmp_path / "logs"), "SPARK_WORKER_DIR": str(tmp_path / "work"),
           "SPARK_DAEMON_MEMORY": "256m"}
    spark_class, port = _spark_class(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([spark_class, *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        procs.append(proc)
        return proc

    try:
        master = start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                       "--port", str(port), "--webui-port", str(_free_port()))
        _wait_port(port, master, 60)
        for i in range(2):
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", url, "--host",
                  "127.0.0.1", "--cores", "1", "--memory", "1g",
                  "--webui-port", str(_free_port()), "--work-dir", str(tmp_path / f"w{i}"))
        yield url, env
    finally:
        for proc in reversed(procs):
            _stop(proc)


def test_a_standalone_cluster_trains_from_parquet_evaluates_and_predicts(cluster, tmp_path):
    url, env = cluster
    run = subprocess.run([sys.executable, str(HERE / "cluster_driver.py"), url, str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1])
    print("cluster test phases (s from session start):", result["seconds"])
    assert result["executors"] == 2 and result["default_parallelism"] == 2
    assert result["rows_per_worker"] == [719, 719]  # each worker read its Parquet share
    assert result["killed"] and result["rerun_attempts"] == 2  # a worker died, the stage re-ran
    assert result["rerun_samples"] < 3 * 1438 and result["rerun_same_parameters"]
    assert result["samples"] == 3 * 1438
    assert result["accuracy"] >= 0.8
    assert result["accuracy"] == pytest.approx(result["local_accuracy"], abs=1e-9)
    assert result["predicted_rows"] == 359 and result["max_prediction_gap"] < 1e-4
