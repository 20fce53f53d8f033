"""Reading a request body within a size limit, including gzip/deflate bodies (no zip bombs)."""

from __future__ import annotations

import zlib

from starlette.requests import Request

from paraloom.serving.errors import PayloadTooLargeError, ProtocolError

__all__ = ["read_body"]

# zlib's wbits: 16+ reads a gzip wrapper, a plain value reads a zlib stream ("deflate" in HTTP).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(size: int | str, limit: int, what: str = "request body") -> PayloadTooLargeError:
    return PayloadTooLargeError(f"{what} of {size} bytes is over this server's limit of {limit} "
                                "bytes; send fewer rows per request, or raise the limit "
                                "(paraloom serve --max-body-mb, create_app(max_body_bytes=))")


async def _read_raw(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ProtocolError(f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body has no Content-Length to trust
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    decoder = zlib.decompressobj(_WBITS[encoding])
    try:
        out = decoder.decompress(data, limit + 1)  # stop early: never inflate past the limit
    except zlib.error as e:
        raise ProtocolError(f"body is not valid {encoding} data: {e}") from e
    if len(out) > limit or decoder.unconsumed_tail:
        raise _too_large(f"more than {limit}", limit, what=f"decompressed {encoding} body")
    return out


async def read_body(request: Request, limit: int) -> bytes:
    """The body, decompressed if Content-Encoding says so; 413 past ``limit`` bytes either way."""
    data = await _read_raw(request, limit)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return data
    if encoding not in _WBITS:
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; send gzip, "
                            "deflate or an uncompressed body")
    return _decompress(data, encoding, limit)
