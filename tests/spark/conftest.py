"""One local[2] SparkSession for every Spark test (starting one costs 6 s or more)."""

from __future__ import annotations

import os
import shutil
import sys

import cloudpickle
import pytest
import spark_helpers

# Executors import paraloom from the venv, but not this test folder: ship the helpers by value.
cloudpickle.register_pickle_by_value(spark_helpers)

try:
    import pyspark  # noqa: F401
except ImportError:  # without the [spark] extra there is nothing here to run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def spark():
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("the Spark tests need Java 17 or later")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("paraloom-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.barrier.sync.timeout", "120")
               # Two attempts per stage: a killed task is retried once, then fails clearly.
               .config("spark.stage.maxConsecutiveAttempts", "2")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "2s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def sc(spark):
    return spark.sparkContext
