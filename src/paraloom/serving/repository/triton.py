"""Triton's model repository layout for TorchScript models: ``config.pbtxt`` and ``N/model.pt``.

A Triton user's PyTorch model folder serves as it is::

    DIR/resnet/config.pbtxt      platform: "pytorch_libtorch" (or backend: "pytorch")
    DIR/resnet/1/model.pt        a TorchScript archive (torch.jit.save)

``read_pbtxt`` reads the parts of Triton's ``ModelConfig`` that have a meaning here: ``name``,
``platform``/``backend``, ``max_batch_size`` (the pool's ``batch_limit``; 0: requests run one by
one, not merged, as Triton does for a model without a batch dimension), ``input``/``output``
(``name``, ``data_type``, ``dims``, the batch dimension added when ``max_batch_size`` > 0),
``reshape`` (the shape the model takes or returns, where it differs from ``dims``), an
output's ``label_filename`` (the labels of the classification extension),
``version_policy``, ``instance_group`` (the counts: ``workers``), ``dynamic_batching``'s
``max_queue_delay_microseconds`` (``max_wait_ms``) and ``default_model_filename``. Everything
else in the file (instance kinds, optimization, parameters, ...) is read past.

A TorchScript archive is a program, so it is loaded only when the server allows it
(``paraloom serve --allow-torchscript``). ``torch.jit.load`` never runs Python's unpickler: its
reader resolves only TorchScript's own types. A ``model.pt`` that is not TorchScript (a
``torch.save`` pickle) is refused without being opened.
"""

from __future__ import annotations

import functools
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, cast

from paraloom.serving.signature import TensorSpec

__all__ = ["PBTXT", "TORCHSCRIPT", "is_torchscript", "read_pbtxt", "torchscript_file"]

PBTXT = "config.pbtxt"
TORCHSCRIPT = "model.pt"
_PYTORCH = {"", "pytorch_libtorch", "pytorch"}  # platform / backend values of PyTorch models
# Triton's DataType enum, in its order (TYPE_STRING is BYTES on the wire).
_TYPES = ("INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
          "INT64", "FP16", "FP32", "FP64", "STRING", "BF16")


@functools.cache
def _config_class() -> Any:
    """The message class of the ModelConfig fields read here, built once (text format parses
    by field name, so the numbers are this file's own)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    one, many = field.LABEL_OPTIONAL, field.LABEL_REPEATED
    text, int32, int64 = field.TYPE_STRING, field.TYPE_INT32, field.TYPE_INT64
    nested = field.TYPE_MESSAGE
    proto = descriptor_pb2.FileDescriptorProto(name="paraloom/triton_model_config.proto",
                                               package="paraloom.triton", syntax="proto3")
    kinds = proto.enum_type.add(name="DataType")
    for number, name in enumerate(_TYPES):
        kinds.value.add(name=f"TYPE_{name}", number=number)
    messages: dict[str, list[tuple[str, int, int, str]]] = {
        "Tensor": [("name", text, one, ""), ("data_type", field.TYPE_ENUM, one, "DataType"),
                   ("dims", int64, many, ""), ("reshape", nested, one, "Reshape"),
                   ("label_filename", text, one, "")],
        "Reshape": [("shape", int64, many, "")],
        "Latest": [("num_versions", int32, one, "")],
        "All": [],
        "Specific": [("versions", int64, many, "")],
        "VersionPolicy": [("latest", nested, one, "Latest"), ("all", nested, one, "All"),
                          ("specific", nested, one, "Specific")],
        "InstanceGroup": [("count", int32, one, "")],
        "DynamicBatching": [("max_queue_delay_microseconds", int64, one, "")],
        "ModelConfig": [("name", text, one, ""), ("platform", text, one, ""),
                        ("backend", text, one, ""), ("max_batch_size", int32, one, ""),
                        ("input", nested, many, "Tensor"), ("output", nested, many, "Tensor"),
                        ("version_policy", nested, one, "VersionPolicy"),
                        ("instance_group", nested, many, "InstanceGroup"),
                        ("dynamic_batching", nested, one, "DynamicBatching"),
                        ("default_model_filename", text, one, "")],
    }
    for name, fields in messages.items():
        message = proto.message_type.add(name=name)
        for number, (fname, kind, label, type_name) in enumerate(fields, 1):
            added = message.field.add(name=fname, number=number, type=kind, label=label)
            if type_name:
                added.type_name = f".paraloom.triton.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("paraloom.triton.ModelConfig"))


def _specs(tensors: Any, batched: bool, key: str, where: str) -> tuple[TensorSpec, ...] | None:
    """The declared tensors' specs as the wire sees them (``dims``, rows first if batched)."""
    if not tensors:
        return None
    specs = []
    for t in tensors:
        kind = _TYPES[t.data_type]
        if kind == "INVALID" or not t.name:
            raise ValueError(f"{where}: every {key} needs a name and a data_type; got "
                             f"{t.name or '(no name)'} with {kind}")
        dims = ([-1] if batched else []) + list(t.dims)
        specs.append(TensorSpec(t.name, "BYTES" if kind == "STRING" else kind, tuple(dims)))
    return tuple(specs)


def _policy(raw: Any) -> dict[str, Any] | None:
    """The version policy as config.json writes it (``read_config``'s own check applies)."""
    if raw.HasField("latest"):
        return {"latest": {"num_versions": raw.latest.num_versions or 1}}
    if raw.HasField("all"):
        return {"all": {}}
    if raw.HasField("specific"):
        return {"specific": {"versions": list(raw.specific.versions)}}
    return None


# A quoted string or a comment (left as they are), or a field name opening a list.
_LIST_FIELD = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|#[^\n]*'
                         r"|\b([A-Za-z_]\w*)\s*\[")


def _lists_with_colons(text: str) -> str:
    """``text`` with a colon between a field name and its ``[``: protobuf's text format allows
    ``field [ {...} ]`` for messages, but its parser cannot skip such a list in a field this
    module does not read (``model_warmup [...]``, ``parameters [...]``)."""
    return _LIST_FIELD.sub(lambda m: f"{m.group(1)}: [" if m.group(1) else m.group(0), text)


def _instances(message: Any, where: str) -> int:
    """How many instances the config's ``instance_group`` asks for (0: no group); a group
    without ``count`` is one, as in Triton."""
    if any(group.count < 0 for group in message.instance_group):
        raise ValueError(f"{where}: an instance_group count is negative")
    return sum(max(1, group.count) for group in message.instance_group)


def read_pbtxt(path: Path, default_name: str) -> dict[str, Any]:
    """``path``'s Triton config as the JSON object a ``config.json`` would hold, plus
    ``"model_filename"``; ``ValueError`` naming the problem (a model that is not PyTorch's, a
    file that does not parse)."""
    from google.protobuf import text_format

    message = _config_class()()
    try:
        text_format.Parse(_lists_with_colons(path.read_text()), message,
                          allow_unknown_field=True)
    except (OSError, UnicodeDecodeError, RecursionError, text_format.ParseError) as e:
        raise ValueError(f"{path.name} is not a readable Triton model config: {e}") from e
    platform = message.platform or message.backend
    if platform not in _PYTORCH:
        raise ValueError(f"{path.name}: platform/backend {platform!r} is not served here; "
                         "paraloom serves PyTorch models (pytorch_libtorch: a TorchScript "
                         "model.pt, or a .safetensors from paraloom.save)")
    if message.max_batch_size < 0:
        raise ValueError(f"{path.name}: max_batch_size {message.max_batch_size} is negative")
    filename = message.default_model_filename or TORCHSCRIPT
    if Path(filename).name != filename or filename in (".", ".."):
        raise ValueError(f"{path.name}: default_model_filename {filename!r} must be a file "
                         "name in the version folder, without a path")
    batched = message.max_batch_size > 0
    raw: dict[str, Any] = {"name": message.name or default_name, "model_filename": filename}
    options: dict[str, Any] = ({"batch_limit": message.max_batch_size,
                                "max_batch_size": message.max_batch_size} if batched
                               else {"mode": "inplace"})  # no batch dimension: never merged
    workers = _instances(message, path.name)
    if workers:
        options["workers"] = workers
    if message.HasField("dynamic_batching"):
        options["max_wait_ms"] = message.dynamic_batching.max_queue_delay_microseconds / 1000
    raw.update(options)
    for key in ("input", "output"):
        specs = _specs(getattr(message, key), batched, key, path.name)
        if specs is not None:
            raw[key + "s"] = [s.as_json() for s in specs]
    reshape = {t.name: list(t.reshape.shape) for t in (*message.input, *message.output)
               if t.HasField("reshape")}
    if reshape:
        raw["reshape"] = reshape
    labels = {t.name: t.label_filename for t in message.output if t.label_filename}
    if labels:
        raw["labels"] = labels
    if message.HasField("version_policy"):
        raw["version_policy"] = _policy(message.version_policy)
    return raw


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip holding ``code/`` and
    ``constants.pkl``), judged from the zip's table of contents alone: nothing is unpickled."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    parts = [n.split("/", 1)[1] for n in names if "/" in n]
    return "constants.pkl" in parts and any(p.startswith("code/") for p in parts)


def torchscript_file(path: Path) -> Any:
    """The TorchScript module in ``path``, on the CPU, in eval mode."""
    import torch

    load = cast(Any, torch.jit.load)  # untyped in torch's stubs
    with warnings.catch_warnings():  # "deprecated, use torch.export": not the operator's to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        return load(str(path), map_location="cpu").eval()

