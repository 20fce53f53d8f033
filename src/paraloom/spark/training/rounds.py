"""An epoch's rounds in a barrier stage: which minibatch each rank trains in each round.

Every rank trains in every round, so that the collectives line up: an epoch has as many rounds
as the rank with the most minibatches holds, and a rank that has run out idles (an
``IdleRound``) until the epoch ends. Where every rank knows its row count beforehand (a Parquet
share, from the files' metadata) the ranks agree on the count once (``agree_rounds``). Where
none does (a partition still streaming in from Spark), they agree block by block
(``epoch_rounds``): each rank reads up to ``ahead + 1`` minibatches ahead, and one small
all-reduce per ``ahead`` rounds says how many rounds the block has and whether any rank holds
more. The rounds are the same either way; only the number of collectives differs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from paraloom.spark.data.rows import Pair

__all__ = ["agree_rounds", "epoch_rounds"]


def agree_rounds(local_batches: int, device: str) -> int:
    """Rounds per epoch: the most minibatches any rank holds (one all-reduce)."""
    count = torch.tensor([local_batches], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def epoch_rounds(batches: Iterator[Pair], first: int, rounds: int | None, *, ahead: int,
                 device: str) -> Iterator[tuple[int, Pair | None, bool]]:
    """``(round, this rank's minibatch or None, is the epoch's last round)`` from round
    ``first`` to the epoch's end.

    ``rounds``: the epoch's round count where the ranks agreed it beforehand; None to agree
    block by block, ``ahead`` rounds (at least 1) per all-reduce, every rank calling this in
    step with the same ``ahead``. Raises ``ValueError`` for ``ahead < 1``.
    """
    if rounds is not None:
        for r in range(first, rounds):
            yield r, next(batches, None), r == rounds - 1
        return
    if ahead < 1:
        raise ValueError(f"ahead must be at least 1, got {ahead}")
    held: deque[Pair] = deque()
    r = first
    more = True
    while more:
        while len(held) <= ahead:
            batch = next(batches, None)
            if batch is None:
                break
            held.append(batch)
        vote = torch.tensor([min(len(held), ahead), int(len(held) > ahead)], dtype=torch.int64,
                            device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        block, more = int(vote[0].item()), bool(vote[1].item())
        for i in range(block):
            yield r, held.popleft() if held else None, not more and i == block - 1
            r += 1
