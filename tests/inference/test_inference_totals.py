"""ParallelInference.totals(): the cumulative counts and nanoseconds Triton's statistics report,
checked on batches whose make-up the test fixes with a gate."""

from __future__ import annotations

import time

import pytest
import torch
from inference_helpers import WAIT, Gate, GatedScale
from torch import nn

from paraloom.inference import ParallelInference
from paraloom.inference.totals import Phases, TotalsRecorder


class _RefusesNegatives(GatedScale):
    """``GatedScale`` that fails a batch holding a row whose first value is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] < 0).any()):
            raise ValueError("a negative first value")
        return super().forward(x)


def _wait_queued(pool: ParallelInference, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while pool.stats()["queued"] < n:
        assert time.monotonic() < deadline, f"never {n} requests queued"
        time.sleep(0.005)


def _held_then_queued(pool: ParallelInference, gate: Gate, queued: list[torch.Tensor]
                      ) -> list[object]:
    """One row runs alone while ``queued`` wait behind it; then all are answered."""
    first = pool.submit(torch.ones(1, 4))
    assert gate.entered.wait(WAIT)
    rest = [pool.submit(x) for x in queued]
    _wait_queued(pool, len(queued))
    gate.open()
    futures = [first, *rest]
    done = []
    for f in futures:
        try:
            done.append(f.result(WAIT))
        except Exception as exc:  # noqa: BLE001 - the test looks at which ones failed
            done.append(exc)
    return done


def test_each_request_adds_its_batchs_phases_and_each_batch_its_size(gate: Gate) -> None:
    with ParallelInference(GatedScale(gate), workers=1, batch_limit=16) as pool, gate:
        _held_then_queued(pool, gate, [torch.ones(1, 4) for _ in range(4)])
        totals = pool.totals()
    assert (totals["version"], totals["inference_count"], totals["execution_count"]) == (1, 5, 2)
    sizes = {b["batch_size"]: b for b in totals["batches"]}
    assert sorted(sizes) == [1, 4]  # the held row alone, then the four queued behind it merged
    assert [sizes[n]["compute_infer"]["count"] for n in (1, 4)] == [1, 1]
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert totals[phase]["count"] == 5  # type: ignore[literal-required]
        one, four = sizes[1][phase]["ns"], sizes[4][phase]["ns"]  # type: ignore[literal-required]
        assert totals[phase]["ns"] == one + 4 * four  # type: ignore[literal-required]
    # The held forward pass lasted until the gate opened, and the four waited as long.
    assert sizes[1]["compute_infer"]["ns"] > 0
    assert totals["queue"]["count"] == 5 and totals["queue"]["ns"] > 0
    assert abs(totals["last_inference_ms"] - time.time() * 1e3) < WAIT * 1e3


def test_a_failed_batch_counts_only_the_passes_that_answered(gate: Gate) -> None:
    bad = torch.tensor([[-1.0, 0.0, 0.0, 0.0]])
    with ParallelInference(_RefusesNegatives(gate), workers=1, batch_limit=16) as pool, gate:
        answers = _held_then_queued(pool, gate, [torch.ones(1, 4), bad, torch.ones(1, 4)])
        totals = pool.totals()
        stats = pool.stats()
    assert [isinstance(a, Exception) for a in answers] == [False, False, True, False]
    # The merged batch of three failed; each of its rows then ran alone and two answered.
    assert (totals["inference_count"], totals["execution_count"]) == (3, 3)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in totals["batches"]] == [(1, 3)]
    assert totals["queue"]["count"] == 3
    assert stats["completed"] == 3 and stats["failed"] == 1


def test_a_new_version_counts_from_zero_and_the_old_ones_are_kept() -> None:
    with ParallelInference(nn.Linear(4, 2), workers=1) as pool:
        for _ in range(3):
            pool.output(torch.ones(2, 4))
        assert pool.update_model(nn.Linear(4, 2)) == 2
        pool.output(torch.ones(5, 4))
        first, now = pool.totals(1), pool.totals()
    assert (first["version"], first["inference_count"], first["execution_count"]) == (1, 6, 3)
    assert (now["version"], now["inference_count"], now["execution_count"]) == (2, 5, 1)
    assert [b["batch_size"] for b in now["batches"]] == [5]


def test_the_recorder_keeps_the_latest_versions_and_reads_zeros_for_others() -> None:
    recorder = TotalsRecorder()
    for version in range(1, 18):
        recorder.answered(version, 2, 2, [0.001, 0.002], Phases(0.001, 0.002, 0.003))
    assert recorder.of(1)["execution_count"] == 0  # the 17th version pushed the first out
    latest = recorder.of(17)
    assert latest["queue"] == {"count": 2, "ns": 3_000_000}
    assert latest["compute_output"] == {"count": 2, "ns": 6_000_000}
    assert latest["batches"][0]["compute_output"] == {"count": 1, "ns": 3_000_000}
    never = recorder.of(99)
    assert never["inference_count"] == 0 and never["batches"] == []
    assert never["last_inference_ms"] == 0


@pytest.mark.parametrize("mode", ["sequential", "inplace"])
def test_every_mode_keeps_totals(mode: str) -> None:
    with ParallelInference(nn.Linear(4, 2), inference_mode=mode, workers=1) as pool:
        for rows in (1, 3):
            pool.output(torch.ones(rows, 4))
        totals = pool.totals()
    assert (totals["inference_count"], totals["execution_count"]) == (4, 2)
    assert totals["compute_infer"]["count"] == 2
