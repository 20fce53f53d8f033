"""DiLoCo's sharded exchange: what each worker receives stays about the same as workers are
added (an all-gather of every worker's message grows with their number).

The flat pseudo-gradient is cut into one contiguous shard per rank. Each rank selects the top
entries of every shard (``density`` of it) and sends shard ``j``'s message to rank ``j`` (one
all-to-all). Rank ``j`` averages the messages for its shard, adds its own *aggregate residual*
(error feedback on the average), selects the top ``density`` of the result again, keeps the rest,
and the selections of every shard go to every rank (one all-gather). Each rank sends and
receives about two messages of its own size per synchronization, whatever the number of ranks.

Messages travel as bytes (``pack``/``unpack``): int16 offsets, int32 counts per block, the
values, the fp32 scale, in that order; their sizes follow from the shard's length, so no sizes
are exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paraloom.sync.pseudo_gradients import (
    VALUE_FORMATS,
    Selection,
    blocks,
    decoded,
    entries,
    message_bytes,
    select,
    sum_selections,
)

__all__ = ["shard_bounds", "packed_size", "pack", "unpack", "sharded_average"]

_WIRE = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}


def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """``world`` contiguous (start, stop) ranges covering ``numel`` entries, near-equal."""
    cuts = [numel * r // world for r in range(world + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def packed_size(numel: int, density: float, values: str) -> int:
    """Bytes of a packed message for a shard of ``numel`` entries."""
    return message_bytes(entries(numel, density), values, numel) if numel else 0


def pack(selection: Selection) -> torch.Tensor:
    """The selection's bytes (uint8), in the module's wire order."""
    parts = [selection.offsets, selection.counts, selection.values,
             selection.scale.reshape(1).float()]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def unpack(data: torch.Tensor, numel: int, density: float, values: str) -> Selection:
    """The selection that ``pack`` turned into ``data`` for a shard of ``numel`` entries."""
    k, b = entries(numel, density), blocks(numel)
    width = VALUE_FORMATS[values]
    cut = [0, 2 * k, 2 * k + 4 * b, 2 * k + 4 * b + width * k, 2 * k + 4 * b + width * k + 4]
    offsets = data[cut[0]:cut[1]].clone().view(torch.int16)
    counts = data[cut[1]:cut[2]].clone().view(torch.int32)
    wire = data[cut[2]:cut[3]].clone().view(_WIRE[values])
    scale = data[cut[3]:cut[4]].clone().view(torch.float32).reshape(())
    return Selection(offsets, counts, wire, scale)


def _select_shards(flat: torch.Tensor, bounds: list[tuple[int, int]], density: float,
                   values: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each shard's packed top entries, and ``flat`` less what they carry (the residual)."""
    residual = flat.clone()
    packed = []
    for start, stop in bounds:
        if stop == start:
            packed.append(torch.zeros(0, dtype=torch.uint8, device=flat.device))
            continue
        mine = select(flat[start:stop], entries(stop - start, density), values)
        residual[start:stop].index_add_(0, mine.index, -decoded(mine).to(residual.dtype))
        packed.append(pack(mine))
    return packed, residual


def sharded_average(flat: torch.Tensor, aggregate_residual: torch.Tensor | None, density: float,
                    values: str, group: dist.ProcessGroup | None, rank: int, world: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The ranks' compressed average of ``flat``, by the two steps above.

    Returns (the average, dense, as every rank has it; this rank's new residual; its new
    aggregate residual for its shard; bytes sent; bytes received).
    """
    numel = flat.numel()
    bounds = shard_bounds(numel, world)
    sizes = [packed_size(stop - start, density, values) for start, stop in bounds]
    outgoing, residual = _select_shards(flat, bounds, density, values)
    device = flat.device  # the group's device (NCCL: CUDA)
    incoming = torch.empty(world * sizes[rank], dtype=torch.uint8, device=device)
    dist.all_to_all_single(incoming, torch.cat(outgoing), [sizes[rank]] * world, sizes,
                           group=group)
    start, stop = bounds[rank]
    shard = stop - start
    mean = torch.zeros(shard, dtype=flat.dtype, device=device)
    if shard:
        messages = [unpack(incoming[i * sizes[rank]:(i + 1) * sizes[rank]], shard, density,
                           values) for i in range(world)]
        mean = sum_selections(messages, shard, device).to(flat.dtype) / world
    if aggregate_residual is not None and aggregate_residual.numel() == shard:
        mean += aggregate_residual.to(flat.dtype)
    widest = max(sizes)
    mine = torch.zeros(widest, dtype=torch.uint8, device=device)
    kept = mean.clone()
    if shard:
        chosen = select(mean, entries(shard, density), values)
        kept.index_add_(0, chosen.index, -decoded(chosen).to(kept.dtype))
        mine[:sizes[rank]] = pack(chosen)
    gathered = [torch.empty(widest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    average = torch.zeros(numel, dtype=flat.dtype, device=device)
    for (lo, hi), data, size in zip(bounds, gathered, sizes, strict=True):
        if hi > lo:
            part = unpack(data[:size], hi - lo, density, values)
            average[lo:hi] = sum_selections([part], hi - lo, device).to(flat.dtype)
    sent = sum(sizes) - sizes[rank] + (world - 1) * widest
    received = (world - 1) * sizes[rank] + (world - 1) * widest
    return average, residual, kept, sent, received
