"""Train with DL4J's shared training master on Spark (local[2] here; any cluster works) and
evaluate over an RDD. Needs the spark extra (PySpark 4, Java 17+).

    python examples/spark_local.py
"""

import torch
from _common import epochs
from pyspark.sql import SparkSession
from torch import nn

from paraloom.datasets import digits
from paraloom.models import LeNet
from paraloom.spark import SharedTrainingMaster, SparkModel

if __name__ == "__main__":
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    try:
        def rows(split: str) -> list:
            return [(x.numpy(), int(y)) for x, y in zip(*digits(split).tensors, strict=True)]

        train = spark.sparkContext.parallelize(rows("train"), 2)
        test = spark.sparkContext.parallelize(rows("test"), 2)
        torch.manual_seed(0)
        model = LeNet(image_size=8)
        master = SharedTrainingMaster(batch_size_per_worker=32, workers=2)
        net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        summary = net.fit(train, epochs=epochs(8))
        print(f"replicas identical {summary['replicas_identical']}, "
              f"bytes ratio to dense {summary['bytes_ratio_to_dense']:.4f}")
        print(f"test accuracy {net.evaluate(test).accuracy:.4f}")
    finally:
        spark.stop()
