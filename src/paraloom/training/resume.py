"""Training checkpoints for exact resume: every replica's full state plus the data position.

A checkpoint file is safetensors: the tensors, and one JSON header that holds the structure
(optimizer state, synchronizer state, counters) with references to the tensors. Loading never
unpickles anything.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from paraloom.listeners import TrainingListener, iteration_of, run_of
from paraloom.safetensors_files import (
    TRAINING_HEADER_KEY,
    atomic_write,
    check_safetensors,
    check_storable,
)
from paraloom.sync.averaging import trained_share
from paraloom.sync.sharing.view import local_views
from paraloom.training.messages import CheckpointReply, CheckpointRequest, ReplicaState
from paraloom.training.packing import unpack_tensors
from paraloom.training.pool import Pool

__all__ = ["CheckpointCollector", "Start", "TrainingCheckpoint", "latest_checkpoint"]

_FORMAT = 1


def _flatten(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able copy of ``obj`` whose tensors are moved into ``tensors``."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
        # A sparse embedding's gradient, part way through an accumulation: its entries as
        # they are (not coalesced: the optimizer adds duplicates as it would have).
        sparse = obj.detach().cpu()
        return {"__sparse__": [_flatten(sparse._indices(), f"{key}.indices", tensors),
                               _flatten(sparse._values(), f"{key}.values", tensors),
                               list(sparse.shape), sparse.is_coalesced()]}
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise TypeError(f"cannot store a {obj.layout} tensor at {key} in a checkpoint: only "
                            "dense and sparse COO tensors are stored")
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_flatten(k, f"{key}.k{i}", tensors),
                              _flatten(v, f"{key}.{i}", tensors)]
                             for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} at {key} in a checkpoint: only "
                    "tensors, numbers, strings, lists, tuples and dicts are stored")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__sparse__" in obj:
            indices, values, size, coalesced = obj["__sparse__"]
            return torch.sparse_coo_tensor(_unflatten(indices, tensors),
                                           _unflatten(values, tensors), size,
                                           is_coalesced=coalesced)
        if "__dict__" in obj:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        raise ValueError(f"malformed checkpoint entry {list(obj)[:3]}")
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def _copied(value: Any) -> Any:
    """A tensor's clone; a module's extra state (JSON values) copied."""
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _mean(tensors: list[torch.Tensor], shares: list[float] | None) -> torch.Tensor:
    """The mean of ``tensors``, weighted by ``shares`` when given."""
    stacked = torch.stack(tensors)
    if shares is None:
        return stacked.mean(0)
    weights = torch.tensor(shares, dtype=torch.float64).to(
        stacked.real.dtype if stacked.is_complex() else stacked.dtype)
    return (stacked * weights.view(-1, *[1] * (stacked.dim() - 1))).sum(0) / weights.sum()


def _checkpoint_path(path: str | Path) -> Path:
    """The checkpoint file ``path`` names (a directory: its latest); ``FileNotFoundError``
    where there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {str(path)!r}")
        path = found
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    check_safetensors(path)
    return path


def _header(path: Path, meta: dict[str, str]) -> dict[str, Any]:
    """The training header in a checkpoint's metadata; ``ValueError`` where it has none, of
    another format, or one that does not parse."""
    if TRAINING_HEADER_KEY not in meta:
        raise ValueError(f"{path} is not a paraloom training checkpoint (a model saved "
                         "with paraloom.save is loaded with paraloom.load instead)")
    try:
        header = json.loads(meta[TRAINING_HEADER_KEY])
    except (json.JSONDecodeError, RecursionError) as e:
        raise _corrupt_header(path, e) from e
    if not isinstance(header, dict):
        raise _corrupt_header(path, TypeError(f"its header is a {type(header).__name__}"))
    if header.get("format") != _FORMAT:
        raise ValueError(f"{path} has checkpoint format {header.get('format')}; this "
                         f"paraloom reads format {_FORMAT}")
    return header


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable checkpoint ({error}): it is truncated or "
                      "corrupt; resume from an earlier one")


def _corrupt_header(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} has a corrupt checkpoint header ({type(error).__name__}: "
                      f"{error}): it was changed or not written by paraloom; resume from "
                      "another checkpoint")


@dataclass
class Start:
    """Where a fit() starts: an epoch, batches of it already trained, and the data RNG, with
    each replica's state when it resumes from a checkpoint."""

    epoch: int = 0
    batch: int = 0
    data_rng: list[torch.Tensor] | None = None
    replicas: list[ReplicaState | None] | None = None

    def epoch_done(self, per_epoch: int | None) -> bool:
        """Whether the start epoch was trained to its end (a checkpoint written at an epoch's
        end), given the batches an epoch has (None: unknown, a stream)."""
        return per_epoch is not None and 0 < per_epoch <= self.batch

    def taking_shared_rng(self, workers: int, per_epoch: int | None
                          ) -> tuple[list[ReplicaState | None] | None, torch.Tensor | None]:
        """The replica states to begin from, and the torch RNG state the next epoch starts
        from where this process must set it (else None).

        One worker trains in this process on the caller's RNG, and puts a checkpoint's RNG
        back at its first round. From a checkpoint written at an epoch's end, that round
        comes after the next epoch's data has drawn (its loader's seed, its shuffle), which
        the uninterrupted run drew from that RNG: so the fit sets it before those draws, and
        the replica is given its state without it.
        """
        replicas = self.replicas
        if workers != 1 or not replicas or not self.epoch_done(per_epoch) or \
                not isinstance(replicas[0], dict) or "rng" not in replicas[0]:
            return replicas, None
        state = dict(replicas[0])
        return [state], state.pop("rng")


@dataclass
class TrainingCheckpoint:
    """Where training stood after a round, and every replica's state at that point."""

    fingerprint: dict[str, Any]
    """What the checkpoint belongs to: model parameters, workers, training mode, precision."""
    epoch: int
    """The epoch in progress; ``batch`` of its batches had been dealt."""
    batch: int
    iteration: int
    """Rounds completed across fit() calls."""
    data_rng: list[torch.Tensor]
    """At the start of ``epoch``: the parent's torch RNG state, then the states of the data
    source's own generators (``DataLoader(generator=...)``): they fix the shuffle order."""
    replicas: list[ReplicaState | None]
    """Per rank, ``Replica.full_state()``: all of them in a saved or loaded checkpoint."""
    run: str = ""
    """The run it belongs to: a wrapper's own id, kept by the runs resumed from it ("" for
    checkpoints written before runs had ids)."""
    trainer_state: dict[str, Any] = field(default_factory=dict)
    """What drives the wrapper's fits, as it stood when the checkpoint was written (JSON
    values): ``EarlyStoppingParallelTrainer``'s epoch and scores so far, under
    ``"early_stopping"``; empty for a plain ``fit()``."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's weights at this point, a ``state_dict`` for ``load_state_dict``: each
        floating tensor averaged over the replicas, the others (BatchNorm's
        ``num_batches_tracked``) replica 0's.

        With ``allreduce`` that is every replica's model, with replica 0's buffers (BatchNorm's
        running statistics), as DDP broadcasts them before each forward and ``fit()`` returns
        them; with ``averaging`` what the next averaging gives (between averagings each
        replica holds its own weights, so one replica's are not the model); with
        ``shared_gradients`` what ``fit()`` would return: the mean of the replicas' local views
        (the shared parameters plus each replica's updates not sent yet; with
        ``overlap`` and ``combine="sum"`` the step in flight counts as the replicas' mean where
        ``fit()`` adds their sum; with ``gradients_at="shared"``, or from a checkpoint older than
        the local views' names, the shared parameters alone); with DiLoCo the mean of the
        replicas' inner weights, not the next outer step.
        """
        states = [r["model"] for r in self.replicas if r is not None]
        if not states:
            raise ValueError("this checkpoint holds no replica state")
        if self.fingerprint.get("training_mode") == "allreduce":
            # Identical parameters, and DDP's buffers are rank 0's (the next forward's
            # broadcast overwrites the others' statistics): the mean would be a model no
            # replica holds (0.04 off in a BatchNorm's running mean).
            return {key: _copied(value) for key, value in states[0].items()}
        shares = self._shares() if self.fingerprint.get("training_mode") == "averaging" \
            else None
        views = local_views([r.get("sync", {}) for r in self.replicas if r is not None]) \
            if self.fingerprint.get("training_mode") == "shared_gradients" else {}
        return {key: _mean(views.get(key) or [s[key] for s in states], shares).to(value.dtype)
                if isinstance(value, torch.Tensor) and (value.is_floating_point()
                                                        or value.is_complex())
                else _copied(value) for key, value in states[0].items()}

    def _shares(self) -> list[float] | None:
        """Per replica, the share of the rounds since the last averaging that it trained
        (``Averaging`` weights its mean by them); None where every replica trained them all
        (or the checkpoint predates the counters)."""
        found = [trained_share(r.get("sync", {})) for r in self.replicas if r is not None]
        shares = [s for s in found if s is not None]
        if len(shares) < len(found) or min(shares) == 1 or max(shares) == 0:
            return None
        return shares

    def save(self, path: str | Path) -> Path:
        """Write atomically (temporary file + rename): a crash leaves the old file intact."""
        tensors: dict[str, torch.Tensor] = {}
        header = {"format": _FORMAT, "fingerprint": self.fingerprint, "epoch": self.epoch,
                  "batch": self.batch, "iteration": self.iteration, "run": self.run,
                  "trainer_state": self.trainer_state,
                  "data_rng": _flatten(self.data_rng, "data_rng", tensors),
                  "replicas": _flatten(self.replicas, "replicas", tensors)}
        metadata = {TRAINING_HEADER_KEY: json.dumps(header)}
        check_storable(tensors, "TrainingCheckpoint.save")
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    @classmethod
    def load(cls, path: str | Path) -> TrainingCheckpoint:
        """Read a checkpoint written by ``save`` (a directory means its latest checkpoint)."""
        path = _checkpoint_path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # safetensors' own error type: a corrupt or truncated file
            raise _unreadable(path, e) from e
        header = _header(path, meta)
        try:
            return cls(fingerprint=header["fingerprint"], epoch=header["epoch"],
                       batch=header["batch"], iteration=header["iteration"],
                       data_rng=_unflatten(header["data_rng"], tensors),
                       replicas=_unflatten(header["replicas"], tensors),
                       run=str(header.get("run", "")),
                       trainer_state=dict(header.get("trainer_state") or {}))
        except (TypeError, KeyError, AttributeError) as e:
            raise _corrupt_header(path, e) from e

    @staticmethod
    def read_trainer_state(path: str | Path) -> dict[str, Any]:
        """The ``trainer_state`` of the checkpoint ``load`` would read, from its header alone
        (its tensors, every replica's state, are not read)."""
        path = _checkpoint_path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # safetensors' own error type: a corrupt or truncated file
            raise _unreadable(path, e) from e
        header = _header(path, meta)
        try:
            return dict(header.get("trainer_state") or {})
        except (TypeError, ValueError) as e:  # not a mapping
            raise _corrupt_header(path, e) from e

    @staticmethod
    def _value(fingerprint: dict[str, Any], key: str) -> Any:
        return fingerprint.get(key, _ABSENT_MEANS.get(key))

    def check(self, fingerprint: dict[str, Any], path: Any = "the checkpoint") -> None:
        """Refuse a checkpoint written for another model or configuration."""
        diffs = []
        for k in [*fingerprint, *(k for k in self.fingerprint if k not in fingerprint)]:
            if k in _COMPARED_WHEN_KNOWN and (k not in self.fingerprint or k not in fingerprint):
                continue  # an older checkpoint, or a factory's optimizer not built yet
            written, now = self._value(self.fingerprint, k), self._value(fingerprint, k)
            if written != now:
                diffs.append(f"{k}: checkpoint has {written!r}, this run has {now!r}")
        if diffs:
            shown = "; ".join(d if len(d) < 300 else d[:300] + "..." for d in diffs)
            raise ValueError(
                f"{path} was written for another model or configuration ({shown}). Resume with "
                "the same model, optimizer class and param groups, workers, training mode, "
                "precision and data (its batches per epoch: the same dataset and batch size), "
                "or train without resume_from (to change any of them, start from "
                "the checkpoint's weights: model.load_state_dict(paraloom.TrainingCheckpoint"
                f".load({str(path)!r}).model_state()))")

    def check_schedule(self, scheduled: bool, path: Any = "the checkpoint") -> None:
        """Refuse a checkpoint of a run with an ``lr_scheduler`` resumed without one, or the
        other way round: the schedule would be dropped, or start again at its first step, and
        the resumed run would no longer be the one that stopped."""
        held = any(r is not None and "scheduler" in r for r in self.replicas)
        if held != scheduled:
            raise ValueError(
                f"{path} was written by a run {'with' if held else 'without'} an lr_scheduler, "
                f"and this run has {'none' if held else 'one'}: resuming would "
                f"{'drop the schedule' if held else 'start a schedule at its first step'}. "
                f"Resume with {'the same lr_scheduler' if held else 'no lr_scheduler'}, or "
                "start a fresh run from the checkpoint's weights (model.load_state_dict("
                f"paraloom.TrainingCheckpoint.load({str(path)!r}).model_state()))")


_COMPARED_WHEN_KNOWN = frozenset({"optimizer", "optimizer_param_groups", "batches_per_epoch"})
"""Fingerprint keys that older checkpoints (or a run whose optimizer is a factory, or data
without a length) lack."""
_ABSENT_MEANS = {"accumulate": 1}  # a fingerprint leaves a key out at its default


@dataclass
class _Pending:
    listeners: list[TrainingListener]
    checkpoint: TrainingCheckpoint
    done: bool = False
    stale: set[int] = field(default_factory=set)
    """Ranks whose next reply answers a request made before the state changed (``renew``)."""


class CheckpointCollector:
    """Asks the workers for their state after a round and assembles the checkpoint."""

    def __init__(self, listeners: list[TrainingListener],
                 fingerprint: Callable[[], dict[str, Any]], workers: int) -> None:
        self.listeners, self.fingerprint, self.workers = listeners, fingerprint, workers
        self.pending: dict[int, _Pending] = {}
        self.last: int | None = None
        self.run = uuid.uuid4().hex  # this wrapper's run; a resume takes the checkpoint's
        self.trainer_state: dict[str, Any] = {}
        """Written into every checkpoint (``TrainingCheckpoint.trainer_state``)."""

    def reset(self) -> None:
        """Forget the previous fit()'s checkpoints."""
        self.pending = {}
        self.last = None

    def cut(self, last: int) -> None:
        """stop() halted the fit after iteration ``last``: later checkpoints would claim rounds
        that were never trained, so they are dropped."""
        self.last = last

    def wanting(self, iteration: int, epoch: int, epoch_end: bool) -> list[TrainingListener]:
        """The listeners that want a checkpoint after round ``iteration`` (asked once per
        round: pass the answer to ``request``)."""
        return [x for x in self.listeners if x.wants_checkpoint(iteration, epoch, epoch_end)]

    def request(self, pool: Pool, iteration: int, epoch: int, dealt: int,
                epoch_rng: list[torch.Tensor], epoch_end: bool,
                next_epoch_rng: list[torch.Tensor] | None = None,
                wanting: list[TrainingListener] | None = None, renew: bool = False) -> None:
        """Ask every replica for its state after round ``iteration`` if a listener wants a
        checkpoint there (``wanting``: those ``self.wanting`` named, when already asked).
        ``next_epoch_rng`` (at an epoch's end): the checkpoint resumes at the start of the
        next epoch, with that data RNG, instead of past ``dealt`` batches of this one (a
        stream cannot tell that nothing is left of it without a round). ``renew``: the
        replicas' state changed since the round (the epoch's closing step with ``accumulate``),
        so a checkpoint already asked for after it is taken again, for all its listeners."""
        if wanting is None:
            wanting = self.wanting(iteration, epoch, epoch_end)
        resume_at = (epoch, dealt, epoch_rng) if next_epoch_rng is None \
            else (epoch + 1, 0, next_epoch_rng)
        known = self.pending.get(iteration)
        if known is not None and renew:
            self._renew(pool, iteration, known)
        if known is not None and next_epoch_rng is not None and not known.done:
            ckpt = known.checkpoint
            ckpt.epoch, ckpt.batch, ckpt.data_rng = resume_at
        if known is not None:  # asked for twice (e.g. every N iterations and at epoch end)
            late = [x for x in wanting if x not in known.listeners]
            known.listeners += late
            if known.done:
                for listener in late:
                    listener.on_checkpoint(known.checkpoint)
            return
        if not wanting:
            return
        at_epoch, at_batch, data_rng = resume_at
        self.pending[iteration] = _Pending(wanting, TrainingCheckpoint(
            fingerprint=self.fingerprint(), epoch=at_epoch, batch=at_batch,
            iteration=iteration + 1, data_rng=data_rng, replicas=[None] * self.workers,
            run=self.run, trainer_state=copy.deepcopy(self.trainer_state)))
        for rank in range(self.workers):
            pool.send(rank, CheckpointRequest(iteration))

    def _renew(self, pool: Pool, iteration: int, known: _Pending) -> None:
        """Ask again for a checkpoint whose replies (some perhaps still coming) hold a state
        that has changed since: those are dropped, and the new ones complete it."""
        replicas = known.checkpoint.replicas
        known.stale = set() if known.done else {r for r, s in enumerate(replicas) if s is None}
        known.checkpoint.replicas = [None] * self.workers
        known.done = False
        for rank in range(self.workers):
            pool.send(rank, CheckpointRequest(iteration))

    def receive(self, reply: CheckpointReply) -> None:
        """One replica's state; hands the checkpoint to its listeners once all are in."""
        pending = self.pending.get(reply.tag)
        if pending is None or (self.last is not None and reply.tag > self.last):
            return  # superseded by a newer checkpoint, or past a stop()
        if reply.rank in pending.stale:  # asked for again: the next reply is the one
            pending.stale.discard(reply.rank)
            return
        pending.checkpoint.replicas[reply.rank] = unpack_tensors(reply.state)
        if any(r is None for r in pending.checkpoint.replicas):
            return
        pending.done = True
        for old in [t for t, p in self.pending.items() if p.done and t < reply.tag]:
            del self.pending[old]  # only the newest may still be asked for again
        for listener in pending.listeners:
            listener.on_checkpoint(pending.checkpoint)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` (as CheckpointListener names them): of the run
    that wrote the last file, its highest iteration. A directory reused by a fresh run still
    holds the old run's files, of higher iterations; a copied one has new times, one run."""
    files = list(Path(directory).glob("*-iter*.safetensors"))
    if not files:
        return None
    run = run_of(max(files, key=lambda p: (_written_at(p), iteration_of(p))))
    return max((p for p in files if run_of(p) == run),
               key=lambda p: (iteration_of(p), _written_at(p)))


def _written_at(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # removed meanwhile (another run's keep_last)
        return -1
