"""DDP's errors in paraloom's terms: the ``ParallelWrapper`` option to change, not DDP's API.

``training_mode="allreduce"`` runs ``DistributedDataParallel`` inside each replica, so DDP's
errors tell the user to pass keywords to a constructor they never call. ``explain`` rewrites
those messages: which parameters got no gradient (by name, where DDP lists indices) and the
``ParallelWrapper`` keyword that does what DDP's asks for.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["explain_ddp_error"]

_UNUSED = "find_unused_parameters=True"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_READY_TWICE = "Expected to mark a variable ready only once"
_SET_STATIC = "_set_static_graph()"
_DDP_KEYWORD = re.compile(r"`?(\w+)=(True|False)`?[^.]*?(?:DistributedDataParallel|DDP)")


def _unused_names(message: str, model: nn.Module) -> list[str]:
    """The names of the parameters DDP lists by index (of those that require grad)."""
    found = _INDICES.search(message)
    if found is None:
        return []
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return [trainable[i] for i in map(int, found.group(1).split()) if i < len(trainable)]


def _first_paragraph(message: str, limit: int = 600) -> str:
    """The message up to its first blank line, its lines joined (DDP wraps them mid-sentence),
    cut after the last whole sentence within ``limit`` characters."""
    text = " ".join(message.strip().split("\n\n")[0].split())
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[:end + 1] + " ..." if end > 0 else text[:limit - 3] + "..."


def explain_ddp_error(error: BaseException, model: nn.Module) -> BaseException | None:
    """``error`` with its message in paraloom's terms, of the same type, when DDP raised it
    about its own API (None otherwise)."""
    message = str(error)
    if "DistributedDataParallel" not in message and "DDP" not in message:
        return None
    head = _first_paragraph(message)
    said = f"\n(DistributedDataParallel said: {head})"
    if _READY_TWICE in message:
        text = ("a parameter got its gradient twice in one backward pass, which "
                "training_mode='allreduce' (DDP inside) cannot all-reduce: most often reentrant "
                "activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) of "
                "a module used more than once; use use_reentrant=False, or pass "
                "static_graph=True to ParallelWrapper if the model's graph is the same every "
                "step. A parameter used outside forward() does it too")
    elif _UNUSED in message and "not used in producing loss" in message:
        names = _unused_names(message, model)
        which = f" ({', '.join(names)})" if names else ""
        text = (f"parameters of the model got no gradient in a step{which}: with "
                f"training_mode='allreduce' every trainable parameter must take part in the "
                f"loss of every step. Pass find_unused_parameters=True to ParallelWrapper if "
                f"some are left out on purpose (it costs a pass over the graph each step), set "
                f"requires_grad=False on those that never train, or make every output of "
                f"forward() count in the loss")
    else:
        keyword = _DDP_KEYWORD.search(message)
        name = "static_graph" if _SET_STATIC in message else keyword.group(1) if keyword else ""
        option = f" ({name}=... is a ParallelWrapper keyword)" if name else ""
        text = (f"{head}\n(training_mode='allreduce' runs DistributedDataParallel inside each "
                f"replica: DDP's options go to ParallelWrapper as keywords{option})")
        if _SET_STATIC in text:
            text = text.replace(_SET_STATIC, "static_graph=True (a ParallelWrapper keyword)")
        if text == message:
            return None
        said = ""  # the text holds DDP's message already
    try:
        return type(error)(text + said)
    except TypeError:  # an exception type that takes other arguments
        return RuntimeError(text)
