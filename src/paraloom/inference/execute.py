"""Running one batch on one replica: claim, collate, forward, split, deliver, isolate failures.

If a batch's forward pass raises, every request is re-run alone, so only the requests that fail
on their own fail, with an InvalidRequestError naming the received and the expected input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import InvalidStateError
from typing import Any

import torch

from paraloom.inference.batching import Request
from paraloom.inference.errors import InferenceError, InvalidRequestError, RequestTimeoutError
from paraloom.inference.payload import (
    UnsplittableOutputError,
    collate,
    describe_key,
    key_kind,
    key_sizes,
    split_output,
    to_device,
    to_numpy,
)
from paraloom.inference.replicas import Generation, check_rows_first
from paraloom.inference.stats import StatsRecorder
from paraloom.inference.totals import Phases

__all__ = ["serve_batch", "serve_batch_guarded", "fail_requests", "fail_unfinished"]


def serve_batch(generation: Generation, slot: int, batch: Sequence[Request],
                stats: StatsRecorder, clock: Callable[[], float] = time.monotonic) -> None:
    """Run a batch on ``slot``'s replica and resolve every request's future (KeyboardInterrupt
    and the like fail the batch and propagate; ordinary exceptions never escape)."""
    start = clock()
    live = _claim(batch, start, stats)
    if not live:
        return
    try:
        if len(live) > 1 and not generation.rows_checked:  # claimed: deadlines still hold
            check_rows_first(generation, slot, live[0].spec, live[0].tensors)
            live = [r for r in live if not r.future.done()]  # those past it meanwhile
            if not live:
                return
        if len(live) > 1 and generation.unmergeable:
            for request in live:  # its outputs are not batch-first: one forward pass each
                _serve_claimed(generation, slot, [request], stats, clock(), clock)
            return
        _serve_claimed(generation, slot, live, stats, start, clock)
    except Exception:
        raise
    except BaseException:  # SystemExit, KeyboardInterrupt: fail what is left, then go on up
        failed = sum(_settle(r, InferenceError("the forward pass was interrupted"))
                     for r in live)
        stats.dropped("error", failed)
        raise


def _serve_claimed(generation: Generation, slot: int, live: Sequence[Request],
                   stats: StatsRecorder, start: float, clock: Callable[[], float]) -> None:
    rows, waits = sum(r.rows for r in live), [start - r.arrival for r in live]
    try:
        outputs, phases = _run(generation, slot, live, clock)
    except Exception as exc:  # noqa: BLE001 - the model's errors belong to the requests
        if isinstance(exc, UnsplittableOutputError):
            generation.refuse_merging(str(exc))
        _isolate(generation, slot, live, exc, stats, start, clock)
        stats.batch(rows, waits, clock() - start)
        return
    stats.batch(rows, waits, clock() - start)
    first = live[0]
    generation.accepted(first.key, first.spec, first.tensors)
    _deliver(generation.version, live, outputs, stats, start, phases, clock)


def serve_batch_guarded(generation: Generation, slot: int, batch: Sequence[Request],
                        stats: StatsRecorder) -> None:
    """serve_batch; an unexpected error fails the batch's unresolved requests, never escapes."""
    try:
        serve_batch(generation, slot, batch, stats)
    except Exception as exc:  # noqa: BLE001 - a bug here must not leave callers waiting
        fail_unfinished(batch, exc, stats)


def _claim(batch: Sequence[Request], now: float, stats: StatsRecorder) -> list[Request]:
    """Mark the requests running; drop the cancelled ones and fail the expired ones."""
    live: list[Request] = []
    cancelled = expired = 0
    for r in batch:
        if not r.future.set_running_or_notify_cancel():
            cancelled += 1
        elif r.deadline is not None and now > r.deadline:
            r.future.set_exception(RequestTimeoutError(
                f"the request waited {now - r.arrival:.3f} s for a worker, past its timeout; "
                "pass a longer timeout, add workers, or send fewer requests at once"))
            expired += 1
        else:
            live.append(r)
    if cancelled:
        stats.dropped("cancelled", cancelled)
    if expired:
        stats.dropped("timeout", expired)
    return live


def _run(generation: Generation, slot: int, requests: Sequence[Request],
         clock: Callable[[], float]) -> tuple[list[Any], Phases]:
    """One forward pass over the requests' rows; one output per request, on its own device,
    and the time of each phase (see ``paraloom.inference.totals``)."""
    began = clock()
    tensors = collate([r.tensors for r in requests], generation.devices[slot])
    collated = clock()
    output = generation.forward(slot, requests[0].spec, tensors)
    ran = clock()
    output = to_device(output, requests[0].tensors[0].device)  # one copy for the whole batch
    outputs = split_output(output, [r.rows for r in requests])
    return outputs, Phases(collated - began, ran - collated, clock() - ran)


def _deliver(version: int, requests: Sequence[Request], outputs: Sequence[Any],
             stats: StatsRecorder, start: float, phases: Phases,
             clock: Callable[[], float]) -> None:
    """Give each request its output (counted as completed before its caller can wake: a
    ``stats()`` read right after an answer counts it); one whose output cannot be converted
    gets an error. The totals of the forward pass that gave the outputs (its ``phases``; the
    batch began at ``start``) are recorded before any caller wakes too."""
    converting = clock()
    converted: list[tuple[Request, Any]] = []
    failed = 0
    for r, out in zip(requests, outputs, strict=True):
        try:
            converted.append((r, to_numpy(out) if r.numpy else out))
        except Exception as exc:  # noqa: BLE001 - this request's output, not the batch's
            failed += _settle(r, _unconvertible(version, exc))
    phases = phases.plus_output(clock() - converting)
    stats.totals.answered(version, sum(r.rows for r in requests),
                          sum(r.rows for r, _ in converted),
                          [start - r.arrival for r, _ in converted], phases)
    for r, out in converted:
        stats.finished(1)
        if not _settle(r, None, (out, version) if r.with_version else out):
            stats.finished(-1)  # settled meanwhile (its timeout), and counted there
            stats.totals.unanswered(version, r.rows, start - r.arrival, phases)
    if failed:
        stats.dropped("error", failed)


def _settle(r: Request, error: BaseException | None, value: object = None) -> bool:
    """Resolve r's future unless something else already did; True if this call resolved it."""
    try:
        if error is None:
            r.future.set_result(value)
        else:
            r.future.set_exception(error)
    except InvalidStateError:
        return False
    return True


def _unconvertible(version: int, exc: Exception) -> InferenceError:
    failure = InferenceError(
        f"model version {version} ran, but its output cannot be returned as numpy ({exc}). "
        "Expected an output of numpy-compatible dtypes for a request sent as numpy; make the "
        "model return e.g. float32 (.float() / .dequantize()), or send the input as a "
        "torch.Tensor to get tensors back")
    failure.__cause__ = exc
    return failure


def _isolate(generation: Generation, slot: int, live: Sequence[Request], exc: Exception,
             stats: StatsRecorder, start: float, clock: Callable[[], float]) -> None:
    """Re-run each request of a failed batch alone; fail only those that fail alone."""
    if len(live) == 1:
        results: list[tuple[Request, Any, Exception | None]] = [(live[0], None, exc)]
    else:
        results = [_run_alone(generation, slot, r, clock) for r in live]
    good = [(r, out) for r, out, err in results if err is None]
    if good:
        r = good[0][0]
        generation.accepted(r.key, r.spec, r.tensors)
    # Blame the request only where the model is known to work on some input.
    blame = bool(good) or generation.good_key is not None
    invalid = errors = 0
    for r, _, err in results:
        if err is not None:
            failure = _classify(generation, r, err, blame)
            if _settle(r, failure):  # else settled meanwhile (its timeout)
                invalid += isinstance(failure, InvalidRequestError)
                errors += not isinstance(failure, InvalidRequestError)
    if invalid:
        stats.dropped("invalid", invalid)
    if errors:
        stats.dropped("error", errors)
    for r, (out, phases) in good:  # each ran alone: a forward pass of its own
        _deliver(generation.version, [r], [out], stats, start, phases, clock)


def _run_alone(generation: Generation, slot: int, r: Request, clock: Callable[[], float]
               ) -> tuple[Request, tuple[Any, Phases] | None, Exception | None]:
    try:
        outputs, phases = _run(generation, slot, [r], clock)
        return r, (outputs[0], phases), None
    except Exception as exc:  # noqa: BLE001 - this request's own failure
        return r, None, exc


def _classify(generation: Generation, r: Request, exc: Exception, blame: bool) -> InferenceError:
    """The error a failed request gets: InvalidRequestError if it is the request's fault."""
    v = generation.version
    cause = f"{type(exc).__name__}: {exc}"
    if not blame or isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        fault = _dtype_fault(generation, r, cause) or (
            "so the model (or its device) is at fault, not only this request")
        failure: InferenceError = InferenceError(
            f"model version {v} failed ({cause}); it has not run any input successfully, "
            f"{fault}")
    else:
        received = describe_key(r.key)
        said, expected = _fault_of_the_request(generation, r.key, received)
        failure = InvalidRequestError(
            f"model version {v} failed on this request alone with {cause}. {said}",
            received=received, expected=expected)
    failure.__cause__ = exc
    return failure


def _fault_of_the_request(generation: Generation, key: Hashable, received: str
                          ) -> tuple[str, str | None]:
    """What is wrong with a request the model failed on alone, by the inputs it has run on:
    the same shapes and dtypes (its values), the same but for sizes (its values, or a size
    the model does not take), or others (its shape or dtype); and the input expected."""
    if key in generation.good_keys:
        return (f"Received {received}, as inputs it has run on, so the values are at fault "
                "(an index out of range?). Fix the request's values", received)
    kind, sizes = key_kind(key), key_sizes(key)
    alike = [k for k in generation.good_keys if key_kind(k) == kind]
    seen = [set(column) for column in zip(*map(key_sizes, alike), strict=True)]
    if alike and all(len(seen[d]) > 1 for d, size in enumerate(sizes)
                     if size not in seen[d]):  # new only in sizes the model has run on varied
        named = ", ".join(describe_key(k) for k in alike[-3:])
        return (f"Received {received}; the model has run on {named}, which differ from it "
                "in sizes that vary, so the values (an index out of range?) or a size the "
                "model does not take are at fault. Fix the request's values or shape",
                describe_key(alike[-1]))
    last = generation.good_key
    expected = describe_key(last) if last is not None else None
    wanted = (f"{expected} (the input it last ran on)" if expected else
              "an input the model accepts (none has run on this version yet)")
    return (f"Received {received}; expected {wanted}. Fix the request's shape, dtype or "
            "values", expected)


def _dtype_fault(generation: Generation, r: Request, cause: str) -> str | None:
    """Where a floating-point input is not in the model's floating-point dtype (a float64
    numpy array for a float32 model, the usual first mistake), or an integer input meets
    floating weights in an error that names dtypes (``[1, 2, 3]`` read as int64): that, and
    the fix."""
    want = next((p.dtype for p in generation.replicas[0].parameters()
                 if p.is_floating_point()), None)
    got = next((t.dtype for t in r.tensors if t.is_floating_point() and t.dtype != want), None)
    whole = got is None and "dtype" in cause and any(  # torch's error names the dtypes
        not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
        for t in r.tensors)
    if want is None or (got is None and not whole):
        return None
    need = str(want).removeprefix("torch.")
    numpy = "numpy has no bfloat16: send a tensor" if want == torch.bfloat16 else \
        f"numpy: x.astype(numpy.{need})"
    fix = f"send {need} ({numpy}; torch: x.to(torch.{need}))"
    if got is None:  # integers: token ids for an embedding, or numbers written without a point
        kind = next(str(t.dtype).removeprefix("torch.") for t in r.tensors
                    if not t.is_floating_point())
        return (f"and this input is {kind} where the model's weights are {need}: if it holds "
                f"numbers, not indices, {fix} (a list of whole numbers is read as int64: "
                "write 1.0, not 1)")
    have = str(got).removeprefix("torch.")
    return f"and this input is {have} where the model's weights are {need}: {fix}"


def fail_unfinished(batch: Sequence[Request], exc: Exception, stats: StatsRecorder) -> None:
    """Fail every request of a batch that is not resolved yet, after an unexpected error."""
    failed = 0
    for r in batch:
        if r.future.done():
            continue
        failure = InferenceError(
            f"serving this request's batch failed unexpectedly ({type(exc).__name__}: {exc}); "
            "this is a bug in the model's output handling or in paraloom; the worker keeps "
            "serving, so retry, and report it if it persists")
        failure.__cause__ = exc
        failed += _settle(r, failure)
    if failed:
        stats.dropped("error", failed)


def fail_requests(requests: Sequence[Request], error: type[InferenceError], message: str,
                  stats: StatsRecorder, reason: str) -> None:
    """Fail requests that will never run (closing, workers gone); skip the cancelled ones."""
    failed = 0
    for r in requests:
        if r.future.set_running_or_notify_cancel():
            r.future.set_exception(error(message))  # one instance each: raised on many threads
            failed += 1
    if failed:
        stats.dropped(reason, failed)
