"""What a user's model and calls can do that the pool must still get right: outputs that are
not batch-first, numpy outputs, a model that exits while its batch is re-run, cancelled
futures, token ids given as a list, a timeout while running."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from inference_helpers import WAIT, Gate, GatedScale
from torch import nn

from paraloom.inference import (
    InferenceClosedError,
    InferenceError,
    InvalidRequestError,
    ParallelInference,
    QueueFullError,
    RequestTimeoutError,
)


class GRUStates(nn.Module):
    """A batch-first GRU that returns (outputs, h_n): h_n is (layers, N, H), not batch-first."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(3, 4, num_layers=layers, batch_first=True)
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows.append(x.shape[0])
        return self.rnn(x)


@pytest.mark.parametrize("example", [True, False])
def test_outputs_that_are_not_batch_first_are_answered_request_by_request(example) -> None:
    # Three layers and three one-row requests: merged, h_n's first dimension equals the rows
    # by coincidence, so only a check with another row count can tell.
    model = GRUStates(layers=3).eval()
    xs = [torch.randn(1, 5, 3) for _ in range(3)]
    options = {"example_input": xs[0]} if example else {}
    with pytest.warns(RuntimeWarning, match=r"h_n.transpose\(0, 1\).*one at a time"):
        with ParallelInference(model, workers=1, max_wait_ms=300, **options) as pool:
            outs = [f.result(WAIT) for f in [pool.submit(x) for x in xs]]
            stats = pool.stats()
            rows = pool._generation.replicas[0].rows  # the replica's, not the model's
    for x, (seq, h_n) in zip(xs, outs, strict=True):
        want_seq, want_h = model.rnn(x)
        assert h_n.shape == (3, 1, 4)
        torch.testing.assert_close(h_n, want_h)
        torch.testing.assert_close(seq, want_seq)
    assert stats["failed"] == 0 and stats["completed"] == 3
    assert rows[-5:] == [1, 2, 1, 1, 1]  # the check's 1 and 2 rows, then each request alone


def test_batch_first_outputs_are_still_merged_after_the_check() -> None:
    model = GRUStates(layers=1).eval()
    model.forward = lambda x: model.rnn(x)[0]  # type: ignore[method-assign]
    xs = [torch.randn(1, 5, 3) for _ in range(4)]
    with ParallelInference(model, workers=1, max_wait_ms=300) as pool:
        outs = [f.result(WAIT) for f in [pool.submit(x) for x in xs]]
        assert pool.stats()["batch_size_histogram"] == {4: 1}
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, model.rnn(x)[0])


class ArrayHead(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"tensor": x * 2, "array": (x * 3).numpy(), "note": "kept"}


def test_numpy_arrays_in_an_output_are_split_by_rows_as_tensors_are() -> None:
    xs = [torch.full((n, 2), float(n)) for n in (1, 2, 3)]
    with ParallelInference(ArrayHead(), workers=1, max_wait_ms=300) as pool:
        outs = [f.result(WAIT) for f in [pool.submit(x) for x in xs]]
        assert pool.stats()["batch_size_histogram"] == {6: 1}
    for x, out in zip(xs, outs, strict=True):
        assert isinstance(out["array"], np.ndarray)
        np.testing.assert_array_equal(out["array"], (x * 3).numpy())
        torch.testing.assert_close(out["tensor"], x * 2)
        assert out["note"] == "kept"


class ExitsAlone(nn.Module):
    """Fails merged batches; alone, a negative input calls sys.exit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            raise RuntimeError("batch too big")
        if x[0, 0] < 0:
            raise SystemExit("the model called sys.exit")
        return x


# SystemExit ends the worker thread it was raised in (the other worker serves on).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_model_that_exits_while_its_batch_is_rerun_fails_the_batch_never_hangs() -> None:
    with ParallelInference(ExitsAlone(), workers=2, max_wait_ms=200) as pool:
        pool.output(torch.ones(1, 1))
        futures = [pool.submit(torch.ones(1, 1)), pool.submit(-torch.ones(1, 1))]
        for future in futures:
            with pytest.raises(InferenceError, match="interrupted"):
                future.result(WAIT)
        torch.testing.assert_close(pool.output(torch.ones(1, 1)), torch.ones(1, 1))


def test_a_cancelled_future_gives_its_place_in_the_queue_back() -> None:
    gate = Gate()
    with ParallelInference(GatedScale(gate), workers=1, queue_limit=2, batch_limit=1) as pool, \
            gate:
        running = pool.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        queued = [pool.submit(torch.ones(1, 1)) for _ in range(2)]
        with pytest.raises(QueueFullError):
            pool.submit(torch.ones(1, 1), block=False)
        assert all(f.cancel() for f in queued)
        assert pool.stats()["queued"] == 0
        after = pool.submit(torch.ones(1, 1), block=False)
        gate.open()
        assert after.result(WAIT).item() == 2.0 and running.result(WAIT).item() == 2.0
        stats = pool.stats()
    assert stats["rejections"]["cancelled"] == 2 and stats["completed"] == 2


def test_a_list_of_token_ids_is_one_row_of_int64() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(20, 2)).eval()
    with ParallelInference(model, workers=1) as pool:
        out = pool.output([1, 2, 3, 4, 5])
        torch.testing.assert_close(out, model(torch.tensor([[1, 2, 3, 4, 5]])))
    linear = nn.Linear(2, 1)
    with ParallelInference(linear, workers=1) as pool:  # one float makes the row floats
        torch.testing.assert_close(pool.output([1, 2.5]), linear(torch.tensor([[1.0, 2.5]])))


def test_a_request_that_times_out_while_running_is_counted_once() -> None:
    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.5)
            return x

    with ParallelInference(Slow(), workers=1) as pool:
        with pytest.raises(RequestTimeoutError):
            pool.output(torch.ones(1, 1), timeout=0.2)
        deadline = time.monotonic() + WAIT
        while pool.stats()["batches"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = pool.stats()
    assert (stats["completed"], stats["failed"], stats["rejections"]["timeout"]) == (0, 1, 1)


def test_a_submitted_request_fails_at_its_deadline_while_it_runs(gate) -> None:
    """As output() does: the Future fails on time, and the worker's output is dropped."""
    with ParallelInference(GatedScale(gate), workers=1) as pool, gate:
        running = pool.submit(torch.ones(1, 1), timeout=0.2)
        assert gate.entered.wait(WAIT)
        started = time.monotonic()
        assert isinstance(running.exception(WAIT), RequestTimeoutError)
        assert time.monotonic() - started < 1.0 and not gate.opened.is_set()
        gate.open()
        assert pool.output(torch.ones(1, 1)).item() == 2.0
        stats = pool.stats()
    assert (stats["completed"], stats["failed"], stats["rejections"]["timeout"]) == (1, 1, 1)


def test_a_cancelled_output_async_task_gives_its_place_in_the_queue_back(gate) -> None:
    """An asyncio server cancels a request's task when its client goes: the request leaves
    the queue, as a cancelled submit() Future does, and frees its place."""
    import asyncio

    async def main(pool: ParallelInference) -> None:
        tasks = [asyncio.create_task(pool.output_async(torch.ones(1, 1))) for _ in range(2)]
        while pool.stats()["queued"] < 2:
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with ParallelInference(GatedScale(gate), workers=1, queue_limit=2, batch_limit=1) as pool, \
            gate:
        running = pool.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        asyncio.run(main(pool))
        assert pool.stats()["queued"] == 0
        after = pool.submit(torch.ones(1, 1), block=False)  # QueueFullError before
        gate.open()
        assert after.result(WAIT).item() == 2.0 and running.result(WAIT).item() == 2.0
        stats = pool.stats()
    assert stats["rejections"]["cancelled"] == 2 and stats["completed"] == 2


def test_output_async_requests_past_their_timeout_in_the_queue_count_as_timeouts(gate) -> None:
    """They were counted as cancelled: asyncio.wait_for cancelled their futures first."""
    import asyncio

    async def main(pool: ParallelInference) -> list[object]:
        return list(await asyncio.gather(*(pool.output_async(torch.ones(1, 1), timeout=0.1)
                                           for _ in range(3)), return_exceptions=True))

    with ParallelInference(GatedScale(gate), workers=1, batch_limit=1) as pool, gate:
        running = pool.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        answers = asyncio.run(main(pool))
        gate.open()
        assert running.result(WAIT).item() == 2.0
        stats = pool.stats()
    assert [type(a) for a in answers] == [RequestTimeoutError] * 3
    assert (stats["rejections"]["timeout"], stats["rejections"]["cancelled"]) == (3, 0)
    assert (stats["completed"], stats["failed"], stats["queued"]) == (1, 3, 0)


def test_a_request_past_its_timeout_while_running_is_not_in_the_totals(gate) -> None:
    """totals() counted it answered (rows, queue and compute) though its caller got the
    timeout; the forward pass it ran in still counts."""
    with ParallelInference(GatedScale(gate), workers=1) as pool, gate:
        late = pool.submit(torch.ones(3, 1), timeout=0.1)
        assert gate.entered.wait(WAIT)
        assert isinstance(late.exception(WAIT), RequestTimeoutError)
        gate.open()
        assert pool.output(torch.ones(2, 1)).shape == (2, 1)
        totals = pool.totals()
    assert (totals["inference_count"], totals["execution_count"]) == (2, 2)
    assert totals["queue"]["count"] == totals["compute_infer"]["count"] == 1
    assert sorted(b["batch_size"] for b in totals["batches"]) == [2, 3]


def test_the_stats_read_right_after_an_answer_count_it() -> None:
    """``requests == completed + failed + queued + running`` holds the moment a caller has
    its output: it was counted before the caller could wake."""
    import asyncio

    async def main(pool: ParallelInference) -> list[int]:
        lagging = []
        for i in range(300):
            await pool.output_async(torch.ones(1, 1))
            stats = pool.stats()
            if stats["completed"] != i + 1:
                lagging.append(i)
        return lagging

    with ParallelInference(nn.Identity(), workers=1) as pool:
        assert asyncio.run(main(pool)) == []


def test_requests_of_a_first_merged_batch_fail_at_their_deadline_during_the_rows_check(
        gate) -> None:
    """The check that outputs follow the rows ran before the batch's requests were claimed:
    the deadline thread left them to the worker, and they failed late, after the check."""
    with ParallelInference(GatedScale(gate), workers=1, batch_limit=2, max_wait_ms=1000) as pool, \
            gate:
        waiting = [pool.submit(torch.ones(1, 1), timeout=0.3) for _ in range(2)]  # one batch
        assert gate.entered.wait(WAIT)  # the check's first forward pass, held
        for future in waiting:
            assert isinstance(future.exception(5), RequestTimeoutError)
        assert not gate.opened.is_set()
        gate.open()
        assert pool.output(torch.ones(1, 1)).item() == 2.0
        assert pool.stats()["batches"] == 1  # the expired batch was not run after the check


class _Layered(nn.Module):
    """An LSTM's h_n shape, (layers=2, N, 3), beside the rows; refuses inputs over 100."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if bool((x > 100).any()):
            raise ValueError("an input over 100")
        h = (x * self.w).expand(-1, 3).unsqueeze(0).repeat(2, 1, 1)
        return x * self.w, h


def test_outputs_not_row_first_are_found_after_a_first_merged_batch_a_request_failed() -> None:
    """The rows check ran on the refused request, failed, and counted as done: later merged
    batches split h_n by layers, and each request got another's rows, with no error."""
    model = _Layered()
    with pytest.warns(RuntimeWarning, match="first dimension is the batch"), \
            ParallelInference(model, workers=1, batch_limit=2, max_wait_ms=1000) as pool:
        bad, good = pool.submit(torch.full((1, 1), 1000.0)), pool.submit(torch.ones(1, 1))
        assert isinstance(bad.exception(WAIT), InvalidRequestError)
        good.result(WAIT)
        a, b = torch.tensor([[1.0]]), torch.tensor([[5.0]])
        answers = [pool.submit(a), pool.submit(b)]  # merged, were it not refused
        for x, future in zip((a, b), answers, strict=True):
            out, h = future.result(WAIT)
            torch.testing.assert_close(h, model(x)[1])


def test_an_answer_that_comes_just_after_a_wait_timed_out_is_given_not_a_timeout() -> None:
    """output() waits in ticks; an answer set between a tick's timeout and the check after it
    raised that tick's TimeoutError ("no outcome yet") to the caller."""
    import types

    from paraloom.inference.pending import Pending

    class Late(Pending):
        def result(self, timeout: float | None = None) -> object:
            if not self.done():
                self.set_result(7)  # the worker answers as the tick runs out
                raise TimeoutError("no outcome yet")
            return super().result(timeout)

    with ParallelInference(nn.Identity(), workers=1) as pool:
        late = Late()
        assert late.set_running_or_notify_cancel()
        assert pool._wait(types.SimpleNamespace(future=late, deadline=None)) == 7


def test_a_first_request_of_float64_numpy_names_the_dtype_fix() -> None:
    """It read "the model (or its device) is at fault": numpy's float64 default for a float32
    model, the usual first mistake, blamed on the model."""
    with ParallelInference(nn.Linear(4, 3), workers=1) as pool:
        with pytest.raises(InferenceError, match=r"this input is float64 where the model's "
                                                 r"weights are float32: send float32"):
            pool.output(np.random.default_rng(0).random((2, 4)))
        assert pool.output(np.zeros((2, 4), np.float32)).shape == (2, 3)


def test_a_first_request_of_whole_numbers_to_a_float_model_names_the_fix() -> None:
    """[1, 2, 3, 4] is int64: the error said the model was at fault."""
    with ParallelInference(nn.Linear(4, 2), workers=1) as pool:
        with pytest.raises(InferenceError, match=r"this input is int64 where the model's weights "
                                                 r"are float32: if it holds numbers, not indices, "
                                                 r"send float32.*write 1\.0, not 1"):
            pool.output([1, 2, 3, 4])


def test_the_dtype_fix_for_a_bfloat16_model_names_no_numpy_bfloat16() -> None:
    with ParallelInference(nn.Linear(4, 2).to(torch.bfloat16), workers=1) as pool:
        with pytest.raises(InferenceError) as failed:
            pool.output(torch.ones(1, 4))
    assert "send bfloat16 (numpy has no bfloat16: send a tensor; torch: x.to(torch.bfloat16))" \
        in str(failed.value)
    assert "numpy.bfloat16" not in str(failed.value)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_after_the_last_worker_stops_a_request_is_told_so_not_to_call_output_before_close(
        ) -> None:
    class Exits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise SystemExit(3)

    pool = ParallelInference(Exits(), workers=1)
    try:
        with pytest.raises(InferenceError, match="interrupted"):
            pool.output(torch.ones(1, 2), timeout=WAIT)
        with pytest.raises(InferenceClosedError, match="every inference worker thread has "
                                                       "stopped.*SystemExit.*create a new one"):
            pool.output(torch.ones(1, 2), timeout=WAIT)
    finally:
        pool.close()


class _DoublesInPlace(nn.Module):
    """Doubles its input in place (an in-place normalisation); a row of fives waits at the
    gate first."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 5).all()):
            self.gate.pass_through()
        return x.mul_(2)


def test_a_model_that_writes_its_input_answers_each_request_once_and_keeps_the_example(
        gate: Gate) -> None:
    """The rows check before the first merged batch ran a request's own tensor once more, and
    the warm-up ran the caller's example_input once per replica: a model writing its input
    answered 4x (not 2x) to a request, and changed the caller's example four times."""
    example = torch.ones(1, 2)
    with ParallelInference(_DoublesInPlace(gate), workers=3, example_input=example,
                           timeout=WAIT):
        assert example.tolist() == [[1.0, 1.0]]
    with ParallelInference(_DoublesInPlace(gate), workers=1, timeout=WAIT) as pi:
        first = pi.submit(torch.full((1, 2), 5.0))
        assert gate.entered.wait(WAIT)
        queued = [pi.submit(torch.full((1, 2), float(i))) for i in range(1, 4)]
        gate.open()
        assert first.result(WAIT).tolist() == [[10.0, 10.0]]
        assert [f.result(WAIT).tolist() for f in queued] == [[[2.0, 2.0]], [[4.0, 4.0]],
                                                             [[6.0, 6.0]]]
        assert pi.stats()["batch_size_histogram"].get(3) == 1  # the three were merged


_LAYERS_FIRST_EVENTS: dict[str, threading.Event] = {}


class _LayersFirst(nn.Module):
    """Outputs (2, N), as an LSTM's h_n is (layers, N, H). Rows of -1 and -2 hold their worker
    until released; the rows check's second pass (two rows of 1) waits up to 2 s for another
    worker's merged pass of rows of 3 to start (it never may, while the check runs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        events, value, rows = _LAYERS_FIRST_EVENTS, float(x[0, 0]), x.shape[0]
        if value < 0:
            events[f"started {value:g}"].set()
            assert events[f"release {value:g}"].wait(WAIT)
        elif value == 1 and rows == 1:  # the check's first pass: let the other worker go on
            events["release -2"].set()
        elif value == 1 and rows == 2:
            events["merged 3"].wait(2.0)
        elif value == 3 and rows == 2:
            events["merged 3"].set()
        s = x.sum(1)
        return torch.stack([s, -s])


def test_a_merged_batch_waits_for_the_rows_check_another_worker_runs() -> None:
    """The check said the rows were checked after its first pass: a second worker then merged
    two requests of a model whose outputs are (layers, N) and split them by layers, giving
    each request another's numbers, with no error (seen with an LSTM's h_n)."""
    _LAYERS_FIRST_EVENTS.clear()
    _LAYERS_FIRST_EVENTS.update({name: threading.Event() for name in (
        "started -1", "started -2", "release -1", "release -2", "merged 3")})
    events, model = _LAYERS_FIRST_EVENTS, _LayersFirst()
    with warnings.catch_warnings(), \
            ParallelInference(model, workers=2, batch_limit=2, max_wait_ms=0) as pool:
        warnings.simplefilter("ignore", RuntimeWarning)  # the refusal's, in a worker thread
        first = pool.submit(torch.full((1, 4), -1.0))  # alone: each holds a worker
        assert events["started -1"].wait(WAIT)
        second = pool.submit(torch.full((1, 4), -2.0))
        assert events["started -2"].wait(WAIT)
        xs = [torch.full((1, 4), v) for v in (1.0, 2.0, 3.0, 4.0)]
        answers = [pool.submit(x) for x in xs]  # queued: two batches of two
        events["release -1"].set()  # its worker takes (1, 2) and checks; the other (3, 4)
        for x, future in [*zip(xs, answers, strict=True), (-1, first), (-2, second)]:
            x = x if isinstance(x, torch.Tensor) else torch.full((1, 4), float(x))
            assert torch.equal(future.result(WAIT), model(x))
