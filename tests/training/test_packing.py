"""A state laid end to end in one shared-memory buffer (restore points, a spare's Begin)."""

from __future__ import annotations

import collections
import pickle
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from paraloom.training.packing import (
    PackedTensors,
    PackingBuffers,
    ReceivedBuffers,
    pack_tensors,
    unpack_tensors,
)
from paraloom.training.transport import dumps


class _Pair(NamedTuple):
    first: torch.Tensor
    second: int


def _state() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(6, 5)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),  # an OrderedDict, a long num_batches_tracked
        "optimizer": opt.state_dict(),  # int keys, 0-dim float "step" tensors
        "rng": torch.get_rng_state(),
        "step": 7,
        "odd": [torch.zeros(0, 3), torch.tensor(True), torch.arange(10)[::3],
                torch.randn(3, dtype=torch.complex64).conj(), torch.randn(2, 2).bfloat16(),
                torch.randn(3, 4).t(), _Pair(torch.ones(2, dtype=torch.float64), 3)],
        "sparse": torch.eye(3).to_sparse(),
    }


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b) or isinstance(a, torch.Tensor)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape
        if a.is_sparse:
            assert torch.equal(a.to_dense(), b.to_dense())
        else:
            assert torch.equal(a.resolve_conj(), b.resolve_conj())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_a_state_comes_back_whole_from_one_shared_buffer() -> None:
    state = _state()
    packed = pack_tensors(state)
    assert packed.buffer.is_shared() and packed.buffer.dtype == torch.uint8
    dense = [t for t in _tensors(state) if not t.is_sparse]
    assert packed.nbytes >= sum(t.numel() * t.element_size() for t in dense)
    back = unpack_tensors(packed)
    _assert_same(state, back)
    assert isinstance(back["model"], collections.OrderedDict)
    assert isinstance(back["odd"][6], _Pair)
    assert back["sparse"] is state["sparse"]  # not packed: it travels as before


def test_unpacked_tensors_are_independent_of_the_buffer() -> None:
    packed = pack_tensors({"w": torch.ones(4)})
    back = unpack_tensors(packed)
    packed.buffer.zero_()  # a buffer the sender (or a later send) may write again
    assert torch.equal(back["w"], torch.ones(4))


def test_a_packed_state_pickles_as_one_shared_segment() -> None:
    # What a queue to a worker process sends: one storage however many tensors it holds.
    state = _state()
    state.pop("sparse")
    plain, packed = _storages(state), _storages(pack_tensors(state))
    assert plain > 20 and packed == 1
    assert isinstance(pickle.loads(dumps(pack_tensors(state))), PackedTensors)


def test_a_state_without_tensors_packs_to_an_empty_buffer() -> None:
    packed = pack_tensors({"step": 3, "name": "x"})
    assert packed.nbytes == 0 and unpack_tensors(packed) == {"step": 3, "name": "x"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.int64, torch.float64,
                                   torch.uint8, torch.complex128])
def test_every_element_size_keeps_its_alignment(dtype: torch.dtype) -> None:
    tensors = [torch.arange(n).to(dtype) for n in (1, 3, 5, 7)]
    back = unpack_tensors(pack_tensors(tensors))
    for a, b in zip(tensors, back, strict=True):
        assert b.dtype == dtype and torch.equal(a, b)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _storages(obj: object) -> int:
    """File descriptors that pickling ``obj`` for a worker process passes (one per
    shared-memory segment)."""
    import multiprocessing.reduction

    passed: list[int] = []
    original = multiprocessing.reduction.DupFd

    def counting(fd: int) -> Any:
        passed.append(fd)
        return original(fd)

    multiprocessing.reduction.DupFd = counting  # type: ignore[assignment]
    try:
        dumps(obj)
    finally:
        multiprocessing.reduction.DupFd = original  # type: ignore[assignment]
    return len(passed)


def test_buffers_travel_once_and_are_reused_in_turn_and_grow_when_a_state_does_not_fit() -> None:
    sender, receiver = PackingBuffers(3), ReceivedBuffers()
    sent, held = [], []
    for i in range(4):
        sent.append(sender.pack({"w": torch.full((4,), float(i))}))
        held.append(receiver.view(7, pickle.loads(dumps(sent[-1]))))  # as a queue carries it
    # Each buffer travels the first time only; the fourth state is in the first buffer again.
    assert [s.buffer is not None for s in sent] == [True, True, True, False]
    assert [s.index for s in sent] == [0, 1, 2, 0]
    # Views of the sender's buffers, not copies: each intact until two more were packed.
    assert [unpack_tensors(k)["w"][0].item() for k in held] == [3.0, 1.0, 2.0, 3.0]
    assert held[0].buffer.untyped_storage().data_ptr() == \
        held[3].buffer.untyped_storage().data_ptr()
    kept = held[1].private()  # a copy, for a holder that keeps it longer
    assert sender.pack({"w": torch.full((4,), 9.0)}).buffer is None  # into buffer 1, again
    assert unpack_tensors(held[1])["w"][0].item() == 9.0
    assert unpack_tensors(kept)["w"][0].item() == 1.0
    bigger = sender.pack({"w": torch.ones(100)})  # buffer 2 is too small: a new one travels
    assert bigger.index == 2 and bigger.buffer is not None
    assert torch.equal(unpack_tensors(receiver.view(7, bigger))["w"], torch.ones(100))
    assert unpack_tensors(held[2])["w"][0].item() == 2.0  # the old buffer 2: still mapped
    with pytest.raises(RuntimeError, match="sender 8 names its buffer 0, which never arrived"):
        receiver.view(8, sent[3])


def test_a_state_over_the_limit_gets_a_segment_of_its_own_which_is_not_kept() -> None:
    # Five copies of a large model's state would hold five times its size in shared memory.
    sender, receiver = PackingBuffers(3, limit=100), ReceivedBuffers()
    small = sender.pack({"w": torch.ones(4)})
    large = sender.pack({"w": torch.ones(100)})
    assert (small.index, large.index) == (0, -1) and large.buffer is not None
    assert sender.pack({"w": torch.ones(4)}).index == 1  # the turn goes on past the large one
    kept = receiver.view(0, large)
    assert kept.buffer is large.buffer  # never written again: kept as it came
    assert torch.equal(unpack_tensors(kept)["w"], torch.ones(100))


def test_the_handles_a_pickle_holds_include_a_sparse_tensors_parts() -> None:
    """A sparse tensor's indices and values are shared through their own reductions, nested
    in its own: their descriptors went unnoted, so a message a dead worker never read kept
    them (and their shared memory) for the life of the process."""
    from paraloom.training.transport import fetched, release_unfetched

    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,),
                                     check_invariants=True)
    handles: list[int] = []
    data = dumps({"momentum": sparse, "dense": torch.ones(3)}, handles)
    assert len(handles) == 3  # the dense tensor's, and the sparse one's indices and values
    assert fetched(handles) == handles
    release_unfetched(handles)
    assert fetched(handles) == []
    del data
