"""The exchange of shared gradients: every rank's encoded message reaches every rank.

``exchange_messages`` runs an exchange to its end; ``start_exchange`` starts one that the
caller collects later with ``Started.wait``, so that it runs while the next step computes
(shared gradients' ``overlap=True``). Both carry, with each message, its rank's count of
non-finite update elements and which buffers its forward wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from paraloom.sync.base import StepContext, Synchronizer, is_distributed
from paraloom.sync.encoding import Encoded, Format

__all__ = ["Exchanged", "Started", "exchange_messages", "peers", "start_exchange"]

_FLAG_BITS = 31
"""Changed-buffer flags per int32 header word (the sign bit unused)."""
_FIXED_WORDS = 6
"""Header words before the flags: format, mantissa, exponent, half sign, payload length,
non-finite count."""


@dataclass(frozen=True)
class Exchanged:
    """What an exchange brings back from every rank."""

    messages: list[Encoded]
    """Every rank's message, in rank order."""
    nonfinite: list[int]
    """Each rank's count of non-finite update elements."""
    changed: list[bool]
    """Per flag passed in: whether it was set on any rank."""
    bytes_sent: int


def exchange_messages(msg: Encoded, nonfinite: int, group: dist.ProcessGroup | None,
                      world_size: int, changed: Sequence[bool] = (),
                      capacity: int | None = None) -> Exchanged:
    """All-gather every rank's message, its non-finite count and its ``changed`` flags (which
    buffers its forward wrote: every rank passes as many), and count the bytes sent.

    With a ``capacity`` (payload words that no rank's message exceeds; every rank passes the
    same), one collective: each rank's header and payload, padded to the capacity. Without
    one, two: the fixed-size headers (which carry each payload's length), then the payloads
    at their own lengths, as an all-to-all that sends each rank's payload to every rank
    (gloo's ``all_gather`` needs equal sizes). One gloo collective of a few KiB took 0.35 ms
    between two idle processes, two 0.9-1.2 ms. The byte count is what this rank really
    sends, padding included. When every payload is empty the second collective is skipped on
    every rank alike.
    """
    if capacity is not None:
        return start_exchange(msg, nonfinite, group, world_size, changed, capacity).wait()
    header = _header(msg, nonfinite, changed)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header, group=group)
    rows = torch.stack(headers).tolist()
    sent = Synchronizer.collective_bytes(header, world_size, "allgather")
    lengths = [row[4] for row in rows]
    payloads = [msg.payload.new_empty(0)] * world_size
    if any(lengths):
        gathered = msg.payload.new_empty(sum(lengths))
        own = msg.payload.reshape(-1)
        dist.all_to_all_single(gathered, own.repeat(world_size), output_split_sizes=lengths,
                               input_split_sizes=[own.numel()] * world_size, group=group)
        payloads = list(torch.split(gathered, lengths))
        sent += Synchronizer.collective_bytes(own, world_size, "allgather")
    return _exchanged(msg.numel, rows, payloads, len(changed), sent)


class Started:
    """An exchange in one collective, started by ``start_exchange``: ``wait`` collects it.

    Waiting does not change what it brings: a checkpoint may wait for it and save it
    (``state_dict``), and the step that collects it later gets the same messages.
    """

    __slots__ = ("numel", "flags", "slots", "header_words", "bytes_sent", "_work", "_result")

    def __init__(self, numel: int, flags: int, slots: Tensor, header_words: int,
                 bytes_sent: int, work: dist.Work | None = None) -> None:
        self.numel = numel
        """Elements of the tensor the messages encode."""
        self.flags = flags
        """Changed-buffer flags per rank."""
        self.slots = slots
        """Every rank's header and padded payload, one row per rank (valid once waited)."""
        self.header_words = header_words
        self.bytes_sent = bytes_sent
        self._work = work
        """The collective's ``torch.distributed`` work handle, or None once complete."""
        self._result: Exchanged | None = None

    def wait(self) -> Exchanged:
        """Every rank's message (waits for the collective the first time)."""
        if self._result is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            rows = self.slots[:, :self.header_words].tolist()
            payloads = [slot[self.header_words: self.header_words + row[4]]
                        for slot, row in zip(self.slots, rows, strict=True)]
            self._result = _exchanged(self.numel, rows, payloads, self.flags, self.bytes_sent)
        return self._result

    def state_dict(self) -> dict[str, Any]:
        """The gathered messages (waits for them), to restore with ``from_state``."""
        self.wait()
        return {"numel": self.numel, "flags": self.flags, "slots": self.slots.clone(),
                "header_words": self.header_words, "bytes_sent": self.bytes_sent}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Started:
        """A complete exchange from ``state_dict``'s output."""
        slots = state["slots"]
        if not isinstance(slots, Tensor) or slots.dtype != torch.int32 or slots.dim() != 2:
            raise ValueError(f"a saved exchange's slots are {type(slots).__name__}; expected "
                             f"an int32 tensor of one row per rank, as state_dict() saves")
        return cls(int(state["numel"]), int(state["flags"]), slots, int(state["header_words"]),
                   int(state["bytes_sent"]))


def start_exchange(msg: Encoded, nonfinite: int, group: dist.ProcessGroup | None,
                   world_size: int, changed: Sequence[bool], capacity: int) -> Started:
    """Start ``exchange_messages`` with a ``capacity``: one all-gather of every rank's header
    and payload, padded to the capacity, that runs while the caller goes on."""
    length = msg.payload.numel()
    if length > capacity:
        raise ValueError(f"a message of {length} words for a capacity of {capacity}; expected "
                         f"the encoder to keep every message within the capacity")
    header = _header(msg, nonfinite, changed)
    words = header.numel()
    slot = header.new_zeros(words + capacity)
    slot[:words] = header
    slot[words: words + length] = msg.payload.reshape(-1)
    slots = slot.new_empty(world_size, slot.numel())
    sent = Synchronizer.collective_bytes(slot, world_size, "allgather")
    work = None
    if world_size > 1:
        work = dist.all_gather(list(slots.unbind(0)), slot, group=group, async_op=True)
    else:
        slots[0] = slot
    return Started(msg.numel, len(changed), slots, words, sent, work)


def _header(msg: Encoded, nonfinite: int, changed: Sequence[bool]) -> Tensor:
    """A message's header: its fields, its payload's length, the count and the flags."""
    words = [sum(1 << bit for bit, flag in enumerate(changed[i: i + _FLAG_BITS]) if flag)
             for i in range(0, len(changed), _FLAG_BITS)]
    return torch.tensor([int(msg.format), msg.mantissa, msg.exponent, msg.half_sign,
                         msg.payload.numel(), min(nonfinite, 2**31 - 1), *words],
                        dtype=torch.int32, device=msg.payload.device)


def _exchanged(numel: int, rows: list[list[int]], payloads: list[Tensor], flags: int,
               sent: int) -> Exchanged:
    """The messages and flags from every rank's header row and payload."""
    messages = [Encoded(Format(fmt), mantissa, exponent, half_sign, numel, -1, payload)
                for (fmt, mantissa, exponent, half_sign, *_), payload
                in zip(rows, payloads, strict=True)]
    anywhere = [any(row[_FIXED_WORDS + i // _FLAG_BITS] >> (i % _FLAG_BITS) & 1 for row in rows)
                for i in range(flags)]
    return Exchanged(messages, [row[5] for row in rows], anywhere, sent)


def peers(ctx: StepContext) -> tuple[dist.ProcessGroup | None, int, int]:
    """The exchange's process group, its size and this replica's rank in it (None, 1 and 0 in
    one process)."""
    if not is_distributed(ctx):
        return None, 1, 0
    return ctx.group, ctx.world_size, dist.get_rank(group=ctx.group)
