"""``warn``: a warning that points at the user's line, however deep in paraloom it is raised."""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn"]


_PASSED = frozenset({"paraloom", "dataclasses"})
"""Modules whose frames are passed over: paraloom's, and ``dataclasses.replace`` (options
rebuilt with a keyword run their checks from it)."""


def _stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside paraloom, counted from ``warn``'s caller."""
    level, frame = 1, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] \
            in _PASSED:
        level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the nearest frame outside paraloom, so
    that a warning raised three calls deep names the user's ``ParallelWrapper(...)`` line."""
    warnings.warn(message, category, stacklevel=_stacklevel() + 1)
