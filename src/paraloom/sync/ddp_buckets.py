"""DDP's gradient bucket layout, read from one DDP and given to the next.

DDP packs gradients into flat buckets and all-reduces each bucket. It starts from a layout by
parameter order and, after its first backward, rebuilds the buckets once in the order the
gradients became ready. The layout decides which elements share a chunk of the ring all-reduce,
so with three or more workers it decides the order in which each element's parts are added: a
new DDP (a replica rebuilt after a failure, a fit resumed from a checkpoint) whose first steps
ran with the starting layout would drift from the uninterrupted run by a rounding error a step.
``bucket_layout`` reads the layout a DDP has settled on, and ``ddp_with_layout`` builds a DDP
that starts with it.

Both use DDP's private hooks (``Reducer._get_zeros_like_grad_buckets`` and
``torch.distributed._compute_bucket_assignment_by_size``); where a torch release lacks them,
the layout is not carried (None) and DDP buckets as it would by itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["BucketLayout", "bucket_layout", "ddp_with_layout"]

BucketLayout = list[list[int]]
"""Each bucket's parameters, as indices into DDP's parameter list, in the order they lie."""


def _parameters(ddp: DistributedDataParallel) -> list[Any]:
    """The parameters DDP buckets, in its order: those that need a gradient and are not in
    ``parameters_to_ignore``, module by module, each once."""
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    seen: set[int] = set()
    out = []
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def bucket_layout(ddp: DistributedDataParallel) -> BucketLayout | None:
    """The layout ``ddp`` has rebuilt its buckets to; None until it has (DDP rebuilds in the
    forward after its first backward) or where this torch release does not show it."""
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return None
    buckets = getattr(ddp.reducer, "_get_zeros_like_grad_buckets", None)
    if buckets is None:
        return None
    index = {id(p): i for i, p in enumerate(_parameters(ddp))}
    try:
        return [[index[id(p)] for p in bucket.parameters()] for bucket in buckets()]
    except KeyError:  # a parameter DDP holds that the module does not list: leave it to DDP
        return None


@contextlib.contextmanager
def ddp_with_layout(layout: BucketLayout | None) -> Iterator[None]:
    """While it is open, a new ``DistributedDataParallel`` starts with ``layout`` (None: as DDP
    chooses). DDP rebuilds its buckets after its first backward as always, to the same layout
    when the gradients become ready in the same order."""
    assign: Any = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if layout is None or assign is None:
        yield
        return

    def assigned(parameters: list[Any], limits: list[int], *args: Any,
                 **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        if sorted(i for bucket in layout for i in bucket) != list(range(len(parameters))):
            chosen: tuple[list[list[int]], list[int]] = assign(parameters, limits, *args,
                                                                **kwargs)
            return chosen  # the layout is another model's: DDP chooses
        # DDP reverses the list it is given (the last parameters' gradients are ready first).
        return [list(bucket) for bucket in reversed(layout)], [max(limits)] * len(layout)

    setattr(dist, "_compute_bucket_assignment_by_size", assigned)  # noqa: B010 (private)
    try:
        yield
    finally:
        setattr(dist, "_compute_bucket_assignment_by_size", assign)  # noqa: B010
