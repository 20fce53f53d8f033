"""A unary gRPC caller over cleartext HTTP/2 written for the load generator: nearly as cheap per
call as its HTTP/1.1 caller, so both transports take about the same CPU from the server they
measure.

grpcio's asyncio client costs several times the HTTP caller's CPU per call (0.16-0.37 ms against
0.03-0.08 ms; this caller 0.06-0.11 ms on the 2-core development machine), and the client shares
the cores with the server. This caller keeps one HTTP/2 connection with one stream open at a
time, sends the same header block (HPACK literals without indexing, so it never depends on a
compression table) and the same length-prefixed message on each new stream, and reads frames
only as far as it must: DATA carries the answer, END_STREAM ends the call, SETTINGS and PING are
acknowledged, WINDOW_UPDATE refills the send windows. It never decodes the server's headers: a
call that ends without a message is a failure (gRPC errors carry no message). A GOAWAY with
NO_ERROR (a server closing a connection after so many calls) lets the call in flight finish if
the server took it, and the caller goes on over a new connection, as grpcio's clients do; a call
the server refused unprocessed (above the GOAWAY's last stream, or RST_STREAM REFUSED_STREAM) is
sent again there, not counted as failed.
"""

from __future__ import annotations

import asyncio
import struct

from paraloom.bench.caller import ClosedLoopCaller

__all__ = ["GrpcCaller", "header_block"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_REFUSED_STREAM = 0x7
_MAX_WINDOW = (1 << 31) - 1
_DEFAULT_WINDOW = 65535  # RFC 9113's initial flow-control window


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + \
        struct.pack(">I", stream) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's prefixed integer (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes((*out, value))


def _string(text: str) -> bytes:
    raw = text.encode()
    return _integer(len(raw), 7) + raw  # no Huffman coding


def header_block(path: str, authority: str) -> bytes:
    """The request headers of a unary gRPC call to ``path``, as literals that leave the HPACK
    tables alone (RFC 7541 6.2.2), so the same bytes serve every call on a connection."""
    return (b"\x83\x86"  # :method POST and :scheme http, indexed from the static table
            + _integer(4, 4) + _string(path)  # :path (static name 4)
            + _integer(1, 4) + _string(authority)  # :authority (static name 1)
            + _integer(31, 4) + _string("application/grpc")  # content-type (static name 31)
            + b"\x00" + _string("te") + _string("trailers"))


class GrpcCaller(ClosedLoopCaller):
    """One HTTP/2 connection calling one unary method with the same message again and again
    until ``stop_at``: a closed loop of one caller, like the load generator's HTTP caller."""

    def __init__(self, path: str, authority: str, message: bytes, stop_at: float,
                 measure_from: float, out: list[float], errors: list[str],
                 done: asyncio.Future[None]) -> None:
        super().__init__(stop_at, measure_from, out, errors, done)
        self.headers = header_block(path, authority)
        self.body = b"\x00" + struct.pack(">I", len(message)) + message  # uncompressed
        self.stream = -1  # odd ids, one stream at a time
        self.answered = False  # this stream carried a message
        self.unsent = b""  # DATA the flow-control windows held back
        self.send_window = _DEFAULT_WINDOW  # the connection's
        self.stream_window = 0
        self.initial_window = _DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = 16384
        self.received = 0
        self.going_away = False  # the server sent GOAWAY NO_ERROR: no new stream here

    def _connected(self) -> None:
        settings = struct.pack(">HIHI", 2, 0, 4, _MAX_WINDOW)  # no push; widest windows
        self.transport.write(_PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(
            _WINDOW_UPDATE, 0, 0, struct.pack(">I", _MAX_WINDOW - _DEFAULT_WINDOW)))

    def _request(self) -> None:
        if self.going_away:
            self._finish()  # the load generator connects again and goes on
            return
        self.stream += 2
        self.answered = False
        self.stream_window = self.initial_window
        self.transport.write(_frame(_HEADERS, _END_HEADERS, self.stream, self.headers))
        self.unsent = self.body
        self._flush()

    def _flush(self) -> None:
        """Send as much of the message as the windows allow, in frames the server accepts."""
        frames = []
        while self.unsent:
            size = min(len(self.unsent), self.max_frame, self.send_window, self.stream_window)
            if size <= 0:
                break
            chunk, self.unsent = self.unsent[:size], self.unsent[size:]
            self.send_window -= size
            self.stream_window -= size
            frames.append(_frame(_DATA, 0 if self.unsent else _END_STREAM, self.stream, chunk))
        if frames:
            self.transport.write(b"".join(frames))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        at = 0
        while len(self.buffer) - at >= 9:
            length = int.from_bytes(self.buffer[at:at + 3], "big")
            end = at + 9 + length
            if len(self.buffer) < end:
                break
            kind, flags = self.buffer[at + 3], self.buffer[at + 4]
            stream = int.from_bytes(self.buffer[at + 5:at + 9], "big") & _MAX_WINDOW
            self._frame_received(kind, flags, stream, bytes(self.buffer[at + 9:end]))
            at = end
        del self.buffer[:at]

    def _frame_received(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == _DATA:
            self._count_received(len(payload))
            self.answered = self.answered or (stream == self.stream and len(payload) >= 5)
        elif kind == _SETTINGS and not flags & _ACK:
            self._settings(payload)
        elif kind == _PING and not flags & _ACK:
            self.transport.write(_frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & _MAX_WINDOW
            if stream == 0:
                self.send_window += increment
            elif stream == self.stream:
                self.stream_window += increment
            self._flush()
        elif kind == _RST_STREAM and stream == self.stream or kind == _GOAWAY:
            self._stopped(kind, payload)
            return
        if kind in (_DATA, _HEADERS) and stream == self.stream and flags & _END_STREAM:
            self._ended(None if self.answered else "gRPC error status")

    def _stopped(self, kind: int, payload: bytes) -> None:
        """RST_STREAM of the call in flight, or GOAWAY: a failure, unless the call or the
        connection was closed for a new connection to carry on."""
        if kind == _RST_STREAM:
            if int.from_bytes(payload[:4], "big") != _REFUSED_STREAM:
                self._ended("gRPC RST_STREAM")
                return
            self.going_away = True
            self._finish()  # never processed: sent again over a new connection
            return
        last, code = struct.unpack(">II", payload[:8])
        if code != 0:
            self.errors.append("gRPC GOAWAY")
            self._finish()
            return
        self.going_away = True  # the call in flight finishes if the server took it
        if self.stream > last & _MAX_WINDOW:
            self._finish()  # refused unprocessed: sent again over a new connection

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 4:  # a change applies to open streams too (RFC 9113 6.9.2)
                self.stream_window += value - self.initial_window
                self.initial_window = value
            elif key == 5:
                self.max_frame = value
        self.transport.write(_frame(_SETTINGS, _ACK, 0, b""))
        self._flush()

    def _count_received(self, size: int) -> None:
        self.received += size  # the windows we opened are 2 GiB; refill the connection's
        if self.received > 1 << 30:
            self.transport.write(_frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
            self.received = 0

