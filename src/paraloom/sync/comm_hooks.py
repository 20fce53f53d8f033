"""PyTorch's own DDP communication hooks for ``training_mode="allreduce"``, counted and resumable.

``comm_hook="fp16"`` / ``"bf16"`` register torch's ``default_hooks.fp16_compress_hook`` /
``bf16_compress_hook`` (each bucket all-reduced in half precision, divided by the world size
first), ``comm_hook="powersgd"`` torch's ``powerSGD_hook`` (Vogels et al., 2019: each gradient
viewed as an n x m matrix, all-reduced as a rank-r product P Q^T, with error feedback). Each is
wrapped in a small function that counts what the hook all-reduces and then calls torch's hook
unchanged; for PowerSGD the count is torch's own (the element counts its state accumulates for
its compression statistics), and a bucket on the dense path (warm-up) counts whole.

PowerSGD keeps its state per DDP bucket (error feedback, P and Q). A resumed DDP starts with a
different bucket layout (one bucket in parameter order, then DDP rebuilds them in the order
backward produced the gradients), so ``PowerSGD`` also keeps that state per parameter and
rebuilds a bucket's tensors from it whenever a bucket's parameters change: a checkpoint then
restores it whatever the layout, and the resumed run equals the uninterrupted one.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations when it is
registered, and annotations kept as strings fail that check.
"""

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

__all__ = ["COMM_HOOKS", "PowerSGD", "cast_hook", "resolve_comm_hook"]

logger = logging.getLogger("paraloom")

COMM_HOOKS = ("fp16", "bf16", "powersgd")
"""The names ``comm_hook=`` takes (besides None: plain DDP)."""

Count = Callable[[int, int], None]
"""Called by a hook with (elements all-reduced, bytes per element)."""
Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
"""A DDP communication hook: (state, bucket) -> future of the bucket's averaged gradients."""

# PowerSGDState's keywords that comm_hook_options may set: the rank and the warm-up have names.
_NAMED = {"matrix_approximation_rank": "powersgd_rank", "start_powerSGD_iter": "powersgd_warmup"}
_STATE_OPTIONS = frozenset(inspect.signature(PowerSGDState.__init__).parameters) - {
    "self", "process_group", *_NAMED}
_PLAIN = (bool, int, float, str, type(None))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_comm_hook(comm_hook: str | None, powersgd_rank: int | None,
                      powersgd_warmup: int | None, comm_hook_options: dict[str, Any] | None,
                      ) -> tuple[str | None, dict[str, Any]]:
    """Check the options; returns the hook's name and PowerSGDState's keyword arguments.

    Raises ValueError for an unknown hook or a bad value, TypeError for an option that does not
    apply (PowerSGD's options without ``comm_hook="powersgd"``, an unknown PowerSGDState key).
    """
    name = comm_hook.strip().lower() if isinstance(comm_hook, str) else comm_hook
    if name is not None and name not in COMM_HOOKS:
        raise ValueError(f"comm_hook={comm_hook!r}; expected one of {list(COMM_HOOKS)} or None "
                         "(plain DDP)")
    given = {k: v for k, v in [("powersgd_rank", powersgd_rank),
                               ("powersgd_warmup", powersgd_warmup),
                               ("comm_hook_options", comm_hook_options)] if v is not None}
    if name != "powersgd":
        if given:
            raise TypeError(f"{sorted(given)} apply to comm_hook='powersgd' only; got "
                            f"comm_hook={comm_hook!r}")
        return name, {}
    rank = 1 if powersgd_rank is None else powersgd_rank
    warmup = 1000 if powersgd_warmup is None else powersgd_warmup
    if not _is_int(rank) or rank < 1:
        raise ValueError(f"powersgd_rank={rank!r}; expected an int >= 1 (the rank of the "
                         "low-rank approximation: 1, 2, 4 ...)")
    if not _is_int(warmup) or warmup < 0:
        raise ValueError(f"powersgd_warmup={warmup!r}; expected an int >= 0 (steps of plain "
                         "all-reduce before PowerSGD starts)")
    options = dict(comm_hook_options or {})
    if not all(isinstance(k, str) for k in options):
        raise TypeError(f"comm_hook_options={comm_hook_options!r}; expected a dict with str keys")
    for key, named in _NAMED.items():
        if key in options:
            raise TypeError(f"comm_hook_options[{key!r}]: set it with {named}= instead")
    unknown = sorted(set(options) - _STATE_OPTIONS)
    if unknown:
        raise TypeError(f"comm_hook_options has unknown key(s) {unknown}; PowerSGDState takes "
                        f"{sorted(_STATE_OPTIONS)}")
    bad = sorted(k for k, v in options.items() if not isinstance(v, _PLAIN))
    if bad:
        raise TypeError(f"comm_hook_options {bad}: expected numbers or bools")
    kwargs = {"matrix_approximation_rank": rank, "start_powerSGD_iter": warmup, **options}
    if warmup <= 1 and (kwargs.get("use_error_feedback", True) or kwargs.get("warm_start", True)):
        raise ValueError(f"powersgd_warmup={warmup}: PowerSGD's error feedback and warm start "
                         "need at least 2 steps of plain all-reduce first (DDP rebuilds its "
                         "buckets after the first step)")
    PowerSGDState(None, **kwargs)  # torch's own checks, now rather than in every worker
    return name, kwargs


def cast_hook(name: str, count: Count) -> Hook:
    """torch's fp16 or bf16 compress hook, counting each bucket at 2 bytes per element.

    DDP refuses torch's bf16 hook by its name unless CUDA and NCCL 2.10+ are there; this
    wrapper has another name, and gloo all-reduces bf16 on CPUs too (torch 2.13 ships NCCL 2.2x).
    """
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
    itemsize = torch.empty((), dtype=dtype).element_size()

    def counted_compress_hook(state: dist.ProcessGroup, bucket: GradBucket,
                              ) -> torch.futures.Future[torch.Tensor]:
        count(bucket.buffer().numel(), itemsize)
        return hook(state, bucket)

    return counted_compress_hook


@dataclass(frozen=True)
class _Layout:
    """What one bucket holds, and where PowerSGD puts each parameter in it."""

    params: tuple[int, ...]
    """Parameter indices (positions in ``model.parameters()``), in bucket order."""
    sizes: tuple[int, ...]
    """Their numbers of elements: the bucket (and its error feedback) is their concatenation."""
    q_plan: tuple[tuple[int, int], ...]
    """(parameter index, elements of its Q) for the compressed ones, in the order of the
    bucket's Q memory: torch groups the matrices by shape, in order of first appearance."""
    p_numel: int
    """Elements of the bucket's P memory."""


def _layout(params: Sequence[int], shapes: Sequence[torch.Size], rank: int,
            min_compression_rate: float) -> _Layout:
    """Mirror powerSGD_hook's split: which tensors it compresses, and in which order."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for index, shape in zip(params, shapes, strict=True):
        if not shape:
            raise ValueError(f"comm_hook='powersgd': parameter {index} is a 0-d tensor, and "
                             "torch's powerSGD_hook views every gradient as a matrix; make it a "
                             "1-element vector (shape (1,)) or use comm_hook='fp16'")
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:  # torch's _should_compress
            groups.setdefault((n, m), []).append((index, n * r, m * r))
    ordered = [item for group in groups.values() for item in group]
    return _Layout(tuple(params), tuple(math.prod(s) for s in shapes),
                   tuple((index, q) for index, _, q in ordered), sum(p for _, p, _ in ordered))


class PowerSGD:
    """torch's PowerSGD hook and state for one replica, with the state also kept per parameter.

    ``hook`` is what gets registered (with ``state``). Per parameter it keeps the error feedback
    (a view of torch's per-bucket tensor) and Q (a copy: torch reuses its memory), taken after
    each bucket's all-reduce; whenever a bucket's parameters differ from the last time (a new or
    rebuilt DDP, a restored checkpoint), it rebuilds that bucket's error, P and Q from them.
    """

    def __init__(self, options: dict[str, Any], group: dist.ProcessGroup,
                 params: Sequence[nn.Parameter], count: Count) -> None:
        self.state = PowerSGDState(process_group=group, **options)
        self._count = count
        self._index = {id(p): i for i, p in enumerate(params)}
        self._layouts: dict[int, _Layout] = {}
        self._errors: dict[int, torch.Tensor] = {}
        self._qs: dict[int, torch.Tensor] = {}
        self._warned = False
        # torch's hook issues its P and Q all-reduces from future callbacks, which gloo runs
        # on its own worker threads, while the training thread goes on: two buckets in flight
        # can block both of gloo's threads, and a collective the training thread issues
        # meanwhile (DDP's all-reduce of the used-parameter map with find_unused_parameters,
        # the next bucket's) can take its turn before P on one rank and after it on the other,
        # which hangs both. On gloo each bucket's PowerSGD is therefore finished inside the
        # hook; NCCL completes the futures at once and runs the callbacks in order.
        self._serialize = dist.get_backend(group) != "nccl"

    # -- the hook ------------------------------------------------------------------------------
    @property
    def hook(self) -> Hook:
        def counted_powersgd_hook(state: PowerSGDState, bucket: GradBucket,
                                  ) -> torch.futures.Future[torch.Tensor]:
            return self._run(bucket)

        return counted_powersgd_hook

    def _run(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        st = self.state
        index = bucket.index()
        tensors = bucket.parameters()
        params = tuple(self._index[id(p)] for p in tensors)
        layout = self._layouts.get(index)
        if layout is None or layout.params != params:
            layout = _layout(params, [p.shape for p in tensors], st.matrix_approximation_rank,
                             st.min_compression_rate)
            self._install(index, layout, bucket.buffer())
            self._layouts[index] = layout
        dense, itemsize = bucket.buffer().numel(), bucket.buffer().element_size()
        before, after = st.total_numel_before_compression, st.total_numel_after_compression
        fut = powerSGD_hook(st, bucket)
        if st.total_numel_before_compression == before:  # warm-up: torch all-reduced it dense
            self._count(dense, itemsize)
            return fut
        # Uncompressed tensors, then P, then Q: torch counts their elements as it splits them.
        self._count(st.total_numel_after_compression - after, itemsize)
        fut = fut.then(lambda done: self._keep(index, layout, done))
        if self._serialize:
            fut.wait()
        return fut

    def _install(self, index: int, layout: _Layout, buffer: torch.Tensor) -> None:
        """Give torch bucket ``index``'s error, P and Q as the parameters' own state."""
        st = self.state
        for memory in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            memory.pop(index, None)  # laid out for other parameters
        if any(i in self._errors for i in layout.params):
            st.error_dict[index] = torch.cat([
                self._errors[i].to(buffer) if i in self._errors else buffer.new_zeros(n)
                for i, n in zip(layout.params, layout.sizes, strict=True)])
        if layout.q_plan and all(i in self._qs and self._qs[i].numel() == q
                                 for i, q in layout.q_plan):
            # With P's memory present, torch reuses these Qs (warm start) instead of drawing.
            st.q_memory_dict[index] = torch.cat([self._qs[i].to(buffer) for i, _ in layout.q_plan])
            st.p_memory_dict[index] = buffer.new_empty(layout.p_numel)

    def _keep(self, index: int, layout: _Layout,
              done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """After torch's decompress: take the bucket's new error and Q per parameter."""
        st = self.state
        error = st.error_dict.get(index)
        if error is not None and error.numel() == sum(layout.sizes):
            pieces = torch.split(error, list(layout.sizes))
            self._errors.update(zip(layout.params, pieces, strict=True))
        q = st.q_memory_dict.get(index)
        sizes = [n for _, n in layout.q_plan]
        if q is not None and q.numel() == sum(sizes):
            self._qs.update(zip([i for i, _ in layout.q_plan], torch.split(q.clone(), sizes),
                                strict=True))
        elif q is not None and not self._warned:
            self._warned = True
            logger.warning("PowerSGD's Q memory (%d elements) does not match paraloom's reading "
                           "of torch's layout (%d): a resumed run will draw new Qs", q.numel(),
                           sum(sizes))
        return done.value()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Iteration, RNG, error feedback and Q per parameter (CPU copies)."""
        st = self.state
        rng = st.rng.get_state(legacy=False)
        assert isinstance(rng, dict)
        return {"iter": st.iter,
                "rng": {"key": torch.from_numpy(rng["state"]["key"].astype(np.int64)),
                        "pos": int(rng["state"]["pos"]), "has_gauss": int(rng["has_gauss"]),
                        "gauss": float(rng["gauss"])},
                "stats": [st.total_numel_before_compression, st.total_numel_after_compression,
                          st.next_stats_report],
                "errors": {i: t.detach().cpu().clone() for i, t in sorted(self._errors.items())},
                "qs": {i: t.detach().cpu().clone() for i, t in sorted(self._qs.items())}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        st = self.state
        st.iter = int(saved["iter"])
        rng = saved["rng"]
        st.rng.set_state({"bit_generator": "MT19937",
                          "state": {"key": rng["key"].numpy().astype(np.uint32),
                                    "pos": int(rng["pos"])},
                          "has_gauss": int(rng["has_gauss"]), "gauss": float(rng["gauss"])})
        before, after, report = (int(x) for x in saved["stats"])
        st.total_numel_before_compression, st.total_numel_after_compression = before, after
        st.next_stats_report = report
        for memory in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            memory.clear()
        self._layouts.clear()  # every bucket is rebuilt from the parameters' state
        self._errors = {int(i): t for i, t in saved["errors"].items()}
        self._qs = {int(i): t for i, t in saved["qs"].items()}
