"""An example custom synchronizer: gradients averaged with one fp16 all-reduce per step.

It shows the whole ``Synchronizer`` surface a custom scheme needs: ``setup`` (start from the
same parameters), ``after_backward`` (talk to the peers through ``ctx.group``), ``idle_step``
(join the same collective with zeros), and the byte counter. It halves the bytes of a float32
all-reduce, at the cost of fp16's 11-bit precision on the averaged gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paraloom.sync.base import StepContext, Synchronizer, is_distributed, sparse_parameters

__all__ = ["Fp16AllReduce"]


class Fp16AllReduce(Synchronizer):
    """Average the gradients in fp16 (or ``dtype``) with one flat all-reduce per step."""

    name = "fp16_allreduce"

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype}; expected torch.float16 or torch.bfloat16")
        self.dtype = dtype

    def config(self) -> dict[str, str]:
        return {"dtype": str(self.dtype)}

    def check_model(self, model: nn.Module) -> None:
        """Also refuses sparse gradients (``nn.Embedding(sparse=True)``): every gradient is
        packed into one dense tensor (it failed in the first round, inside a worker)."""
        super().check_model(model)
        if sparse_parameters(model):
            raise ValueError("Fp16AllReduce does not take sparse gradients: it packs every "
                             "gradient into one dense half-precision tensor, and the model has "
                             "a sparse embedding (nn.Embedding(sparse=True) or "
                             "nn.EmbeddingBag(sparse=True)); use training_mode='allreduce' "
                             "with comm_hook='bf16' (or no hook), or sparse=False")

    def setup(self, ctx: StepContext) -> None:
        if is_distributed(ctx):  # every replica starts from rank 0's parameters
            src = 0 if ctx.group is None else dist.get_global_rank(ctx.group, 0)
            with torch.no_grad():
                for p in ctx.model.parameters():
                    dist.broadcast(p, src=src, group=ctx.group)

    def after_backward(self, ctx: StepContext) -> None:
        self._average_gradients(ctx)

    def after_step(self, ctx: StepContext) -> None:
        self.sync_steps += 1

    def idle_step(self, ctx: StepContext) -> None:
        # No batch here: contribute zero gradients, then step like the others did.
        ctx.optimizer.zero_grad(set_to_none=True)
        self._average_gradients(ctx)
        if is_distributed(ctx):
            ctx.clip_gradients()
            ctx.optimizer.step()
        self.sync_steps += 1

    def _average_gradients(self, ctx: StepContext) -> None:
        if not is_distributed(ctx):
            return
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # Divide before the all-reduce, so the fp16 sum cannot overflow where the mean would not.
        half = flat.div(ctx.world_size).to(self.dtype)
        dist.all_reduce(half, group=ctx.group)  # identical result on every rank
        self.bytes_sent += self.collective_bytes(half, ctx.world_size)
        flat = half.to(flat.dtype)
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
