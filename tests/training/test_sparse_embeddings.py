"""Sparse embeddings (``nn.Embedding(sparse=True)``): idle rounds and the end of an
accumulation give them an empty sparse gradient (DDP refuses a dense one), and a checkpoint
taken part way through an accumulation stores their sparse gradient and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper
from paraloom.listeners import CheckpointListener

pytestmark = pytest.mark.timeout(120)


class _Bag(nn.Module):
    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 8, sparse=sparse)
        self.out = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 40, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(count)]


def _fit(model: nn.Module, batches: list, workers: int, listeners=(), resume_from=None,
         **options) -> dict[str, torch.Tensor]:
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=workers,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         listeners=list(listeners), progress=False, **options) as wrapper:
        wrapper.fit(batches, epochs=2, resume_from=resume_from)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_allreduce_with_an_idle_worker_trains_a_sparse_embedding_as_a_dense_one() -> None:
    # 9 batches for 2 workers: the fifth round of each epoch leaves worker 1 idle.
    sparse = _fit(_Bag(), _batches(9), 2, training_mode="allreduce")
    dense = _fit(_Bag(sparse=False), _batches(9), 2, training_mode="allreduce")
    for key, value in dense.items():
        torch.testing.assert_close(sparse[key], value, rtol=1e-5, atol=1e-6)


def test_the_end_of_an_accumulation_keeps_a_sparse_gradient_as_a_loop_does() -> None:
    model, batches, ce = _Bag(), _batches(9), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # accumulate 2, the odd last batch stepping alone, loss / 2
        for i, (x, y) in enumerate(batches):
            (ce(model(x), y) / 2).backward()
            if i % 2 == 1 or i == len(batches) - 1:
                opt.step()
                opt.zero_grad()
    got = _fit(_Bag(), batches, 1, accumulate=2)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("workers", [1, 2])
def test_a_checkpoint_inside_an_accumulation_of_sparse_gradients_resumes_exactly(
        tmp_path, workers) -> None:
    class Stop(Exception):
        pass

    class StopAfter(CheckpointListener):
        def on_checkpoint(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().on_checkpoint(*args, **kwargs)
            raise Stop  # the fit ends right after its first checkpoint

    batches = _batches(12)
    reference = _fit(_Bag(), batches, workers, accumulate=2)
    with pytest.raises(Stop):  # every 3 rounds: in the middle of the second accumulation
        _fit(_Bag(), batches, workers, [StopAfter(tmp_path, every_n_iterations=3,
                                                  every_n_epochs=None)], accumulate=2)
    resumed = _fit(_Bag(), batches, workers, resume_from=tmp_path, accumulate=2)
    assert all(torch.equal(resumed[k], v) for k, v in reference.items())


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_hooks_that_cannot_take_sparse_gradients_are_refused_up_front(hook: str) -> None:
    model = _Bag()
    with pytest.raises(ValueError, match=f"comm_hook='{hook}' does not take sparse gradients"):
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        training_mode="allreduce", comm_hook=hook, progress=False)


def test_fp16_allreduce_refuses_sparse_gradients_up_front() -> None:
    """It failed on the first round inside a worker: 'reshape is not implemented for sparse
    tensors'."""
    from paraloom.sync import Fp16AllReduce

    model = _Bag()
    with pytest.raises(ValueError, match="Fp16AllReduce does not take sparse gradients"):
        ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        training_mode=Fp16AllReduce(), progress=False)


def test_the_bf16_hook_trains_a_sparse_embedding_as_its_dense_twin() -> None:
    sparse = _fit(_Bag(), _batches(5), 2, training_mode="allreduce", comm_hook="bf16")
    dense = _fit(_Bag(sparse=False), _batches(5), 2, training_mode="allreduce",
                 comm_hook="bf16")
    for name in dense:
        torch.testing.assert_close(sparse[name], dense[name], rtol=0, atol=2e-4)


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 2, dtype=torch.cfloat) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.cfloat) @ self.w).abs()


@pytest.mark.parametrize(("mode", "accumulate"), [("allreduce", 1), ("allreduce", 2),
                                                  ("averaging", 2)])
def test_complex_parameters_train_through_idle_rounds(mode: str, accumulate: int) -> None:
    """3 batches on 2 workers: the second round leaves one idle, whose zero loss must be real
    (a complex one cannot start a backward)."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g))
               for _ in range(3)]
    model = _Complex()
    before = model.w.detach().clone()
    _fit(model, batches, 2, training_mode=mode, accumulate=accumulate)
    assert model.w.dtype == torch.cfloat and bool(torch.isfinite(torch.view_as_real(model.w))
                                                  .all())
    assert (model.w.detach() - before).imag.abs().max() > 1e-4  # the imaginary parts trained


@pytest.mark.parametrize("mode", ["averaging", "allreduce", "shared_gradients", "diloco"])
def test_sgd_momentum_of_a_sparse_embedding_trains_as_its_dense_twin(mode: str) -> None:
    """SGD's momentum of a sparse gradient is a sparse tensor: averaging it failed ("reshape
    is not implemented for sparse tensors"), and so did sending it back to the user's
    optimizer (no storage to share), in every mode."""
    got = {}
    for sparse in (True, False):
        model = _Bag(sparse=sparse)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, optimizer=opt,
                             training_mode=mode, progress=False) as wrapper:
            wrapper.fit(_batches(8), epochs=2)
        buffer = opt.state[model.emb.weight]["momentum_buffer"]
        assert buffer.is_sparse == sparse  # the user's optimizer holds it as plain torch does
        got[sparse] = ({k: v.clone() for k, v in model.state_dict().items()},
                       buffer.to_dense())
    for key, value in got[False][0].items():
        torch.testing.assert_close(got[True][0][key], value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=1e-6)
