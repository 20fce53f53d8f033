"""System shared memory, as Triton's extension defines it: regions of POSIX shared memory that a
client on the same host registers, then names in requests instead of sending the bytes.

A client creates a segment (``shm_open``; tritonclient's ``tritonclient.utils.shared_memory``),
registers part of it under a name (``key``, ``offset``, ``byte_size``), and writes inputs there.
A request's input or requested output then carries ``shared_memory_region``,
``shared_memory_byte_size`` and optionally ``shared_memory_offset`` (relative to the region's
own offset) instead of data: the server reads the input out of the region, and writes the
output into it. Every access is checked against the region's registered size; a request that
reads or writes past it, or past the segment's end now (a client may shrink its segment), is
refused (``ProtocolError``, HTTP 400 / ``INVALID_ARGUMENT``).

The server reads and writes with ``pread``/``pwrite`` on the segment's file, never through a
mapping: a client that shrinks its segment while a request is in flight gets a short read (an
error for that request), where a mapped page would have killed the server with SIGBUS. An input
is read once, straight into the buffer its tensor uses (one copy, by the kernel, without the
GIL). Regions of one segment share one file descriptor (a key unlinked and created again is
another segment). Linux (``/dev/shm``).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from paraloom.serving.errors import (
    AlreadyExistsError,
    NotFoundError,
    ProtocolError,
    short_repr,
)

__all__ = ["MAX_READ_BYTES", "MAX_REGIONS", "OFF", "ReadBudget", "RegionRef", "RegionStatus",
           "SharedMemoryRegistry", "on_by_default", "region_ref", "registry_or_refuse"]

MAX_READ_BYTES = 1 << 30
"""The most bytes one request may read from regions, all its inputs together (1 GiB;
``SharedMemoryRegistry(max_read_bytes=)``): each read is copied into the server's memory,
and a sparse segment costs its client nothing, so without a bound one small request could
make the server allocate terabytes."""

MAX_REGIONS = 256
"""Regions one server holds at once; a register past it is refused. Regions of the same
segment share a file descriptor, so at most this many are open for them."""
OFF = ("shared memory is off on this server (paraloom serve --shared-memory on, or "
       "shared_memory=True, turns it on; 'auto' is on for a loopback --host and one process)")
"""Why a request that uses shared memory is refused by a server that has it off."""
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,200}")
_NAME = re.compile(r"[^\x00-\x1f\x7f/]{1,200}")  # any text an HTTP path segment holds
_REGION, _SIZE, _OFFSET = ("shared_memory_region", "shared_memory_byte_size",
                           "shared_memory_offset")


class RegionStatus(TypedDict):
    """One registered region, as the status endpoints list it."""

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class RegionRef:
    """Where a request's input is read from or its output written to: ``byte_size`` bytes at
    ``offset`` (from the region's start) of the region registered as ``region``."""

    region: str
    byte_size: int
    offset: int = 0


@dataclass
class _Region:
    status: RegionStatus
    fd: int  # the segment's file, shared by every region of the segment
    file: tuple[int, int]  # the segment's (device, inode): a re-created key is another file


def _count(params: Mapping[str, object], key: str, where: str, default: int | None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{where} has {key} {short_repr(value)}; expected a non-negative "
                            "integer number of bytes")
    return value


def region_ref(params: Mapping[str, object], where: str) -> RegionRef | None:
    """The region a tensor's ``parameters`` name; None when they name none."""
    if _REGION not in params:
        if _SIZE in params or _OFFSET in params:
            raise ProtocolError(f"{where} gives {_SIZE} or {_OFFSET} without "
                                f"{_REGION}; name the registered region too")
        return None
    name = params[_REGION]
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where} has {_REGION} {short_repr(name)}; expected the name a "
                            "region was registered under")
    if _SIZE not in params:
        raise ProtocolError(f"{where} names region {name!r} without {_SIZE}; send the number "
                            "of bytes to read or write there")
    return RegionRef(name, _count(params, _SIZE, where, None), _count(params, _OFFSET, where, 0))


def on_by_default(host: str, processes: int) -> bool:
    """Whether shared memory left to "auto" is on: for a server bound to an address only this
    machine reaches (a loopback address, or "localhost"), in one process (regions are
    registered with one process; a sibling on the same port never saw them)."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return loopback and processes == 1


def registry_or_refuse(regions: SharedMemoryRegistry | None, what: str = "") -> \
        SharedMemoryRegistry:
    """``regions``, or ``ProtocolError`` (``what``, then why) when shared memory is off."""
    if regions is None:
        raise ProtocolError(what + OFF)
    return regions


def _open_segment(key: str) -> int:
    """The file descriptor of POSIX shared memory segment ``key``, read-write; ProtocolError
    unless it is a regular, non-empty file in /dev/shm (no symlink is followed)."""
    path = os.path.join("/dev/shm", key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ProtocolError(f"no shared memory segment {key!r} on this host; create it (with "
                            "shm_open, tritonclient.utils.shared_memory.create_shared_memory_"
                            "region) before registering it") from e
    except OSError as e:
        raise ProtocolError(f"cannot open shared memory segment {key!r}: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(f"{key!r} is not a shared memory segment")
        if info.st_size == 0:
            raise ProtocolError(f"shared memory segment {key!r} is empty; give it a size "
                                "(ftruncate) before registering it")
        return fd
    except BaseException:
        os.close(fd)
        raise


class ReadBudget:
    """What one request may still read from shared memory: the registry's ``max_read_bytes``
    in all, however many of its inputs name regions (three inputs of 1 GiB each made the server
    allocate 3 GiB for a 435-byte request)."""

    def __init__(self, regions: SharedMemoryRegistry | None) -> None:
        self.limit = regions.max_read_bytes if regions is not None else 0
        self.left = self.limit

    def take(self, size: int, where: str) -> None:
        """Count ``size`` bytes about to be read; ``ProtocolError`` past the budget."""
        if size > self.left:
            raise ProtocolError(f"{where} names {size:,} bytes of shared memory, past what this "
                                f"request may still read ({self.left:,} of {self.limit:,} per "
                                "request): send fewer rows per request")
        self.left -= size


class SharedMemoryRegistry:
    """The regions registered with one server; shared by HTTP and gRPC. Thread-safe."""

    def __init__(self, max_regions: int = MAX_REGIONS,
                 max_read_bytes: int = MAX_READ_BYTES) -> None:
        self.max_regions = max_regions
        self.max_read_bytes = max_read_bytes
        self._regions: dict[str, _Region] = {}
        self._files: dict[tuple[int, int], tuple[int, int]] = {}  # file -> (fd, its regions)
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of segment ``key`` as region ``name``.

        Raises ``AlreadyExistsError`` (a ``ProtocolError``) for a name already registered,
        ``ProtocolError`` for a key that is not a plain segment name, a segment that does not
        exist, or a range past the segment's end.
        """
        if not _NAME.fullmatch(name):
            raise ProtocolError(f"region name {short_repr(name)} is not valid; use 1 to 200 "
                                "characters, without '/' or control characters")
        if not _KEY.fullmatch(key) or key.lstrip("/") in (".", ".."):
            raise ProtocolError(f"shared memory key {short_repr(key)} is not a segment name; "
                                "expected a name such as '/input_data' (one optional leading "
                                "'/', then letters, digits, '_', '-' or '.')")
        if byte_size <= 0 or offset < 0:
            raise ProtocolError(f"region {name!r} has offset {offset} and byte_size "
                                f"{byte_size}; expected offset >= 0 and byte_size > 0")
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region {name!r} is already "
                                         "registered; unregister it first, or pick another "
                                         "name")
            if len(self._regions) >= self.max_regions:
                raise ProtocolError(f"this server holds {self.max_regions} regions, its "
                                    "limit; unregister some first")
            fd = _open_segment(key)
            info = os.fstat(fd)
            file = (info.st_dev, info.st_ino)
            if file in self._files:  # another region of the same segment: share its fd
                os.close(fd)
                fd = self._files[file][0]
            end = offset + byte_size
            if end > info.st_size:
                if file not in self._files:
                    os.close(fd)
                raise ProtocolError(f"region {name!r} asks for bytes {offset}..{end} of "
                                    f"segment {key!r}, which has {info.st_size} bytes")
            self._files[file] = (fd, self._files.get(file, (fd, 0))[1] + 1)
            self._regions[name] = _Region(RegionStatus(name=name, key=key, offset=offset,
                                                       byte_size=byte_size), fd, file)

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name``, or every region when None; an unknown name is no error."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            for one in names:
                region = self._regions.pop(one, None)
                if region is None:
                    continue
                fd, users = self._files[region.file]
                if users > 1:
                    self._files[region.file] = (fd, users - 1)
                else:
                    del self._files[region.file]
                    os.close(fd)

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """The registered regions (only ``name``'s when given; ``NotFoundError`` if unknown)."""
        with self._lock:
            if name is None:
                return [RegionStatus(**r.status) for r in self._regions.values()]
            if name not in self._regions:
                raise NotFoundError(f"no shared memory region {name!r} is registered")
            return [RegionStatus(**self._regions[name].status)]

    def _span(self, ref: RegionRef, size: int, where: str) -> tuple[int, int]:
        """The file descriptor and file offset of ``size`` bytes at ``ref``."""
        region = self._regions.get(ref.region)
        if region is None:
            raise ProtocolError(f"{where} names shared memory region {ref.region!r}, which is "
                                "not registered; register it first")
        limit = region.status["byte_size"]
        if ref.offset + size > limit:
            raise ProtocolError(f"{where} needs bytes {ref.offset}..{ref.offset + size} of "
                                f"region {ref.region!r}, which has {limit} bytes")
        # A duplicate of the fd: an unregister during the read must not close it under us.
        return os.dup(region.fd), region.status["offset"] + ref.offset

    def read(self, ref: RegionRef, where: str) -> np.ndarray:
        """The ``ref.byte_size`` bytes ``ref`` names, read into a new writable uint8 array (not
        zero-filled first: every byte is read); ``ProtocolError`` past ``max_read_bytes``."""
        if ref.byte_size > self.max_read_bytes:
            raise ProtocolError(f"{where} names {ref.byte_size:,} bytes of shared memory; this "
                                f"server reads at most {self.max_read_bytes:,} per input: send "
                                "fewer rows per request")
        with self._lock:
            fd, start = self._span(ref, ref.byte_size, where)
        out = np.empty(ref.byte_size, dtype=np.uint8)
        got = 0
        try:
            while got < ref.byte_size:  # one read returns at most ~2 GiB, or less on a signal
                step = os.preadv(fd, [out[got:].data], start + got)
                if step == 0:
                    break
                got += step
        finally:
            os.close(fd)
        if got != ref.byte_size:
            raise ProtocolError(f"{where} needs bytes {start}..{start + ref.byte_size} of its "
                                f"shared memory segment, which now ends at {start + got}: it "
                                f"was made smaller since region {ref.region!r} was registered")
        return out

    def write(self, ref: RegionRef, data: bytes | memoryview, where: str) -> None:
        """Write ``data`` at ``ref``; ``ProtocolError`` if it is longer than ``ref.byte_size``
        or would pass the region's end."""
        if len(data) > ref.byte_size:
            raise ProtocolError(f"{where} is {len(data)} bytes but the request gave "
                                f"{_SIZE} {ref.byte_size}; give at least {len(data)}")
        with self._lock:  # the whole byte_size asked for must lie in the region (Triton)
            fd, start = self._span(ref, ref.byte_size, where)
        try:
            if os.fstat(fd).st_size < start + len(data):
                raise ProtocolError(f"{where} goes to bytes {start}..{start + len(data)} of its "
                                    "shared memory segment, which was made smaller since "
                                    f"region {ref.region!r} was registered")
            written = 0
            while written < len(data):
                written += os.pwrite(fd, memoryview(data)[written:], start + written)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Forget every region and close their files (at server shutdown)."""
        self.unregister(None)
