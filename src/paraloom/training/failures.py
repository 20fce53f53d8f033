"""How a replica's failure becomes a ``WorkerError`` that names the worker, round and cause."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

from paraloom.errors import WorkerError
from paraloom.training.inbox import Inbox
from paraloom.training.messages import Failed

__all__ = ["collect_errors", "failure_error", "death_message", "last_round", "is_symptom",
           "next_failure", "frozen", "process_state", "silently_dead", "stop_pending", "SYMPTOMS"]

# Errors that are a symptom of a peer's failure, not a cause: report another one if any.
SYMPTOMS = ("Connection closed by peer", "Connection reset", "Connection refused",
            "ECONNREFUSED", "by peer", "Broken pipe", "timed out", "Timeout", "Gloo", "NCCL",
            "a peer failed", "Read error", "Write error", "DistBackendError",
            "DistNetworkError", "DistStoreError", "parent process exited")


def failure_error(failed: Failed, starting: bool = False) -> WorkerError:
    """The ``WorkerError`` for a replica's ``Failed`` reply."""
    where = f" on round {failed.round_id}" if failed.round_id is not None else ""
    hint = " while starting" if starting else ""
    return WorkerError(f"worker {failed.rank} failed{hint}{where}: {failed.message}",
                       worker=failed.rank, batch=failed.round_id,
                       remote_traceback=failed.traceback, remote_type=failed.kind)


def is_symptom(message: str) -> bool:
    """Whether an error message reads as a peer's failure seen from this side."""
    lowered = message.lower()
    return any(s.lower() in lowered for s in SYMPTOMS)


_STATES = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped",
           "t": "stopped by a debugger", "Z": "exited", "X": "dead"}


def process_state(pid: int | None) -> str:
    """What the OS says a process is doing ("stopped", "running", ...), from /proc if there.

    "running" when any of its threads runs or waits for a CPU: a worker whose main thread
    just left native code that held the GIL sleeps in a collective while its heartbeat thread
    waits for a CPU to beat again (seen on a loaded 2-core machine); it is alive."""
    main = _thread_state(f"/proc/{pid}/stat")
    if main is None:
        return "unknown"
    if main not in ("T", "t", "Z", "X"):  # a stop or an exit holds for every thread
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tasks = []
        if any(_thread_state(f"/proc/{pid}/task/{tid}/stat") == "R" for tid in tasks):
            main = "R"
    return _STATES.get(main, main)


_NOT_TRAINING = ("stopped", "stopped by a debugger", "exited", "dead")
"""Process states (``process_state``) of a worker that cannot take the next fit's work."""


def frozen(pid: int | None) -> bool:
    """Whether the process ``pid`` is stopped, exiting, or has a SIGKILL or SIGSTOP pending:
    it cannot answer (nor take work), whatever ``is_alive()`` says yet."""
    return process_state(pid) in _NOT_TRAINING or stop_pending(pid)


def stop_pending(pid: int | None) -> bool:
    """Whether a SIGKILL or SIGSTOP was sent to ``pid`` and has not taken effect yet (the
    kernel acts on it when the process next runs: a few milliseconds on a busy machine, while
    ``process_state`` still says it runs); False where /proc cannot say."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f
                     if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return False
    wanted = (1 << (signal.SIGKILL - 1)) | (1 << (signal.SIGSTOP - 1))
    return any(mask & wanted for mask in masks)


def _thread_state(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def silently_dead(procs: Sequence[BaseProcess], reported: set[int],
                  within_s: float = 2.0) -> int | None:
    """The rank of a worker that died without reporting an error (e.g. SIGKILL), if any
    does within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for rank, p in enumerate(procs):
            if rank not in reported and p.exitcode is not None:
                return rank
        time.sleep(0.05)
    return None


def death_message(rank: int, pid: int | None, code: int | None, starting: bool,
                  others_stopped: bool = True, round_id: int | None = None) -> str:
    """'worker R (pid P) was killed by SIGKILL; ...' for a worker that died without a report
    (``round_id``: the last round it started, named if given)."""
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how = f"was killed by {signal.Signals(-code).name}"
    msg = f"worker {rank} (pid {pid}) {how}{last_round(round_id)}"
    if code == -signal.SIGABRT and not starting:
        msg += (" (a C++ check failed; its message is in the worker's stderr above. In a "
                "collective, that is most often tensors of different sizes on different "
                "workers: a buffer whose shape depends on the batch, such as a cache of the "
                "last output, must have the same shape on every replica)")
    if starting:
        msg += (" while starting; its stderr above says why (out of memory? an import that "
                "fails in a fresh process? then define the model at module level)")
    return msg + ("; the other workers were stopped" if others_stopped else "")


def last_round(round_id: int | None) -> str:
    """' (the last round it started: 12)' for an error about a worker, or '' before any."""
    return "" if round_id is None else f" (the last round it started: {round_id})"


def next_failure(inbox: Inbox, within_s: float,
                 salvage: Callable[[object], None]) -> Failed | None:
    """The first failure report among the replies of the next ``within_s`` seconds (the fit
    is ending in an error: the other replies go to ``salvage``, which keeps what it wants)."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = inbox.get(left)
        except queue.Empty:
            return None
        except (OSError, EOFError):
            # A reply whose tensors lived in the worker that has exited: dropped, as the
            # others are; the report may come behind it.
            continue
        if isinstance(reply, Failed):
            return reply
        salvage(reply)
    return None


def collect_errors(first: Failed, procs: Sequence[BaseProcess],
                   next_report: Callable[[float], Failed | None]) -> list[Failed]:
    """The first error, when it is a cause itself; else it and any others that follow within
    half a second (``next_report(seconds)``), less once every worker has reported or exited (a
    killed worker reports nothing, and one that exits after reporting has its report queued
    already)."""
    errors = [first]
    if not is_symptom(first.message):
        return errors  # the cause itself (the others' reports are symptoms of it)
    deadline = time.monotonic() + 0.5
    while (now := time.monotonic()) < deadline:
        silent = set(range(len(procs))) - {f.rank for f in errors}
        if not silent:
            break
        codes = [procs[rank].exitcode for rank in silent]
        if all(code is not None and code < 0 for code in codes):
            break  # killed by a signal: they report nothing
        if all(code is not None for code in codes):
            # What an exited worker reported is in the pipe already.
            deadline = min(deadline, now + 0.02)
        # Other replies are salvaged or, unreadable once their worker exited, dropped.
        report = next_report(min(0.05, deadline - time.monotonic()))
        if report is not None:
            errors.append(report)
    return errors
