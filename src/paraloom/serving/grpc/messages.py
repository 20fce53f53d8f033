"""The v2 gRPC messages, built from the committed ``inference.desc`` in a private pool.

``inference.desc`` is ``inference.proto`` compiled by protoc (``scripts/generate_grpc.sh``). The
classes live in their own ``DescriptorPool``: tritonclient and KServe register generated classes
of the same ``inference`` package in protobuf's default pool, and a second registration there
would fail in any process that imports both. No gencode is imported, so any protobuf runtime
from 4.x on works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["SERVICE", "message", "method_types"]

SERVICE = "inference.GRPCInferenceService"

_files = descriptor_pb2.FileDescriptorSet.FromString(
    (Path(__file__).with_name("inference.desc")).read_bytes())
_pool = descriptor_pool.DescriptorPool()
for _file in _files.file:
    _pool.Add(_file)
_service = _pool.FindServiceByName(SERVICE)


def message(name: str) -> Any:
    """The message class ``inference.<name>``, e.g. ``message("ModelInferRequest")``."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


def method_types(method: str) -> tuple[Any, Any]:
    """The request and response classes of one of the service's methods."""
    found = _service.methods_by_name[method]
    return (message_factory.GetMessageClass(found.input_type),
            message_factory.GetMessageClass(found.output_type))
