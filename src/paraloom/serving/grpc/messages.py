"""The v2 gRPC messages, built from the committed ``inference.desc`` in a private pool.

``inference.desc`` is ``inference.proto`` compiled by protoc (``scripts/generate_grpc.sh``). The
classes live in their own ``DescriptorPool``: tritonclient and KServe register generated classes
of the same ``inference`` package in protobuf's default pool, and a second registration there
would fail in any process that imports both. No gencode is imported, so any protobuf runtime
from 4.x on works.

The classes are made at run time, so no type checker sees their fields; the Protocols below
spell out the fields of the requests the handlers read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

__all__ = ["SERVICE", "InferRequestMessage", "InputTensor", "LoadRequest", "Message",
           "ModelRef", "NamedModel", "OutputRequest", "Parameter", "ReadyFilter", "RegionRequest",
           "SettingsRequest",
           "message",
           "method_types"]

SERVICE = "inference.GRPCInferenceService"

_files = descriptor_pb2.FileDescriptorSet.FromString(
    (Path(__file__).with_name("inference.desc")).read_bytes())
_pool = descriptor_pool.DescriptorPool()
for _file in _files.file:
    _pool.Add(_file)
_service = _pool.FindServiceByName(SERVICE)


def message(name: str) -> type[Message]:
    """The message class ``inference.<name>``, e.g. ``message("ModelInferRequest")``."""
    cls: type[Message] = message_factory.GetMessageClass(
        _pool.FindMessageTypeByName(f"inference.{name}"))
    return cls


def method_types(method: str) -> tuple[type[Message], type[Message]]:
    """The request and response classes of one of the service's methods."""
    found = _service.methods_by_name[method]
    request: type[Message] = message_factory.GetMessageClass(found.input_type)
    response: type[Message] = message_factory.GetMessageClass(found.output_type)
    return request, response


class Parameter(Protocol):
    """``InferParameter`` or ``ModelRepositoryParameter``: one value, in the field the
    ``parameter_choice`` oneof names."""

    def WhichOneof(self, oneof_group: str) -> str | None: ...  # noqa: N802 (protobuf's name)


class ModelRef(Protocol):
    """``ModelReadyRequest``, ``ModelMetadataRequest``: a model and a version ("": any)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...


class NamedModel(Protocol):
    """``RepositoryModelUnloadRequest``: the model to act on."""

    @property
    def model_name(self) -> str: ...


class RegionRequest(Protocol):
    """The shared memory requests: a region's name ("": every region) and, to register,
    where it lies (the CUDA ones carry a name only here)."""

    @property
    def name(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def byte_size(self) -> int: ...


class LoadRequest(NamedModel, Protocol):
    """``RepositoryModelLoadRequest``: the model and the load's parameters."""

    @property
    def parameters(self) -> Mapping[str, Parameter]: ...


class ReadyFilter(Protocol):
    """``RepositoryIndexRequest``: whether to list the ready models only."""

    @property
    def ready(self) -> bool: ...


class SettingsRequest(Protocol):
    """``LogSettingsRequest``: the settings to change, each a ``SettingValue`` (a oneof
    named ``parameter_choice``, as a ``Parameter``)."""

    @property
    def settings(self) -> Mapping[str, Parameter]: ...


class InputTensor(Protocol):
    """``ModelInferRequest.InferInputTensor``: values in ``contents`` (a typed field per
    datatype) or in the request's ``raw_input_contents``."""

    @property
    def name(self) -> str: ...
    @property
    def datatype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def parameters(self) -> Mapping[str, Parameter]: ...
    @property
    def contents(self) -> Message: ...
    def HasField(self, field_name: str) -> bool: ...  # noqa: N802 (protobuf's name)


class OutputRequest(Protocol):
    """``ModelInferRequest.InferRequestedOutputTensor``."""

    @property
    def name(self) -> str: ...
    @property
    def parameters(self) -> Mapping[str, Parameter]: ...


class InferRequestMessage(Protocol):
    """``ModelInferRequest``."""

    @property
    def model_name(self) -> str: ...
    @property
    def model_version(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def parameters(self) -> Mapping[str, Parameter]: ...
    @property
    def inputs(self) -> Sequence[InputTensor]: ...
    @property
    def outputs(self) -> Sequence[OutputRequest]: ...
    @property
    def raw_input_contents(self) -> Sequence[bytes]: ...
