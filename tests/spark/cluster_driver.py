"""The driver of the standalone-cluster test, run in its own process (one SparkContext each).

``python cluster_driver.py MASTER_URL WORK_DIR`` writes the digits as Parquet, trains a
two-input, two-output model from the directory with ``fit_paths``, evaluates and predicts,
and prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import spark_helpers as h
import torch
from torch import nn

from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel
from paraloom.spark.runtime.state import state_digest

cloudpickle.register_pickle_by_value(h)  # the executors do not see the tests folder

INPUTS = ("top", [f"b{i}" for i in range(32)])


def _executors(sc) -> int:
    return sc._jsc.sc().getExecutorMemoryStatus().size() - 1  # less the driver


def _write_parquet(path: str) -> str:
    """The digits' train split as three Parquet files, written here with pyarrow (quick)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    top, bottom, label, bright = h.two_tower_columns("train")
    os.makedirs(path)
    for i, rows in enumerate(np.array_split(np.arange(len(label)), 3)):
        t = top[rows]
        columns = {"top": pa.FixedSizeListArray.from_arrays(pa.array(t.reshape(-1)), 32),
                   **{f"b{j}": pa.array(bottom[rows, j]) for j in range(32)},
                   "label": pa.array(label[rows].astype(np.int64)),
                   "brightness": pa.array(bright[rows].astype(np.float32))}
        pq.write_table(pa.table(columns), os.path.join(path, f"part-{i}.parquet"))
    return path


def main(url: str, work: str) -> None:
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(url).appName("paraloom-cluster-test")
             .config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.executor.cores", "1").config("spark.cores.max", "2")
             .config("spark.executor.memory", "512m")
             .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
             .config("spark.pyspark.python", sys.executable)
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.stage.maxConsecutiveAttempts", "2")
             .getOrCreate())
    marks = {"session": time.monotonic()}
    try:
        sc = spark.sparkContext
        sc.setLogLevel("ERROR")
        deadline = time.monotonic() + 90
        while _executors(sc) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{_executors(sc)} executor(s) registered in 90 s; expected 2")
            time.sleep(0.2)
        marks["executors"] = time.monotonic()
        path = _write_parquet(os.path.join(work, "train.parquet"))
        marks["parquet"] = time.monotonic()
        torch.manual_seed(0)
        model = h.TwoTowers()
        master = ParameterAveragingTrainingMaster(32, averaging_frequency=25, workers=2,
                                                  job_timeout=60, checkpoint_dir=work)
        net = SparkModel(spark, model, master, loss_fn=[nn.CrossEntropyLoss(), nn.MSELoss()],
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        summary = net.fit_paths(path, epochs=3, inputs=INPUTS, label=("label", "brightness"))
        marks["fit"] = time.monotonic()
        # The same fit again, rank 1's Python worker killed at its 40th step: the stage re-runs
        # and resumes from the checkpoint at step 25, to the same parameters.
        torch.manual_seed(0)
        again = h.TwoTowers()
        marker = os.path.join(work, "killed")
        crashed = SparkModel(spark, again, master,
                             loss_fn=[h.Crash(at=40, marker=marker), nn.MSELoss()],
                             optimizer=torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9))
        rerun = crashed.fit_paths(path, epochs=3, inputs=INPUTS, label=("label", "brightness"))
        marks["killed fit"] = time.monotonic()
        test = h.two_tower_dataframe(spark, "test")
        evaluation = net.evaluate(test, inputs=INPUTS, label=("label", "brightness"), output=0)
        scored = net.predict(test, inputs=INPUTS, output=("digit", "shade"), argmax=False)
        rows = scored.select("digit", "shade").collect()
        marks["evaluate and predict"] = time.monotonic()
        top, bottom, labels, _ = h.two_tower_columns("test")
        with torch.no_grad():
            digit, shade = model.eval()(torch.from_numpy(top), torch.from_numpy(bottom))
        gap = max(float(abs(torch.tensor([r.digit for r in rows]) - digit).max()),
                  float(abs(torch.tensor([r.shade[0] for r in rows]) - shade).max()))
        print(json.dumps({
            "executors": _executors(sc), "default_parallelism": sc.defaultParallelism,
            "rows_per_worker": summary["rows_per_worker"],
            "killed": os.path.exists(marker), "rerun_attempts": rerun["stage_attempts"],
            "rerun_samples": rerun["samples"],
            "rerun_same_parameters": state_digest(again.state_dict()) == state_digest(
                model.state_dict()),
            "samples": summary["samples"],
            "accuracy": evaluation.accuracy,
            "local_accuracy": float((digit.argmax(1).numpy() == labels).mean()),
            "predicted_rows": len(rows), "max_prediction_gap": gap,
            "seconds": {k: round(t - marks["session"], 1) for k, t in marks.items()}}),
            flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
