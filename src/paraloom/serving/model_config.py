"""A served model's configuration in Triton's form: ``GET /v2/models/NAME/config`` and gRPC
``ModelConfig``, what tritonclient's ``get_model_config`` returns.

Clients written for Triton read it beside the metadata (Triton's image client takes
``max_batch_size`` and the input's ``dims`` from it), so it holds what paraloom knows in
Triton's fields: ``name``, ``platform`` and ``backend``, ``version_policy`` (the
repository config's, else the latest version), ``max_batch_size`` (the config's, or
for a model with a batch dimension and no limit, the pool's ``batch_limit``; 0 for a model
without one, or whose declared shapes do not begin with the rows), ``input``/``output``
(``data_type`` ``TYPE_...``, ``dims`` without the batch dimension; a tensor of one value per
row is ``dims: [1]`` with ``reshape: {shape: []}``, as Triton writes it; a repository
config's ``reshape`` and ``label_filename`` as written), ``instance_group`` and
``dynamic_batching`` from the pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paraloom.inference.config import InferenceMode
from paraloom.serving.signature import TensorSpec
from paraloom.serving.strings import BYTES

if TYPE_CHECKING:
    from paraloom.serving.served import ServedModel

__all__ = ["model_config"]


def _tensor(spec: TensorSpec, batch_dim: bool, written: Mapping[str, Any]) -> dict[str, Any]:
    kind = "STRING" if spec.datatype == BYTES else spec.datatype
    dims = list(spec.shape[1:] if batch_dim else spec.shape)
    out: dict[str, Any] = {"name": spec.name, "data_type": f"TYPE_{kind}", "dims": dims or [1]}
    if not dims:  # one value per row: Triton's form is dims [1], reshaped to none
        out["reshape"] = {"shape": []}
    return {**out, **written}  # the repository config's reshape and label_filename


def model_config(served: ServedModel) -> dict[str, Any]:
    """``served``'s configuration as Triton's ``ModelConfig`` in JSON."""
    pool = served.pool
    specs = (*served.signature.inputs, *served.signature.outputs)
    # Declared shapes that do not begin with the rows (-1) have no batch dimension.
    batch_dim = served.batch_dim and all(s.shape and s.shape[0] == -1 for s in specs)
    max_batch = (served.signature.max_rows or pool.batch_limit) if batch_dim else 0
    written = served.tensor_config
    outputs = [_tensor(s, batch_dim, written.get(s.name, {})) for s in served.signature.outputs]
    gpu = any(d.type == "cuda" for d in pool.devices)
    config: dict[str, Any] = {
        "name": served.name, "platform": served.platform, "backend": "pytorch",
        "version_policy": served.version_policy, "max_batch_size": max_batch,
        "input": [_tensor(s, batch_dim, written.get(s.name, {}))
                  for s in served.signature.inputs], "output": outputs,
        "instance_group": [{"count": pool.workers, "kind": "KIND_GPU" if gpu else "KIND_CPU"}]}
    if pool.inference_mode is InferenceMode.BATCHED:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": round(pool.max_wait_ms * 1000)}
    return config
