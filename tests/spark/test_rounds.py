"""An epoch's rounds across ranks: agreed up front (row counts known) or block by block (rows
still streaming in) give the same rounds, and the streamed first epoch trains before its
partition has been read to the end."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
from collections.abc import Iterator

import numpy as np
import pytest
import torch.distributed as dist

from paraloom.spark.data.sources import StreamedPartition
from paraloom.spark.training.rounds import agree_rounds, epoch_rounds

pytestmark = pytest.mark.timeout(120)


def _batches(n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    return iter([(np.full((2, 1), i, np.float32), np.zeros(2, np.int64)) for i in range(n)])


def _rounds(rank: int, counts: list[int], ahead: int, first: int) -> tuple[list, list]:
    """This rank's rounds, voted block by block and agreed up front."""
    left = counts[rank] - first  # the batches from round ``first`` on
    streamed = [(r, None if b is None else int(b[0][0, 0]), last)
                for r, b, last in epoch_rounds(_batches(left), first, None, ahead=ahead,
                                               device="cpu")]
    rounds = agree_rounds(left, "cpu") + first
    agreed = [(r, None if b is None else int(b[0][0, 0]), last)
              for r, b, last in epoch_rounds(_batches(left), first, rounds, ahead=ahead,
                                             device="cpu")]
    return streamed, agreed


def _rank(rank: int, store: str, cases: list[tuple[list[int], int, int]], out: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        out.put((rank, [_rounds(rank, *case) for case in cases]))
    finally:
        dist.destroy_process_group()


CASES = [([5, 23], 4, 0), ([8, 8], 4, 0), ([9, 8], 4, 0), ([0, 3], 16, 0), ([7, 7], 1, 0),
         ([12, 10], 4, 3)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, list]:
    """Every case's rounds on two gloo ranks (one pair of processes for all of them)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = tmp_path_factory.mktemp("rounds") / "store"
    procs = [ctx.Process(target=_rank, args=(r, str(store), CASES, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, per_case = out.get(timeout=90)
            results[rank] = per_case
        return results
    except queue.Empty:
        pytest.fail("a rank did not finish its rounds in 90 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("case", range(len(CASES) - 1))
def test_block_votes_give_the_rounds_an_agreed_count_gives(two_ranks, case):
    counts, _, _ = CASES[case]
    rounds = max(counts)
    for rank in range(2):
        streamed, agreed = two_ranks[rank][case]
        assert streamed == agreed
        assert [r for r, _, _ in streamed] == list(range(rounds))
        # this rank's own minibatches in order, then idle rounds until the longest rank ends
        assert [b for _, b, _ in streamed] == list(range(counts[rank])) + \
            [None] * (rounds - counts[rank])
        assert [last for _, _, last in streamed] == [False] * (rounds - 1) + [True]


def test_block_votes_from_a_resumed_round(two_ranks):
    streamed, agreed = two_ranks[1][len(CASES) - 1]  # counts [12, 10], from round 3
    assert streamed == agreed
    assert [r for r, _, _ in streamed] == list(range(3, 12))
    assert [b for _, b, _ in streamed] == [*range(7), None, None] and streamed[-1][2]


def test_ahead_below_one_is_refused():
    with pytest.raises(ValueError, match="ahead must be at least 1"):
        list(epoch_rounds(_batches(1), 0, None, ahead=0, device="cpu"))


def test_a_streamed_partition_passes_chunks_on_as_they_arrive_then_reads_them_from_disk(
        tmp_path):
    arrived: list[int] = []

    def source():
        for i in range(3):
            arrived.append(i)
            yield np.full((4, 2), i, np.float32), np.full(4, i, np.int64)

    part = StreamedPartition(source(), str(tmp_path))
    assert part.rows is None and arrived == []  # nothing read on creation
    first = part.chunks(0)
    chunk = next(first)
    assert arrived == [0] and int(chunk[1][0]) == 0  # trained on before the rest arrives
    rest = list(first)
    assert [int(c[1][0]) for c in rest] == [1, 2] and part.rows == 12
    again = list(part.chunks(1))
    assert arrived == [0, 1, 2]  # the source is read once
    assert [(c[0].tolist(), c[1].tolist()) for c in again] == \
        [(c[0].tolist(), c[1].tolist()) for c in [chunk, *rest]]
    part.close()
    assert not list(tmp_path.iterdir())


def test_a_streamed_partition_left_part_read_stores_the_rest_before_the_next_pass(tmp_path):
    part = StreamedPartition(iter([(np.ones((2, 1), np.float32), np.arange(2))] * 3),
                             str(tmp_path))
    next(part.chunks(0))  # a pass that stopped after one chunk
    assert part.rows is None
    assert len(list(part.chunks(1))) == 3 and part.rows == 6
    part.close()
