"""Triton's logging extension: the server's log settings, read and changed over the API.

``GET /v2/logging`` and gRPC ``LogSettings`` (tritonclient's ``get_log_settings`` and
``update_log_settings``) read and change the settings of the records the server itself logs:
those of the loggers in ``SERVER_LOGGERS`` (paraloom's serving, uvicorn's errors and access
log). Python's logging is one per process, so the settings are too: ``SERVER_LOG`` holds them.

Nothing is touched until a client changes a setting; until then the settings describe what the
loggers' levels already let through (``paraloom serve --log-level``, or the levels a program
serving from Python set). A change installs a filter on those loggers (``ServerLog.reset``
takes it off again).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from paraloom.serving.errors import ForbiddenError, ProtocolError, listed, short_repr

__all__ = ["FORMATS", "SERVER_LOG", "SERVER_LOGGERS", "LogSettings", "ServerLog"]

SERVER_LOGGERS = ("paraloom.serving", "uvicorn.error", "uvicorn.access")
"""The loggers whose records the settings govern."""
FORMATS = ("default", "ISO8601")
"""``log_format``'s values: the server's own format, or each line led by its UTC time."""
_UINT32 = 1 << 32
_FILE_REFUSAL = ("the log file is chosen when the server starts (paraloom serve --log-file "
                 "PATH): a client may not choose a path the server writes to")


@dataclass(frozen=True)
class LogSettings:
    """Triton's six log settings, under their wire names.

    ``log_file``: where the records go ("": the console). ``log_info``, ``log_warnings``,
    ``log_errors``: whether records of that level are written. ``log_verbose_level``: 0 writes
    no debug records, 1 or more writes them (one per request answered or refused, among
    others). ``log_format``: one of ``FORMATS``.
    """

    log_file: str = ""
    log_info: bool = True
    log_warnings: bool = True
    log_errors: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def as_wire(self) -> dict[str, str | bool | int]:
        """The settings as the protocol's name/value pairs."""
        return dataclasses.asdict(self)

    def changed(self, changes: Mapping[str, object]) -> LogSettings:
        """These settings with ``changes`` (wire names to values) applied.

        Raises ``ProtocolError`` for an unknown name or a value of the wrong type or range,
        and ``ForbiddenError`` for a ``log_file`` other than the one in force.
        """
        known = {f.name: f.type for f in dataclasses.fields(self)}
        unknown = [name for name in changes if name not in known]
        if unknown:
            raise ProtocolError(f"unknown log settings {listed(unknown)}; the settings are "
                                f"{listed(known)}")
        for name, value in changes.items():
            _check(name, value)
        if changes.get("log_file", self.log_file) != self.log_file:
            raise ForbiddenError(_FILE_REFUSAL)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check(name: str, value: object) -> None:
    if name in ("log_info", "log_warnings", "log_errors"):
        if not isinstance(value, bool):
            raise ProtocolError(f"log setting {name}={short_repr(value)}; expected true or "
                                "false")
    elif name == "log_verbose_level":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _UINT32:
            raise ProtocolError(f"log setting {name}={short_repr(value)}; expected a whole "
                                "number >= 0 (0: no verbose records)")
    elif name == "log_format":
        if value not in FORMATS:
            raise ProtocolError(f"log setting {name}={short_repr(value)}; expected one of "
                                f"{list(FORMATS)}")
    elif not isinstance(value, str):  # log_file
        raise ProtocolError(f"log setting {name}={short_repr(value)}; expected a string")


class _Gate(logging.Filter):
    """Lets through the records of the levels the settings write."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        s = self.settings
        if record.levelno >= logging.ERROR:
            return s.log_errors
        if record.levelno >= logging.WARNING:
            return s.log_warnings
        if record.levelno >= logging.INFO:
            return s.log_info
        return s.log_verbose_level > 0


class _Iso8601(logging.Formatter):
    """``2026-12-07T00:03:37.123Z INFO: message``: the record's UTC time first."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None  # noqa: N802
                   ) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
            f".{int(record.msecs):03d}Z"


class ServerLog:
    """The log settings in force in this process, and the loggers they are applied to.

    ``owned``: the handlers whose format ``log_format`` sets (``paraloom serve`` registers
    its own with ``own``); a program serving from Python keeps its handlers' formatters, and a
    change of ``log_format`` there is refused. ``refuse_changes``: when set, every change is
    refused with it (each process of ``--processes N`` would change only itself).
    """

    def __init__(self) -> None:
        self.file = ""
        self.refuse_changes: str | None = None
        self._gate: _Gate | None = None
        self._owned: dict[logging.Handler, logging.Formatter | None] = {}
        self._levels: dict[str, int] = {}

    def own(self, handler: logging.Handler) -> None:
        """Let ``log_format`` set ``handler``'s formatter (its own is kept for "default")."""
        self._owned.setdefault(handler, handler.formatter)

    def settings(self) -> LogSettings:
        """The settings in force: the last change, or what the loggers' levels let through."""
        if self._gate is not None:
            return self._gate.settings
        first = logging.getLogger(SERVER_LOGGERS[0])
        return LogSettings(log_file=self.file, log_info=first.isEnabledFor(logging.INFO),
                           log_warnings=first.isEnabledFor(logging.WARNING),
                           log_errors=first.isEnabledFor(logging.ERROR),
                           log_verbose_level=int(first.isEnabledFor(logging.DEBUG)))

    def update(self, changes: Mapping[str, object]) -> LogSettings:
        """Apply ``changes`` (wire names to values; a None value changes nothing); returns
        every setting now in force.

        Raises ``ForbiddenError`` when changes are refused here, or for ``log_format`` where
        the server owns no handler; otherwise as ``LogSettings.changed``.
        """
        changes = {name: value for name, value in changes.items() if value is not None}
        if not changes:  # gRPC reads the settings with an empty change
            return self.settings()
        if self.refuse_changes is not None:
            raise ForbiddenError(self.refuse_changes)
        new = self.settings().changed(changes)
        if new.log_format != "default" and not self._owned:
            raise ForbiddenError("log_format is set on the handlers paraloom serve installs; "
                                 "serving from Python, your logging configuration's "
                                 "formatters decide the format")
        self._apply(new)
        return new

    def reset(self) -> None:
        """Take the filter off, give the loggers their levels and the handlers their
        formatters back: as before the first change."""
        for name in SERVER_LOGGERS:
            logger = logging.getLogger(name)
            if self._gate is not None:
                logger.removeFilter(self._gate)
            if name in self._levels:
                logger.setLevel(self._levels[name])
        for handler, formatter in self._owned.items():
            handler.setFormatter(formatter)
        self._gate, self._levels = None, {}

    def _apply(self, new: LogSettings) -> None:
        if self._gate is None:
            self._gate = _Gate(new)
            for name in SERVER_LOGGERS:
                logger = logging.getLogger(name)
                self._levels[name] = logger.level
                logger.addFilter(self._gate)
        self._gate.settings = new
        lowest = logging.DEBUG if new.log_verbose_level else logging.INFO
        for name in SERVER_LOGGERS:  # the gate decides; the level must not stop a record first
            logging.getLogger(name).setLevel(lowest)
        for handler, formatter in self._owned.items():
            handler.setFormatter(formatter if new.log_format == "default" else _Iso8601())


SERVER_LOG = ServerLog()
"""This process's log settings (``paraloom serve`` and every app serve the same ones)."""
