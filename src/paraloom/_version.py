"""The package version, in a module of its own: importing it loads nothing else of paraloom.

Read from the installed distribution's metadata (pyproject.toml is its one source); a source tree
that is not installed reports the version below.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("paraloom")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.1.0"
