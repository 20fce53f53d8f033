"""How a replica's failure becomes a ``WorkerError`` that names the worker, round and cause."""

from __future__ import annotations

import contextlib
import signal

from paraloom.errors import WorkerError
from paraloom.training.messages import Failed

__all__ = ["failure_error", "death_message", "is_symptom", "process_state", "SYMPTOMS"]

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
    """What the OS says a process is doing ("stopped", "running", ...), from /proc if there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return _STATES.get(code, code)


def death_message(rank: int, pid: int | None, code: int | None, starting: bool) -> str:
    """'worker R (pid P) was killed by SIGKILL; ...' for a worker that died without a report."""
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how = f"was killed by {signal.Signals(-code).name}"
    msg = f"worker {rank} (pid {pid}) {how}"
    if starting:
        msg += (" while starting; its stderr above says why (out of memory? an import that "
                "fails in a fresh process? then define the model at module level)")
    return msg + "; the other workers were stopped"
