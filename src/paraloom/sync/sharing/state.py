"""The tensors one replica keeps between steps, and a saved state waiting for them.

``ReplicaTensors`` holds the shared parameters (``old``), the residual, the parameters' stamps
and the buffers' last broadcast values; ``Restored`` holds what a loaded state brought (the
residual, the local view, the exchange in flight) until ``setup`` has the model to check it
against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from paraloom.sync.sharing.exchange import Started

__all__ = ["ReplicaTensors", "Restored", "differs", "residual_dtype", "same_tensors",
           "stamps"]


class ReplicaTensors:
    """The tensors one replica keeps between steps (built in ``setup``).

    ``old`` holds the shared parameters: every message is applied to it and to the
    parameters alike, so it mirrors them (or, while they hold the local view, stays the
    shared values beneath it), and the copy before the next step is needed only when
    something else wrote a parameter since (a checkpoint restored, the user's code):
    ``stamps`` holds each parameter's storage and version counter as the last step left them.
    """

    __slots__ = ("params", "old", "old_flat", "params_flat", "residual", "residual_views",
                 "old_saved", "bounds", "in_flat", "stamps", "buffers", "broadcast_values",
                 "specs")

    def __init__(self, params: list[nn.Parameter], residual: Tensor,
                 buffers: list[Tensor]) -> None:
        self.params = params
        self.specs = _specs(params)
        """Each parameter's shape, dtype, device and layout as these tensors were built for."""
        self.buffers = buffers
        self.broadcast_values: list[Tensor] | None = None
        """The buffers as the last broadcast left them (equal everywhere). Compared by value:
        BatchNorm's kernel updates its running statistics without bumping their version."""
        self.old_flat: Tensor | None = None
        """``old`` as one flat tensor when every parameter has one dtype: a message is then
        added to it with one scatter, not one per parameter."""
        if len({p.dtype for p in params}) == 1:
            self.old_flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                        device=params[0].device)
            self.old = views(self.old_flat, params)
        else:
            self.old = [torch.empty_like(p) for p in params]
        self.params_flat = self.old_flat.new_empty(self.old_flat.shape) \
            if self.old_flat is not None and all(_layable(p) for p in params) else None
        """While a fit runs (``lay``), the parameters' data laid end to end in one tensor
        (each parameter a view of it), when they share a dtype and a plain layout: a step's
        elementwise work and every message's scatter are then one operation each, not one
        per parameter (ResNet-18 has 62)."""
        self.residual = residual
        self.residual_views = views(residual, params)
        self.old_saved = False
        self.bounds = torch.tensor([p.numel() for p in params], dtype=torch.int64).cumsum(0)
        self.in_flat = False
        """Whether ``lay`` laid the parameters in ``params_flat`` (until ``unlay``)."""
        self.stamps: list[tuple[int, int]] | None = None

    def lay(self) -> None:
        """Lay the parameters' data end to end in ``params_flat`` (when it exists), each
        parameter's ``data`` a view of it, for the fit about to run; ``unlay`` ends it."""
        flat = self.params_flat
        if flat is None or self.laid():
            return
        untouched = self.stamps == self.current_stamps()
        with torch.no_grad():
            for p, part in zip(self.params, views(flat, self.params), strict=True):
                part.copy_(p)
                p.data = part
        self.in_flat = True
        self._moved(untouched)

    def unlay(self) -> None:
        """Give each parameter its own storage again (the end of a fit): the user's model
        must not keep parameters that share one, which e.g. safetensors refuses to save."""
        if self.params_flat is None or not self.laid():
            return
        untouched = self.stamps == self.current_stamps()
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.clone()
        self.in_flat = False
        self._moved(untouched)

    # The parameters as the step's operations take them: the flat tensor while laid, else the
    # parameters themselves; old, the residual and the bounds (cumulative element counts) cut
    # alike.
    @property
    def parts(self) -> list[Tensor]:
        """``[params_flat]`` while laid, else the parameters."""
        return [self.params_flat] if self.in_flat and self.params_flat is not None \
            else list(self.params)

    @property
    def old_parts(self) -> list[Tensor]:
        """``old`` cut as ``parts``."""
        return [self.old_flat] if self.in_flat and self.old_flat is not None else self.old

    @property
    def residual_parts(self) -> list[Tensor]:
        """The residual cut as ``parts``."""
        return [self.residual] if self.in_flat else self.residual_views

    @property
    def part_bounds(self) -> Tensor:
        """The cumulative element counts of ``parts``."""
        return self.bounds[-1:] if self.in_flat else self.bounds

    def _moved(self, untouched: bool) -> None:
        """The parameters' data moved to new storage with the same values: stamps that
        matched them before (nothing wrote them since) match them again."""
        if untouched:
            self.stamps = self.current_stamps()

    def laid(self) -> bool:
        """Whether every parameter's data is still its view of ``params_flat``."""
        flat = self.params_flat
        if flat is None:
            return False
        start, size = flat.data_ptr(), flat.element_size()
        offsets = [0, *self.bounds[:-1].tolist()]
        return all(p.data_ptr() == start + offset * size
                   for p, offset in zip(self.params, offsets, strict=True))

    @classmethod
    def for_model(cls, params: list[nn.Parameter], buffers: list[Tensor],
                  previous: ReplicaTensors | None, restored: bool = False) -> ReplicaTensors:
        """The tensors for a fit on ``params``: ``previous`` itself on the same model (a warm
        fit: ``old``, stamps and all), a new set that keeps its residual (the unsent
        remainder) when that still fits, else a new set with a zero residual. ``previous``'s
        residual is dropped if its parameters were written since (the user's weights, sent
        as a new model: the old weights' unsent updates are not theirs), unless ``restored``
        (a saved state brought the residual for them)."""
        numel = sum(p.numel() for p in params)
        dtype = residual_dtype(params)
        if previous is not None and same_tensors(previous.params, params) \
                and same_tensors(previous.buffers, buffers) and previous.specs == _specs(params):
            if previous.stamps != previous.current_stamps() and not restored:
                previous.residual.zero_()
            return previous
        if previous is not None and previous.residual.numel() == numel \
                and previous.residual.dtype == dtype \
                and previous.residual.device == params[0].device:
            return cls(params, previous.residual, buffers)
        return cls(params, torch.zeros(numel, dtype=dtype, device=params[0].device), buffers)

    def current_stamps(self) -> list[tuple[int, int]]:
        return stamps(self.params)

    def refresh_buffers(self, model: nn.Module) -> None:
        """Watch the model's buffers as they are now: a forward may replace one with a new
        tensor (``self.ema = 0.9 * self.ema + ...``) rather than write it in place."""
        buffers = list(model.buffers())
        if len(buffers) != len(self.buffers) or any(
                a.shape != b.shape for a, b in zip(buffers, self.buffers, strict=True)):
            self.broadcast_values = None  # compared against nothing: all count as written
        self.buffers = buffers

    def changed_buffers(self) -> list[bool]:
        """Which buffers differ from what the last broadcast left (all, before the first)."""
        if self.broadcast_values is None:
            return [True] * len(self.buffers)
        return differs(self.buffers, self.broadcast_values)

    def broadcast_done(self, which: Sequence[bool] | None = None) -> None:
        """Remember the buffers' values after a broadcast of those ``which`` flags (None: all)."""
        if self.broadcast_values is None or which is None:
            self.broadcast_values = [b.detach().clone() for b in self.buffers]
            return
        for b, v, flag in zip(self.buffers, self.broadcast_values, which, strict=True):
            if flag:
                v.copy_(b)

    def plus(self, flat: Tensor) -> dict[int, Tensor]:
        """Each parameter plus its part of ``flat`` (laid out as the residual), by ``id``."""
        return {id(p): p.detach() + part.to(p.dtype)
                for p, part in zip(self.params, views(flat, self.params), strict=True)}

    def apply_residual_(self, flat: Tensor) -> None:
        """Add ``flat`` (every replica's unsent updates) to the parameters; empty the
        residual, which it includes."""
        with torch.no_grad():
            for p, part in zip(self.params, views(flat, self.params), strict=True):
                p.add_(part.to(p.dtype))
        self.residual.zero_()

    def save_old(self) -> None:
        """``old = params``, unless ``old`` already mirrors them."""
        if self.stamps != self.current_stamps():
            for p, old in zip(self.parts, self.old_parts, strict=True):
                old.copy_(p)

    def put_back_shared(self) -> None:
        """``params = old``: the shared parameters back in the model (the local view
        leaves)."""
        for p, old in zip(self.parts, self.old_parts, strict=True):
            p.copy_(old)
        self.stamps = self.current_stamps()
        self.old_saved = False


class Restored:
    """What a loaded state brought for the model, waiting for ``setup`` to check and take it:
    the residual and the exchange in flight at once, the local view at the next step."""

    __slots__ = ("residual", "view", "started")

    def __init__(self, residual: Tensor | None = None, view: list[Tensor] | None = None,
                 started: Started | None = None) -> None:
        self.residual = residual
        self.view = view
        """The local view a restored state brought, set at the next step."""
        self.started = started

    def take_started(self, tensors: ReplicaTensors | None) -> Started | None:
        """The saved exchange in flight (once), checked against the model's size."""
        started, self.started = self.started, None
        if started is not None and tensors is not None \
                and started.numel != tensors.residual.numel():
            raise ValueError(f"shared_gradients: the saved exchange in flight encodes "
                             f"{started.numel} elements but the model has "
                             f"{tensors.residual.numel()} trainable ones; expected a "
                             f"checkpoint of the same model")
        return started

    def take_residual(self, tensors: ReplicaTensors) -> bool:
        """Copy the saved residual (once) into ``tensors``, checking it and the saved local
        view against the model; whether there was one."""
        residual, self.residual = self.residual, None
        if residual is None:
            return False
        if residual.numel() != tensors.residual.numel():
            raise ValueError(f"shared_gradients: the saved residual has {residual.numel()} "
                             f"elements but the model has {tensors.residual.numel()} "
                             f"trainable ones; expected a checkpoint of the same model")
        tensors.residual.copy_(residual.reshape(-1))
        if self.view is not None and [t.shape for t in self.view] != \
                [p.shape for p in tensors.params]:
            raise ValueError("shared_gradients: the saved local view does not match the "
                             "model's trainable parameters; expected a checkpoint of the same "
                             "model")
        return True

    def take_view(self) -> list[Tensor] | None:
        """The saved local view (once)."""
        view, self.view = self.view, None
        return view


def differs(tensors: Sequence[Tensor], values: Sequence[Tensor], *,
            batched: bool | None = None) -> list[bool]:
    """Per pair, whether the tensor's shape or any element differs from the value's.

    On the CPU each pair is compared by ``torch.equal``, which stops at the first difference;
    on one accelerator (``batched=None`` chooses) all pairs are compared on the device and read
    back in one transfer, not one host synchronization per buffer (ResNet-18 has 60).
    """
    same_shape = [t.shape == v.shape for t, v in zip(tensors, values, strict=True)]
    pairs = [(t, v) for t, v, ok in zip(tensors, values, same_shape, strict=True) if ok]
    if batched is None:
        devices = {t.device for pair in pairs for t in pair}
        batched = len(devices) == 1 and next(iter(devices)).type != "cpu"
    if batched and pairs:
        found = iter(torch.stack([t.ne(v).any() for t, v in pairs]).tolist())
    else:
        found = iter([not torch.equal(t, v) for t, v in pairs])
    return [next(found) if ok else True for ok in same_shape]


def same_tensors(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether both hold the very same tensor objects, in order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def stamps(tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
    """Each tensor's storage and version counter: both stay put until something writes it."""
    return [(t.data_ptr(), t._version) for t in tensors]


def _specs(params: Sequence[Tensor]) -> list[tuple[object, ...]]:
    return [(p.shape, p.dtype, p.device, p.is_contiguous()) for p in params]


def _layable(p: Tensor) -> bool:
    """Whether ``p`` can become a view of a flat tensor without changing its layout."""
    return p.is_contiguous() and not p.is_sparse and p.layout == torch.strided


def views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """``flat`` cut into views shaped like ``params``, laid end to end."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def residual_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """float32, or float64 with float64 parameters: 16-bit residuals would lose small updates."""
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype
