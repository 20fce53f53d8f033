"""Reading a request body within a size limit, including gzip/deflate bodies (no zip bombs)."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from paraloom.serving.errors import ClientGoneError, PayloadTooLargeError, ProtocolError

__all__ = ["BodyTooLarge", "inflate", "read_body"]

# zlib's wbits: 16+ reads a gzip wrapper, a plain value reads a zlib stream ("deflate" in HTTP).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(size: int | str, limit: int, what: str = "request body") -> PayloadTooLargeError:
    return PayloadTooLargeError(f"{what} of {size} bytes is over this server's limit of {limit} "
                                "bytes; send fewer rows per request, or raise the limit "
                                "(paraloom serve --max-body-mb, create_app(max_body_bytes=))")


def _check_declared(declared: str | None, limit: int) -> None:
    if declared is not None:
        if not declared.isdigit():
            raise ProtocolError(f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise _too_large(declared, limit)


async def _join(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    parts, size = [], 0
    try:
        async for chunk in chunks:  # a chunked body has no Content-Length to trust
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit}", limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise ClientGoneError("the client disconnected before it sent the whole body") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


class BodyTooLarge(Exception):
    """``inflate``: the data decompresses to more than the limit."""


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` decompressed (``encoding``: "gzip" or "deflate", a zlib stream), never past
    ``limit`` bytes (``BodyTooLarge``). ``ValueError`` for data that is not one whole stream:
    corrupt, cut short before its checksum (zlib returns what it inflated without a word),
    or followed by other bytes. Empty data is an empty body."""
    if not data:
        return b""
    decoder = zlib.decompressobj(_WBITS[encoding])
    try:
        out = decoder.decompress(data, limit + 1)  # stop early: never inflate past the limit
    except zlib.error as e:
        raise ValueError(str(e)) from e
    if len(out) > limit or decoder.unconsumed_tail:
        raise BodyTooLarge(f"more than {limit}")
    if not decoder.eof:
        raise ValueError("the stream is cut short: it ends before its checksum")
    if decoder.unused_data:
        raise ValueError(f"{len(decoder.unused_data)} bytes follow the end of the stream")
    return out


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    try:
        return inflate(data, encoding, limit)
    except BodyTooLarge:
        raise _too_large(f"more than {limit}", limit,
                         what=f"decompressed {encoding} body") from None
    except ValueError as e:
        raise ProtocolError(f"body is not valid {encoding} data: {e}") from e


def _decoded(data: bytes, content_encoding: str | None, limit: int) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return data
    if encoding not in _WBITS:
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; send gzip, "
                            "deflate or an uncompressed body")
    return _decompress(data, encoding, limit)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, decompressed if Content-Encoding says so; 413 past ``limit`` bytes either way."""
    _check_declared(request.headers.get("content-length"), limit)
    data = await _join(request.stream(), limit)
    return _decoded(data, request.headers.get("content-encoding"), limit)
