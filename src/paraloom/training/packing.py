"""A state in one piece: its tensors laid end to end in one shared-memory buffer.

A CPU tensor sent through a multiprocessing queue travels as a shared-memory segment of its
own: the sender creates and fills it, passes its file descriptor over a socket, the receiver
asks for that descriptor and maps the segment, once per tensor. For a replica's state (each
parameter and buffer, each optimizer moment, the RNG: twenty-odd tensors for a small network)
that cost 5-6 ms of CPU in each of the two processes here, every restore point of a fit that
survives failures, and again when a spare begins from one. Packed, the state is one segment and
one descriptor whatever it holds: ``pack_tensors`` copies every tensor into one buffer (in
shared memory from the start) and keeps the structure with a slot where each tensor was;
``unpack_tensors`` gives the structure back with independent copies.

A fresh segment still costs its pages (a millisecond per megabyte here) and the descriptor's
passing, so a worker packs its restore points into ``PackingBuffers``: ``RESTORE_BUFFERS``
segments used in turn, each sent once and then named by its index (``BufferedState``); the
parent keeps them mapped (``ReceivedBuffers``) and holds each state as a view of its buffer,
without a copy. A buffer is written again only after ``RESTORE_BUFFERS - 1`` more restore
points, and the parent asks for fewer than that after the one it would recover from
(``training.recovery``), which stays intact until a newer one replaces it.

Tensors that are not plain dense CPU tensors (sparse, quantized, a subclass) stay in the
structure as they are and travel as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paraloom.data import map_structure

__all__ = ["RESTORE_BUFFERS", "REUSE_LIMIT", "BufferedState", "PackedTensors", "PackingBuffers",
           "ReceivedBuffers", "pack_tensors", "unpack_tensors"]

REUSE_LIMIT = 64 * 2**20
"""Bytes up to which a state is packed into a reused buffer (``PackingBuffers``)."""
RESTORE_BUFFERS = 5
"""Buffers a worker packs restore points into, in turn: more than the parent asks for after
the restore point it holds (``recovery._MAX_PENDING`` + the one at the end of a fit)."""


@dataclass(frozen=True)
class _Slot:
    """Where one tensor lies in the buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class PackedTensors:
    """A structure (tensors in tuples, lists and mappings) whose tensors lie in ``buffer``."""

    skeleton: Any
    """The structure, each packed tensor replaced by its ``_Slot``."""
    buffer: torch.Tensor
    """One-dimensional uint8, in shared memory."""

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def private(self) -> PackedTensors:
        """The same, its buffer copied into a segment of this process's own: for a holder that
        keeps it while the sender packs into its buffer again (in shared memory, so that it
        travels on to another process without a second copy)."""
        return PackedTensors(self.skeleton, _shared_bytes(self.nbytes).copy_(self.buffer))


@dataclass(frozen=True)
class BufferedState:
    """A state packed into one of a sender's ``PackingBuffers``, as it travels: the skeleton,
    which buffer and how much of it, and the buffer itself only the first time it travels (the
    receiver keeps it mapped: ``ReceivedBuffers``). Passing a segment's file descriptor costs
    a socket connection with an authentication handshake in both processes; a reused buffer
    passes none."""

    skeleton: Any
    index: int
    """Which buffer; ``-1``: a segment of its own, which the sender does not keep."""
    nbytes: int
    buffer: torch.Tensor | None


class PackingBuffers:
    """Shared-memory buffers a sender packs into in turn (``count`` of them), each grown when
    a state does not fit: what one ``pack`` writes stays intact until ``count - 1`` more have
    been packed. A state over ``limit`` bytes gets a segment of its own instead, which is not
    kept (``count`` copies of a large model's state would hold that much shared memory)."""

    def __init__(self, count: int, limit: int = REUSE_LIMIT) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._next = 0
        self.limit = limit

    def pack(self, obj: Any) -> BufferedState:
        """``pack_tensors(obj)`` into the next buffer (or, over ``limit``, a new segment)."""
        index = self._next
        fresh: list[torch.Tensor] = []

        def take(nbytes: int) -> torch.Tensor:
            nonlocal index
            if nbytes > self.limit:
                index = -1
                fresh.append(_shared_bytes(nbytes))
                return fresh[0]
            self._next = (index + 1) % len(self._buffers)
            buffer = self._buffers[index]
            if buffer is None or buffer.numel() < nbytes:
                buffer = self._buffers[index] = _shared_bytes(nbytes)
                fresh.append(buffer)
            return buffer[:nbytes]

        packed = pack_tensors(obj, into=take)
        return BufferedState(packed.skeleton, index, packed.nbytes, fresh[0] if fresh else None)


class ReceivedBuffers:
    """The receiving end of ``PackingBuffers``: each sender's buffers, kept mapped from the
    first time they travel."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def view(self, sender: int, state: BufferedState | PackedTensors) -> PackedTensors:
        """The state ``sender`` packed, as a view of the sender's buffer: no copy, and valid
        until the sender has packed ``count - 1`` more states into its ``PackingBuffers``
        (a caller that keeps it longer copies it: ``PackedTensors.private``). The buffer
        outlives the sender's process: a state stays valid if the sender dies."""
        if isinstance(state, PackedTensors):
            return state
        if state.index < 0 and state.buffer is not None:  # not kept by the sender: as it is
            return PackedTensors(state.skeleton, state.buffer)
        if state.buffer is not None:
            self._buffers[sender, state.index] = state.buffer
        buffer = self._buffers.get((sender, state.index))
        if buffer is None:
            raise RuntimeError(f"a packed state from sender {sender} names its buffer "
                               f"{state.index}, which never arrived")
        return PackedTensors(state.skeleton, buffer[:state.nbytes])

    def clear(self) -> None:
        """Forget every sender's buffers (their processes are gone; views taken stay valid)."""
        self._buffers.clear()


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 in a shared-memory segment of their own (not yet written)."""
    return torch.empty(0, dtype=torch.uint8).set_(
        torch.UntypedStorage._new_shared(nbytes))  # type: ignore[no-untyped-call]


def _packable(t: object) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and isinstance(t, torch.Tensor)
            and t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
            and t.dtype.itemsize > 0)


def pack_tensors(obj: Any, into: Callable[[int], torch.Tensor] = _shared_bytes
                 ) -> PackedTensors:
    """``obj`` with its dense CPU tensors copied into one shared-memory buffer (one copy:
    ``obj`` may hold a model's own tensors); ``into(nbytes)`` gives the buffer (default: a
    new segment; ``PackingBuffers.take``: one of a few reused)."""
    found: dict[int, torch.Tensor] = {}
    map_structure(obj, _packable, lambda t: found.setdefault(id(t), t))
    # Widest elements first: laid end to end, every tensor then starts at a multiple of its
    # element size (a power of two), so one copy fills the buffer and every slot can be
    # viewed as its dtype.
    order = sorted(found.values(), key=lambda t: -t.dtype.itemsize)
    offsets: dict[int, int] = {}
    size = 0
    for t in order:
        offsets[id(t)] = size
        size += t.numel() * t.dtype.itemsize
    buffer = into(size)
    if order:
        with torch.no_grad():
            torch.cat([_bytes(t) for t in order], out=buffer)
    return PackedTensors(map_structure(
        obj, _packable, lambda t: _Slot(offsets[id(t)], t.dtype, tuple(t.shape))), buffer)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as one-dimensional uint8 (a copy only where it is not contiguous
    or has a conjugate or negative bit)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)


def unpack_tensors(packed: PackedTensors) -> Any:
    """The structure ``pack_tensors`` was given, each packed tensor an independent copy (not
    a view of the buffer, which may be shared with other processes)."""
    return map_structure(packed.skeleton, lambda o: isinstance(o, _Slot),
                         lambda slot: _view(packed.buffer, slot).clone())


def _view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return buffer[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
