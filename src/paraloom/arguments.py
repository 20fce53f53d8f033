"""argparse types of the command line's options: a count or a duration that cannot run is refused
by the option's name, with what it expects, before anything is loaded or measured (``argparse``
then exits with 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

__all__ = ["count", "count_list", "names", "positive", "seconds", "wait", "whole"]


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an int" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def count(text: str) -> int:
    """An int >= 1 (workers, clients, requests, rows, epochs, ...)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not an int >= 1")
    return value


def whole(text: str) -> int:
    """An int >= 0 (loader processes, spares, a seed)."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an int >= 0")
    return value


def seconds(text: str) -> float:
    """A duration > 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a duration > 0")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (a size in MiB, an interval in ms)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number > 0")
    return value


def wait(text: str) -> float:
    """A duration >= 0 (0: none)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a duration >= 0")
    return value


def count_list(text: str) -> str:
    """Comma-separated ints >= 1 (``1,16,64``); the text is kept as given."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} names no number; expected e.g. 1,16,64")
    for part in parts:
        count(part)
    return text


def names(allowed: Iterable[str]) -> Callable[[str], str]:
    """Comma-separated names, each one of ``allowed``; the text is kept as given."""
    known = sorted(allowed)

    def parse(text: str) -> str:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [p for p in parts if p not in known]
        if unknown or not parts:
            raise argparse.ArgumentTypeError(
                f"{unknown or text!r}: expected comma-separated names of {known}")
        return text

    parse.__name__ = "names"  # what argparse calls the type in its messages
    return parse
