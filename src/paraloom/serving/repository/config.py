"""A model's config in a models directory: ``config.json`` (or Triton's ``config.pbtxt``, read
by ``paraloom.serving.repository.triton``), its version policy, pool options and signature.

The JSON keys: ``name``, ``version_policy`` (Triton's: ``{"latest": {"num_versions": N}}``,
default 1; ``{"all": {}}``; ``{"specific": {"versions": [1, 3]}}``), ``mode``, ``workers``,
``batch_limit``, ``queue_limit``, ``max_wait_ms``, ``threads_per_worker``, ``max_batch_size``,
``inputs`` and ``outputs`` (``[{"name", "datatype", "shape"}]``), ``reshape`` and ``labels``.
Every reader raises ``ValueError`` naming the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from paraloom.serving.repository.triton import PBTXT, TORCHSCRIPT, read_pbtxt
from paraloom.serving.served import PoolOptions
from paraloom.serving.signature import TensorSpec, spec_from_json

__all__ = ["CONFIG_MAX_BYTES", "ModelConfig", "VersionPolicy", "config_path_of", "read_config"]

CONFIG_MAX_BYTES = 1 << 20
"""The largest model config read (1 MiB): Triton's configs are a few kilobytes; a larger file
is refused before it is parsed on the server's loop."""

_POOL_KEYS = {"mode": "inference_mode", "workers": "workers", "batch_limit": "batch_limit",
              "queue_limit": "queue_limit", "max_wait_ms": "max_wait_ms",
              "threads_per_worker": "threads_per_worker"}
_KEYS = {"name", "version_policy", "inputs", "outputs", "max_batch_size", "reshape", "labels",
         *_POOL_KEYS}


@dataclass(frozen=True)
class VersionPolicy:
    """Which numbered versions to serve, as Triton's ``version_policy``: the latest ``count``,
    all, or the ``specific`` ones."""

    kind: Literal["latest", "all", "specific"] = "latest"
    count: int = 1
    specific: tuple[int, ...] = ()

    def as_triton(self) -> dict[str, Any]:
        """Triton's ``version_policy`` in JSON: ``{"latest": {"num_versions": n}}``,
        ``{"all": {}}`` or ``{"specific": {"versions": [...]}}``."""
        if self.kind == "all":
            return {"all": {}}
        if self.kind == "specific":
            return {"specific": {"versions": list(self.specific)}}
        return {"latest": {"num_versions": self.count}}

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of ``available`` (sorted ascending); may name missing ones."""
        if self.kind == "all":
            return list(available)
        if self.kind == "specific":
            return sorted(self.specific)
        return available[-self.count:]


@dataclass(frozen=True)
class ModelConfig:
    """A model's optional config: its served name, version policy, pool options and signature."""

    name: str
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    pool_options: PoolOptions = field(default_factory=PoolOptions)
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    model_filename: str = TORCHSCRIPT
    """A TorchScript model's file in each version folder (Triton's default_model_filename)."""
    max_batch_size: int = 0
    """The most rows one request may hold (Triton's ``max_batch_size``; 0: any number)."""
    reshape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The shape the model takes or returns for a declared tensor, by name, where it differs
    from the declared one (Triton's ``reshape``; rows left out when batched)."""
    batched: bool = True
    """Whether the declared shapes begin with the rows (False: Triton's ``max_batch_size: 0``)."""
    labels: dict[str, Path] = field(default_factory=dict)
    """An output's labels file (one label per line, beside the config), by output name."""


def _specs(raw: object, key: str, where: str) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of "
                         '{"name": ..., "datatype": "FP32", "shape": [-1, ...]}')
    specs = []
    for item in raw:
        spec = spec_from_json(item)
        if spec is None:
            raise ValueError(f"{where}: each of {key!r} needs exactly name, datatype and "
                             f"shape; got {item!r}")
        specs.append(spec)
    return tuple(specs)


def _version_policy(raw: object, where: str) -> VersionPolicy:
    usage = ('use {"latest": {"num_versions": N}}, {"all": {}} or {"specific": {"versions": '
             '[N, ...]}} (version numbers >= 1)')
    if raw is None:
        return VersionPolicy()
    if not isinstance(raw, dict) or len(raw) != 1 or not isinstance(next(iter(raw.values())),
                                                                      dict):
        raise ValueError(f"{where}: version_policy {raw!r} is not a policy; {usage}")
    (kind, body), = raw.items()
    if kind == "all" and not body:
        return VersionPolicy("all")
    if kind == "latest" and set(body) <= {"num_versions"}:
        count = body.get("num_versions", 1)
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return VersionPolicy("latest", count=count)
    if kind == "specific" and set(body) == {"versions"}:
        versions = body["versions"]
        if (isinstance(versions, list) and versions and len(set(versions)) == len(versions)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                        for v in versions)):
            return VersionPolicy("specific", specific=tuple(versions))
    raise ValueError(f"{where}: version_policy {raw!r} is not supported; {usage}")


def _json(path: Path) -> dict[str, object]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"{path.name} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return raw


def read_config(path: Path, default_name: str) -> ModelConfig:
    """The config in ``path``: JSON, or Triton's ``config.pbtxt`` (see
    ``paraloom.serving.repository.triton``); ``ValueError`` naming the problem."""
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ValueError(f"{path.name} is {size:,} bytes, past the {CONFIG_MAX_BYTES:,} a model "
                         "config may have: refused (a config names inputs, outputs and "
                         "options; labels go in their own files)")
    triton = path.name == PBTXT
    raw = dict(read_pbtxt(path, default_name)) if triton else _json(path)
    model_filename = str(raw.pop("model_filename")) if triton else TORCHSCRIPT
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"{path.name} has unknown keys {unknown}; known: {sorted(_KEYS)}")
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{path.name}: name {name!r} must be a non-empty string without '/'")
    # The values are JSON as written; ParallelInference checks them when the pool is built.
    options = cast(PoolOptions, {_POOL_KEYS[k]: v for k, v in raw.items() if k in _POOL_KEYS})
    return ModelConfig(
        name=name, version_policy=_version_policy(raw.get("version_policy"), path.name),
        pool_options=options,
        inputs=None if "inputs" not in raw else _specs(raw["inputs"], "inputs", path.name),
        outputs=None if "outputs" not in raw else _specs(raw["outputs"], "outputs", path.name),
        model_filename=model_filename, max_batch_size=_max_batch_size(raw, path.name),
        reshape=_reshape(raw.get("reshape"), path.name), labels=_labels(raw.get("labels"), path),
        batched=not triton or "max_batch_size" in raw)  # Triton's 0 leaves it out


def _labels(raw: object, path: Path) -> dict[str, Path]:
    """Output name -> its labels file beside ``path`` (the config); ``ValueError`` for a file
    that is not there (as Triton, which fails such a model's load)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) and v and Path(v).name == v
                                            for v in raw.values()):
        raise ValueError(f"{path.name}: labels {raw!r} must map output names to file names "
                         "in the model's folder, e.g. {\"logits\": \"labels.txt\"}")
    missing = sorted(v for v in raw.values() if not (path.parent / v).is_file())
    if missing:
        raise ValueError(f"{path.name}: labels names {missing}, not in the model's folder "
                         f"{path.parent.name}/; add the file (one label per line) or remove "
                         "the entry")
    return {str(k): path.parent / v for k, v in raw.items()}


def _reshape(raw: object, where: str) -> dict[str, tuple[int, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
            isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                        and d >= -1 for d in v) for v in raw.values()):
        raise ValueError(f"{where}: reshape {raw!r} must map tensor names to shapes (lists "
                         "of integers >= 0, or -1), e.g. {\"x\": [2, 2]}")
    return {str(k): tuple(v) for k, v in raw.items()}


def _max_batch_size(raw: dict[str, object], where: str) -> int:
    value = raw.get("max_batch_size", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: max_batch_size {value!r} must be an integer >= 0 (0: any "
                         "number of rows per request)")
    return value


def config_path_of(folder: Path) -> Path:
    """A model folder's config: ``config.json``, else Triton's ``config.pbtxt`` (the JSON path,
    absent, when neither is there); ``ValueError`` if both are."""
    json_path, pbtxt = folder / "config.json", folder / PBTXT
    if json_path.is_file() and pbtxt.is_file():
        raise ValueError(f"{folder.name}/ holds both config.json and {PBTXT}; keep one")
    return pbtxt if pbtxt.is_file() else json_path
