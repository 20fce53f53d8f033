"""Which Python the executors run, and the fix when it cannot import paraloom."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["use_driver_python", "missing_paraloom_hint"]


def use_driver_python(sc: SparkContext) -> bool:
    """For a local master URL, the executors run this interpreter (a virtual environment's Python
    given by path, say), unless PYSPARK_PYTHON or spark.pyspark.python says otherwise; returns
    whether it changed anything."""
    if not str(sc.master).startswith("local") or os.environ.get("PYSPARK_PYTHON"):
        return False
    if sc.getConf().get("spark.pyspark.python") or sc.pythonExec == sys.executable:
        return False
    sc.pythonExec = sys.executable  # read as each job's Python functions are wrapped
    return True


def missing_paraloom_hint(error: str, python: str) -> str | None:
    """The fix for an executor that cannot import paraloom or torch (None for other errors)."""
    missing = next((m for m in ("paraloom", "torch") if f"No module named '{m}'" in error), None)
    if missing is None:
        return None
    return (f"the executors' Python ({python!r}) cannot import {missing}. Point Spark at an "
            "interpreter that has it: export PYSPARK_PYTHON=/path/to/venv/bin/python (or set "
            "spark.pyspark.python) before the SparkSession starts, or install paraloom on every "
            "executor (or ship the environment with --archives)")
