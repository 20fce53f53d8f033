"""A served model's inputs and outputs (names, datatypes, shapes): inferred, declared, enforced."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from paraloom.serving.datatypes import DATATYPES, Value, datatype_of, value_datatype
from paraloom.serving.errors import ProtocolError
from paraloom.serving.protocol import RequestInput
from paraloom.serving.strings import BYTES, is_strings

__all__ = ["ModelSignature", "TensorMetadata", "TensorSpec", "infer_signature", "probe_input",
           "spec_from_json"]


class TensorMetadata(TypedDict):
    """One tensor in the v2 model metadata: ``{"name", "datatype", "shape"}``."""

    name: str
    datatype: str
    shape: list[int]


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of the model's signature; -1 in ``shape`` means any size. BYTES
    (strings) is for the inputs and outputs of a handler (``paraloom.serving.handlers``)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES and self.datatype != BYTES:
            raise ValueError(f"TensorSpec {self.name!r} has datatype {self.datatype!r}; "
                             f"expected one of {', '.join(DATATYPES)} or {BYTES}")
        if not all(isinstance(d, int) and d >= -1 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r} has shape {self.shape!r}; expected "
                             "integers >= 0, or -1 for a dimension of any size")
        object.__setattr__(self, "shape", tuple(self.shape))

    def as_json(self) -> TensorMetadata:
        """The v2 metadata form: ``{"name", "datatype", "shape"}``."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def misfit(self, datatype: str, shape: Sequence[int], sizes: bool = True) -> str | None:
        """How a tensor of ``datatype`` and ``shape`` breaks this spec (None if it fits):
        another datatype, another number of dimensions, or (with ``sizes``) another size
        where the spec fixes one."""
        fits = datatype == self.datatype and len(shape) == len(self.shape) and (
            not sizes or all(want in (-1, got) for want, got in zip(self.shape, shape,
                                                                     strict=True)))
        if fits:
            return None
        return (f"{datatype} {list(shape)} for {self.name!r}, declared {self.datatype} "
                f"{list(self.shape)}")


def spec_from_json(item: object) -> TensorSpec | None:
    """``item`` as a ``TensorSpec``: one already, or ``{"name", "datatype", "shape"}`` (exactly
    those keys); None for anything else. ``ValueError`` from ``TensorSpec`` for bad values."""
    if isinstance(item, TensorSpec):
        return item
    if not isinstance(item, dict) or set(item) != {"name", "datatype", "shape"}:
        return None
    return TensorSpec(str(item["name"]), str(item["datatype"]), tuple(item["shape"]))


@dataclass(frozen=True)
class ModelSignature:
    """The inputs a model takes (in call order) and the outputs it returns."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    outputs_probed: bool = False
    """Whether ``outputs`` were read off one run of the model (on a probe input), not declared:
    their sizes then need not hold for every input, so ``output_misfit`` checks only their
    datatypes and numbers of dimensions."""
    max_rows: int = 0
    """The most rows (first dimension) one request may hold, as Triton's ``max_batch_size``
    (0: any number)."""
    rowless: tuple[str, ...] = ()
    """Probed outputs whose first dimension was not the probe's number of rows (a model
    without a batch dimension): a server that batches refuses the model (``ServedModel``)."""

    def __post_init__(self) -> None:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            twice = sorted(n for n, k in Counter(s.name for s in specs).items() if k > 1)
            if twice:
                raise ValueError(f"the model's {kind} name {twice} more than once; give each "
                                 f"of its {kind} a name of its own")

    def check(self, request_inputs: list[RequestInput], batched: bool = False) -> list[Value]:
        """The request's tensors in the model's input order; ``ProtocolError`` if they don't fit
        (``batched``: the first dimension of every input is the batch, so each gives as many
        rows)."""
        given = {t.name: t for t in request_inputs}
        expected = [s.name for s in self.inputs]
        unknown = sorted(set(given) - set(expected))
        missing = [n for n in expected if n not in given]
        if unknown or missing:
            raise ProtocolError(f"request inputs {sorted(given)} do not match the model's "
                                f"inputs {expected} (unknown: {unknown}, missing: {missing})")
        values = [_check_one(spec, given[spec.name]) for spec in self.inputs]
        if batched:
            _check_rows_agree([(spec.name, given[spec.name].shape) for spec in self.inputs])
        rows = given[expected[0]].shape[0] if expected and given[expected[0]].shape else 0
        if self.max_rows and rows > self.max_rows:
            raise ProtocolError(f"the request has {rows} rows, over the model's max_batch_size "
                                f"{self.max_rows}; send at most {self.max_rows} per request")
        return values

    def name_outputs(self, result: Any) -> list[tuple[str, torch.Tensor]]:
        """Pair what the model returned (``result``: the user's model's own output, a tensor, a
        mapping or a sequence of tensors) with the declared output names: a mapping by name,
        a sequence in order (elements past the declared outputs are left out)."""
        if isinstance(result, torch.Tensor):
            tensors = [result]
        elif isinstance(result, Mapping):
            return [(s.name, result[s.name]) for s in self.outputs]
        else:
            tensors = list(result)
        if len(tensors) < len(self.outputs) or (self.outputs_probed
                                                 and len(tensors) != len(self.outputs)):
            raise RuntimeError(f"the model returned {len(tensors)} outputs but its signature "
                               f"declares {len(self.outputs)}: {[s.name for s in self.outputs]}")
        # Declared outputs are the first ones returned, as Triton's PyTorch backend takes them.
        return [(s.name, t) for s, t in zip(self.outputs, tensors, strict=False)]

    def output_misfit(self, outputs: Mapping[str, Value]) -> str | None:
        """How the first output in ``outputs`` that breaks its spec does (None if all fit), as
        ``TensorSpec.misfit`` says."""
        specs = {s.name: s for s in self.outputs}
        for name, value in outputs.items():
            spec = specs.get(name)
            if spec is None:
                continue
            if isinstance(value, torch.Tensor) or is_strings(value):
                wrong = spec.misfit(value_datatype(value), value.shape,
                                    sizes=not self.outputs_probed)
            else:
                wrong = (f"a {type(value).__name__} for {name!r}, declared {spec.datatype} "
                         f"{list(spec.shape)}")
            if wrong is not None:
                return wrong
        return None


def _check_rows_agree(shapes: list[tuple[str, Sequence[int]]]) -> None:
    """``ProtocolError`` naming each input's rows when the inputs (of a model with a batch
    dimension) give different numbers of rows."""
    rows = [(name, shape[0]) for name, shape in shapes if len(shape) > 0]
    if len({r for _, r in rows}) > 1:
        detail = ", ".join(f"{name!r}: {r}" for name, r in rows)
        raise ProtocolError(f"the inputs disagree on the number of rows ({detail}); each "
                            "input's first dimension is the batch: send as many rows in each")


def _check_one(spec: TensorSpec, given: RequestInput) -> Value:
    if given.datatype != spec.datatype:
        hint = (" (a model takes strings only through a handler.py that turns them into "
                "tensors)" if BYTES in (given.datatype, spec.datatype) else "")
        raise ProtocolError(f"input {spec.name!r} has datatype {given.datatype} but the model "
                            f"expects {spec.datatype}; send {spec.datatype} data{hint}")
    shape = given.shape
    if spec.shape == (-1,) and len(shape) == 2 and shape[1] == 1 and shape[0] > 0:
        # One value per row: the config says dims [1] with reshape [] (Triton's form), so a
        # client that builds [rows] + dims sends [N, 1]; Triton reshapes it, and so does this.
        return given.tensor.reshape(shape[0])
    fits = len(shape) == len(spec.shape) and all(
        want in (-1, got) for want, got in zip(spec.shape, shape, strict=True))
    if not fits:
        raise ProtocolError(f"input {spec.name!r} has shape {list(shape)} but the model expects "
                            f"{list(spec.shape)} (-1: any size)")
    if shape and shape[0] == 0:
        raise ProtocolError(f"input {spec.name!r} has shape {list(shape)} with no rows; send "
                            "at least one")
    return given.tensor


def _input_shape_from_model(model: nn.Module) -> tuple[int, ...] | None:
    config = getattr(model, "config", None) or {}
    if "image_size" in config and "in_channels" in config:  # paraloom's LeNet
        size = int(config["image_size"])
        return (-1, int(config["in_channels"]), size, size)
    if "in_features" in config:  # paraloom's MLP
        return (-1, int(config["in_features"]))
    layer = _first_layer(model)
    if layer is None or is_lazy(layer.weight):
        return None
    # From the weight's shape: a lazy layer's in_features stays 0 after its weight is loaded.
    if isinstance(layer, nn.Linear):
        return (-1, layer.weight.shape[1])
    if isinstance(layer, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        channels = layer.weight.shape[1] * layer.groups
        return (-1, channels, *([-1] * (layer.weight.dim() - 2)))
    return None


def _first_layer(model: nn.Module) -> nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d | None:
    """The model's first Linear or Conv layer, whose input is the model's."""
    return next((m for m in model.modules()
                 if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)), None)


def _input_datatype(model: nn.Module) -> str:
    """The inferred input's datatype: the first layer's float dtype (FP64 for a float64
    model), FP32 where that is not a float type v2 names."""
    layer = _first_layer(model)
    dtype = layer.weight.dtype if layer is not None else torch.float32
    try:
        return datatype_of(dtype) if dtype.is_floating_point else "FP32"
    except TypeError:  # a float type v2 has no name for (float8)
        return "FP32"


def _default_names(prefix: str, count: int) -> list[str]:
    return [prefix] if count == 1 else [f"{prefix}_{i}" for i in range(count)]


def _output_specs(model: nn.Module, sample: Sequence[torch.Tensor]
                  ) -> tuple[tuple[TensorSpec, ...], tuple[str, ...]]:
    """The outputs the model returns on ``sample``, and those without a row per sample row."""
    training = model.training
    model.eval()  # BatchNorm and dropout must not change state or results while we probe
    try:
        with torch.no_grad():
            result = model(*sample)
    except Exception as e:
        probe = ", ".join(f"{datatype_of(t.dtype)} {list(t.shape)}" for t in sample)
        raise ValueError(f"cannot read the outputs of {type(model).__name__}: it failed on the "
                         f"probe input ({probe}): {type(e).__name__}: {e}; describe its inputs "
                         "(sample=, inputs=; paraloom serve: --input-shape=-1,... "
                         "--input-datatype ...; a models directory: \"inputs\" in the config) "
                         "or its outputs (outputs=)") from e
    finally:
        model.train(training)
    items = _named_results(model, result)
    rows = sample[0].shape[0] if sample and sample[0].dim() else None
    return (tuple(TensorSpec(n, datatype_of(t.dtype), (-1, *t.shape[1:])) for n, t in items),
            tuple(n for n, t in items if rows is not None and t.shape[0] != rows))


def _named_results(model: nn.Module, result: object) -> list[tuple[str, torch.Tensor]]:
    """What the probe run returned, named as the server will name it; ``ValueError`` for a
    result it cannot serve (an entry that is not a tensor, a key that is not a string, a
    tensor without rows)."""
    items: list[tuple[object, object]]
    if isinstance(result, torch.Tensor):
        items = [("output", result)]
    elif isinstance(result, Mapping):
        items = list(result.items())
    elif isinstance(result, tuple | list):
        items = list(zip(_default_names("output", len(result)), result, strict=True))
    else:
        items = [("output", result)]
    fix = ("; return tensors only (a tuple, a list or a dict with string keys), or wrap the "
           "model in a module that does")
    for key, value in items:
        if not isinstance(key, str):
            raise ValueError(f"{type(model).__name__} returns a dict with key {key!r}: outputs "
                             f"are named by string keys{fix}")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{type(model).__name__} returns a {type(value).__name__} as "
                             f"{key!r}, which cannot be served{fix}")
        if value.dim() == 0:
            raise ValueError(f"{type(model).__name__} returns a 0-d tensor as {key!r}; a served "
                             "model answers with a row per input row (x.sum(dim=1), not "
                             "x.sum())")
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def _sample_from_specs(specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
    """Zeros to probe the model with (None where a size is unknown, or an input is BYTES)."""
    if any(d == -1 for s in specs for d in s.shape[1:]) or \
            any(s.datatype not in DATATYPES for s in specs):
        return None
    return [torch.zeros((1, *s.shape[1:]), dtype=DATATYPES[s.datatype].torch_dtype)
            for s in specs]


def _as_list(sample: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [sample] if isinstance(sample, torch.Tensor) else list(sample)


_PROBE_TOKENS = 8
"""The length of the token ids an embedding model's outputs are probed with."""

_Candidate = tuple[tuple[TensorSpec, ...], list[torch.Tensor] | None]
"""Inputs a model may take, and zeros to probe it with (None: sizes unknown)."""


def _candidates(model: nn.Module, sample: list[torch.Tensor] | None) -> list[_Candidate]:
    """The inputs to try, first the likeliest: the sample's; else paraloom's LeNet and MLP by
    their config; else the model's first layers in the order it holds them: rows of token
    ids (INT64, any length) for an Embedding, the features of a Linear or Conv (FP32, or
    the layer's float type)."""
    if sample is not None:
        names = _default_names("input", len(sample))
        return [(tuple(TensorSpec(n, datatype_of(t.dtype), (-1, *t.shape[1:]))
                       for n, t in zip(names, sample, strict=True)), sample)]
    found: list[tuple[int, _Candidate]] = []
    modules = list(model.modules())
    shape = _input_shape_from_model(model)
    if shape is not None:
        layer = _first_layer(model)
        specs = (TensorSpec("input", _input_datatype(model), shape),)
        at = -1 if layer is None or getattr(model, "config", None) else modules.index(layer)
        found.append((at, (specs, _sample_from_specs(specs))))
    embedding = next((i for i, m in enumerate(modules)
                      if isinstance(m, nn.Embedding | nn.EmbeddingBag)), None)
    if embedding is not None:
        found.append((embedding, ((TensorSpec("input", "INT64", (-1, -1)),),
                                  [torch.zeros(1, _PROBE_TOKENS, dtype=torch.long)])))
    if not found:
        raise ValueError(f"cannot infer the input of {type(model).__name__}: it has no Linear, "
                         "Conv or Embedding layer to read it from; describe it (paraloom serve: "
                         "--input-shape=-1,... --input-datatype ...; Python: sample=torch."
                         "zeros(1, ...) or inputs=[TensorSpec('input', 'FP32', (-1, ...))])")
    return [candidate for _, candidate in sorted(found, key=lambda f: f[0])]


def infer_signature(model: nn.Module, *, sample: torch.Tensor | Sequence[torch.Tensor] | None
                    = None, inputs: Sequence[TensorSpec] | None = None,
                    outputs: Sequence[TensorSpec] | None = None) -> ModelSignature:
    """Build the signature from explicit specs, a sample input (batch first) or the model itself.

    Outputs are found by running the model once in eval mode on the sample (or on zeros shaped
    like fully known inputs); pass ``outputs`` when that is not possible. Read from the model,
    the input is what its first layer takes (token ids for an Embedding, features for a
    Linear or Conv); where the model holds both, the first that the model runs on is taken.
    """
    samples = None if sample is None else _as_list(sample)
    candidates: list[_Candidate] = _candidates(model, samples) if inputs is None else [
        (tuple(inputs), samples if samples is not None else _sample_from_specs(inputs))]
    strings = [s.name for s in (*candidates[0][0], *(outputs or ())) if s.datatype == BYTES]
    if strings:
        raise ValueError(f"tensors {strings} are declared {BYTES}, but a torch model takes and "
                         "returns numeric tensors; declare strings in a handler.py's INPUTS "
                         "and OUTPUTS (paraloom.serving.handlers), which turns them into "
                         "tensors")
    if outputs is not None:
        return ModelSignature(candidates[0][0], tuple(outputs))
    failures: list[ValueError] = []
    for in_specs, probe in candidates:
        if probe is None:
            failures.append(ValueError(
                f"cannot infer the outputs of {type(model).__name__}: inputs "
                f"{[s.as_json() for s in in_specs]} have dimensions of unknown size; fix them "
                "for the probe (paraloom serve: --input-shape=-1,128; a models directory: "
                "\"outputs\" in the config), or in Python pass sample=torch.zeros(1, ...) or "
                "outputs=[TensorSpec(...)]"))
            continue
        try:
            specs, rowless = _output_specs(model, probe)
        except ValueError as e:
            failures.append(e)
            continue
        return ModelSignature(in_specs, specs, outputs_probed=True, rowless=rowless)
    raise failures[0]


def probe_input(signature: ModelSignature, sample: torch.Tensor | Sequence[torch.Tensor] | None
                ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """An input the model accepts, as the pool takes it (one tensor or a tuple); None if unknown."""
    probe = _as_list(sample) if sample is not None else _sample_from_specs(signature.inputs)
    if probe is None:
        return None
    return probe[0] if len(probe) == 1 else tuple(probe)
