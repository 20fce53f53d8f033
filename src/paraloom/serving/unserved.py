"""Triton endpoints this server does not serve, and what to use instead.

A Triton client calls them (``get_trace_settings``): the answer says which extension it is,
not only that the route is unknown. HTTP answers
404, gRPC ``UNIMPLEMENTED``; the server's metadata (``GET /v2``) lists what is served.
"""

from __future__ import annotations

import re

__all__ = ["UNSERVED_METHODS", "unserved_path"]

_TRACE = "Triton's trace extension is not served here"

UNSERVED_METHODS = {"TraceSetting": _TRACE}
"""gRPC methods of ``inference.GRPCInferenceService`` that are not served, with the reason."""

_PATHS = [(re.compile(r"/v2(/models/[^/]+)?/trace/setting"), _TRACE)]


def unserved_path(path: str) -> str | None:
    """Why an HTTP path of Triton's is not served here (None: not one of those)."""
    return next((why for pattern, why in _PATHS if pattern.fullmatch(path)), None)
