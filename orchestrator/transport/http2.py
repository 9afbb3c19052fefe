"""The client side of HTTP/2 (RFC 9113) for gRPC calls: frames in, events out, bytes to send. No I/O.

Why our own and not h2: h2 is a complete, general state machine and costs about 100 µs of CPU to open
and close one stream and 8 µs per DATA frame (benchmarks/engine_client.py); a gRPC client needs a small
part of HTTP/2. What of RFC 9113 it implements (tests/unit/test_http2.py checks it against h2's server side, an
independent implementation, and against hand-made frames; tests/unit/test_transport_conformance.py over sockets):
- §3.4 the preface; §6.5 SETTINGS both ways, each acknowledged. Ours: ENABLE_PUSH 0, MAX_HEADER_LIST_SIZE,
  INITIAL_WINDOW_SIZE (the streams' receive window). The peer's: MAX_CONCURRENT_STREAMS (until its first
  SETTINGS we open at most 100 streams, §6.5.2's recommended minimum, so a burst at connect is not refused),
  INITIAL_WINDOW_SIZE (applied to open streams; taking one past 2^31-1 is a connection error, §6.9.2),
  MAX_FRAME_SIZE; an ENABLE_PUSH other than 0 from a server is a connection error.
- §5.1 stream states for a client (open on HEADERS, half-closed once the body is sent, closed on END_STREAM
  or RST_STREAM) and §8.1's response: informational (1xx) header blocks, skipped; the response headers;
  DATA; trailers, which must end the stream. DATA before the response headers, or a header block after them
  without END_STREAM, is that stream's error (§5.4.2: RST_STREAM PROTOCOL_ERROR, reported); the connection
  and its other streams go on.
- §4.3, §6.2, §6.10 header blocks: ours sent as HEADERS + CONTINUATION from a pre-encoded block; the peer's
  decoded by hpack (the h2 project's decoder), every block whatever its stream, so that the dynamic table
  stays in step; a block is bounded by MAX_HEADER_LIST_SIZE while it accumulates (HEADERS followed by
  CONTINUATION frames without end: the CONTINUATION flood), a connection error (ENHANCE_YOUR_CALM) above it.
- §6.1 DATA, with or without padding.
- §5.2, §6.9 flow control both ways. Sending: the request body within the peer's connection and stream
  windows, resumed on WINDOW_UPDATE; a WINDOW_UPDATE of 0, or one taking a window past 2^31-1, is a stream
  error on a stream and a connection error on the connection. Receiving: a stream's window is credited back
  as its reader consumes (consumed()), so a reader that does not read stops its sender with a stream window
  waiting; the connection's is credited as bytes arrive (a slow stream must not stop the others); DATA
  beyond either window is a FLOW_CONTROL_ERROR (stream, or connection).
- §6.7 PING answered; the ACKs of ours reported with their payload, for the caller to match to its own.
- §6.4 RST_STREAM and §6.8 GOAWAY both ways (a GOAWAY's code, debug data and the streams above its last id
  are reported); §5.4.1 a frame that breaks the connection queues a GOAWAY and raises ProtocolError.
- §4.1, §5.5 frames of unknown types are ignored; PRIORITY is checked for size and ignored.
What it deliberately does not do:
- server push (§8.4: disabled; a PUSH_PROMISE is a connection error), CONNECT (§8.5), the upgrade from
  HTTP/1.1 (plaintext is h2 with prior knowledge, as gRPC's h2c; TLS with ALPN h2 is the caller's);
- priorities (§5.3, deprecated by RFC 9113): PRIORITY frames and the HEADERS priority fields are skipped;
- an HPACK dynamic table of our own: our blocks never index (encode_headers), so the peer's
  SETTINGS_HEADER_TABLE_SIZE needs nothing from us;
- checking the peer's header fields against §8.2-§8.3 (lowercase names, no connection-specific fields,
  pseudo-headers first): the caller reads the fields it knows, and ignores the rest;
- STREAM_CLOSED errors (§5.1) for frames on a stream the peer ended: they are dropped, as they cannot be told
  apart from frames in flight on a stream we reset;
- the SETTINGS acknowledgement timeout (§6.5.3) and rate limits on the peer's PING, SETTINGS or RST_STREAM
  frames (a worker is not an adversary; what it can make us hold is bounded per frame, header block, stream
  window and message).
The caller (transport/h2_channel.py) owns the socket and the streams' meaning; each stream is an opaque
handle given to open_stream() and handed back in the events. As h11 and h2 do, `receive(data)` returns what the
bytes meant as a list of events, in order, after it has parsed them all: the caller acts on them with the framing
in a consistent state, and nothing it does then (a reset, a credit) can change a parse under way. A stream the
caller reset (reset()) gets no events from the next receive() on; those already returned are the caller's to
skip.
"""

from __future__ import annotations

import struct
from typing import Any, cast

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x6, 0x9
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x7, 0x8, 0xb
ERROR_NAMES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR", 0x3: "FLOW_CONTROL_ERROR",
               0x4: "SETTINGS_TIMEOUT", 0x5: "STREAM_CLOSED", 0x6: "FRAME_SIZE_ERROR", 0x7: "REFUSED_STREAM",
               0x8: "CANCEL", 0x9: "COMPRESSION_ERROR", 0xa: "CONNECT_ERROR", 0xb: "ENHANCE_YOUR_CALM",
               0xc: "INADEQUATE_SECURITY", 0xd: "HTTP_1_1_REQUIRED"}

SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

_FRAME_HEADER = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, R + stream id

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
UNLIMITED_STREAMS = 2**31
# Until the server's SETTINGS name its limit, we open at most this many streams: RFC 9113 §6.5.2 recommends a
# limit of no less than 100, so a server that set exactly that refuses nothing of a burst at connect.
STREAMS_BEFORE_SETTINGS = 100


class ProtocolError(Exception):
    """The peer broke HTTP/2; the connection is over (a GOAWAY with `code` is queued). `events`: what the bytes
    before the broken frame meant, in order (set by receive())."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR):
        super().__init__(f"{message} ({ERROR_NAMES.get(code, hex(code))})")
        self.code = code
        self.events: list[Event] = []


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error code {code:#x}")


# ---- what receive() reports: events, (kind, handle, detail) ---------------------------------------------------
# `handle` is what was given to open_stream() (None for an event of the connection). Plain tuples of one shape, not
# classes: one is made per DATA frame, that is per streamed token, and a tuple is the cheapest object Python makes;
# a class's __init__, or a test of the kind before the tuple is unpacked, costs as much as the rest of what the
# framing and h2_channel.py do with a token (benchmarks/instruction_cost.py). The kinds, and their details:
HEADERS_RECEIVED = 0  # headers: the response's header block, or its trailers (END_STREAM then follows as
#                       STREAM_ENDED), (name, value) byte pairs
DATA_RECEIVED = 1  # data: DATA of the response, never empty, padding removed; give its credit back with consumed()
#                    once it is read
STREAM_ENDED = 2  # None: the peer ended the stream; the connection forgot it
STREAM_RESET = 3  # code: the peer reset the stream (RST_STREAM)
STREAM_BROKEN = 4  # (code, why): we reset the stream with `code`: its frames broke HTTP/2 (RFC 9113 §5.4.2)
GOAWAY_RECEIVED = 5  # (code, debug, refused), handle None: GOAWAY, and the handles of the streams above its last id
#                      (forgotten)
PING_ACKED = 6  # payload, handle None: the ACK of a PING of ours, for the caller to match to the PING it sent
CAPACITY_FREED = 7  # None, handle None: a window opened or a stream slot was freed (at most one per receive(), last)
Event = tuple[int, Any, Any]
_CAPACITY_FREED: Event = (CAPACITY_FREED, None, None)


# ---- HPACK, our side: literals without indexing, so we never touch the peer's dynamic table ---------

_STATIC_NAMES = {b":authority": 1, b":path": 4, b"content-type": 31, b"user-agent": 58}
_STATIC_FIELDS = {(b":method", b"GET"): 2, (b":method", b"POST"): 3, (b":scheme", b"http"): 6,
                  (b":scheme", b"https"): 7}


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(0x80 | (value & 0x7f))
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(value: bytes) -> bytes:
    return _integer(len(value), 7, 0x00) + value  # no Huffman: these are short and encoded once


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block: fully static fields as one index, the rest as literals without indexing."""
    block = bytearray()
    for name, value in headers:
        if (name, value) in _STATIC_FIELDS:
            block += _integer(_STATIC_FIELDS[name, value], 7, 0x80)
        elif name in _STATIC_NAMES:
            block += _integer(_STATIC_NAMES[name], 4, 0x00) + _string(value)
        else:
            block += b"\x00" + _string(name) + _string(value)
    return bytes(block)


def _changes_table(block: bytes) -> bool:
    """Whether an HPACK block may change the decoder's dynamic table: it holds a literal with incremental
    indexing (01xxxxxx) or a table size update (001xxxxx). A block that cannot be walked counts as one."""
    at, size = 0, len(block)
    try:
        while at < size:
            first = block[at]
            if first & 0x80:  # indexed field: a 7-bit prefix integer
                at = _skip_integer(block, at, 0x7f)
            elif first & 0x60:  # 01xxxxxx or 001xxxxx
                return True
            else:  # literal without indexing / never indexed: a 4-bit name index, then the strings
                name_index = first & 0x0f
                at = _skip_integer(block, at, 0x0f)
                if name_index == 0:
                    at = _skip_string(block, at)
                at = _skip_string(block, at)
    except IndexError:
        return True
    return at != size


def _skip_integer(block: bytes, at: int, mask: int) -> int:
    if block[at] & mask != mask:
        return at + 1
    at += 1
    while block[at] & 0x80:
        at += 1
    return at + 1


def _skip_string(block: bytes, at: int) -> int:
    """Past a string literal (H bit, 7-bit prefix length, then the bytes)."""
    length, start = block[at] & 0x7f, at
    if length == 0x7f:
        length, shift, at = 0x7f, 0, at + 1
        while True:
            byte = block[at]
            length += (byte & 0x7f) << shift
            shift += 7
            at += 1
            if not byte & 0x80:
                break
        return at + length
    return start + 1 + length


def _setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


class _Stream:
    __slots__ = ("id", "handle", "send_window", "body", "offset", "receive_window", "credit", "responded")

    def __init__(self, stream_id: int, handle: Any, send_window: int, body: bytes, receive_window: int):
        self.id = stream_id
        self.handle = handle
        self.send_window = send_window
        self.body = memoryview(body)
        self.offset = 0
        self.receive_window = receive_window  # what the peer may still send on it
        self.credit = 0  # bytes the reader consumed since our last WINDOW_UPDATE for it
        self.responded = False  # the (final, non-1xx) response headers arrived: DATA and trailers may follow


class ClientConnection:
    """One HTTP/2 client connection: feed it bytes with receive(), take bytes with data_to_send()."""

    def __init__(self, *, receive_window: int = DEFAULT_WINDOW, connection_window: int | None = None,
                 max_header_list_size: int = 64 * 1024):
        """`receive_window`: each stream's (SETTINGS_INITIAL_WINDOW_SIZE, at least the default 65,535), given back
        as the reader consumes; `connection_window`: the connection's, given back as bytes arrive."""
        self._events: list[Event] = []  # what the bytes of the receive() under way meant
        self._capacity_freed = False  # ... and whether a window opened or a slot was freed meanwhile
        self.receive_window = receive_window
        self.connection_window = connection_window or receive_window
        self.max_header_list_size = max_header_list_size
        self.streams: dict[int, _Stream] = {}
        self.next_stream_id = 1
        self.going_away = False  # a GOAWAY came, or ids ran out: no new streams here
        # the peer's settings (RFC 9113 §6.5.2 defaults until its SETTINGS frame, but see STREAMS_BEFORE_SETTINGS)
        self.max_concurrent_streams = STREAMS_BEFORE_SETTINGS
        self.peer_initial_window = DEFAULT_WINDOW
        self.max_frame_size = DEFAULT_MAX_FRAME
        self.send_window = DEFAULT_WINDOW
        self._settings_received = False
        self._receivable = DEFAULT_WINDOW  # connection-level bytes the peer may still send (our credit so far)
        self._received = 0  # connection-level bytes since our last WINDOW_UPDATE
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._stable_blocks: dict[bytes, tuple] = {}  # see _decode_block
        self._out = bytearray()
        self._in = b""
        self._sending: list[_Stream] = []  # request bodies not yet wholly sent
        self._headers: tuple[int, int, bytearray] | None = None  # (stream, flags, block) until END_HEADERS

    # ---- our side --------------------------------------------------------------------------------
    def initiate(self) -> None:
        settings = (_setting(SETTINGS_ENABLE_PUSH, 0)
                    + _setting(SETTINGS_MAX_HEADER_LIST_SIZE, self.max_header_list_size))
        if self.receive_window != DEFAULT_WINDOW:
            settings += _setting(SETTINGS_INITIAL_WINDOW_SIZE, self.receive_window)
        self._out += PREFACE + frame(SETTINGS, 0, 0, settings)
        if self.connection_window > DEFAULT_WINDOW:
            self._window_update(0, self.connection_window - DEFAULT_WINDOW)
            self._receivable += self.connection_window - DEFAULT_WINDOW

    @property
    def can_open(self) -> bool:
        return not self.going_away and len(self.streams) < self.max_concurrent_streams

    def open_stream(self, handle: Any, header_block: bytes, body: bytes) -> int:
        """Send HEADERS, then `body` as DATA (END_STREAM on its last frame) as the windows allow."""
        if not self.can_open:
            raise RuntimeError("no stream can be opened on this connection now (check can_open)")
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        if self.next_stream_id > MAX_STREAM_ID:
            self.going_away = True
        stream = _Stream(stream_id, handle, self.peer_initial_window, body, self.receive_window)
        self.streams[stream_id] = stream
        first, rest = header_block[:self.max_frame_size], header_block[self.max_frame_size:]
        self._out += frame(HEADERS, 0 if rest else END_HEADERS, stream_id, first)
        while rest:
            piece, rest = rest[:self.max_frame_size], rest[self.max_frame_size:]
            self._out += frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, piece)
        self._sending.append(stream)
        self._send_bodies()
        return stream_id

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """Abandon a stream (RST_STREAM); nothing more is reported for it. A closed stream is a no-op."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._out += frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))
            if stream in self._sending:
                self._sending.remove(stream)

    def consumed(self, stream_id: int, count: int) -> None:
        """The reader of a stream took `count` bytes of its DATA: that much credit goes back to the peer, in one
        WINDOW_UPDATE once it is half a window. A stream whose reader does not read stops its sender when its window
        is used up (a bounded buffer per stream); the connection window is credited as bytes arrive, so that one
        slow reader never stops the other streams."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # ended or reset: no more DATA comes to credit
        stream.credit += count
        if stream.credit >= self.receive_window // 2:
            self._window_update(stream_id, stream.credit)
            stream.receive_window += stream.credit
            stream.credit = 0

    def ping(self, payload: bytes) -> None:
        self._out += frame(PING, 0, 0, payload)

    def data_to_send(self) -> bytes:
        data, self._out = bytes(self._out), bytearray()
        return data

    @property
    def wants_to_send(self) -> bool:
        return bool(self._out)

    def put_back(self, unsent: bytes | memoryview) -> None:
        """Bytes from data_to_send() that could not be sent yet: first in line again."""
        self._out[:0] = unsent

    def _goaway(self, code: int) -> None:
        self._out += frame(GOAWAY, 0, 0, (0).to_bytes(4, "big") + code.to_bytes(4, "big"))

    def _window_update(self, stream_id: int, increment: int) -> None:
        self._out += frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))

    def _send_bodies(self) -> None:
        for stream in list(self._sending):
            body, end = stream.body, len(stream.body)
            while stream.offset < end:
                room = min(self.send_window, stream.send_window, self.max_frame_size, end - stream.offset)
                if room <= 0:
                    break
                piece = body[stream.offset:stream.offset + room]
                stream.offset += room
                self.send_window -= room
                stream.send_window -= room
                self._out += frame(DATA, END_STREAM if stream.offset == end else 0, stream.id, piece)
            if stream.offset == end:
                if end == 0:
                    self._out += frame(DATA, END_STREAM, stream.id)
                self._sending.remove(stream)

    # ---- the peer's side -------------------------------------------------------------------------
    def receive(self, data: bytes) -> list[Event]:
        """Take bytes from the peer; what they meant, in order (a frame cut by the end of `data` waits for the
        rest). Raises ProtocolError when they break the connection (with the events before the broken frame)."""
        events: list[Event] = []
        self._events = events
        buffer = self._in + data if self._in else data
        at, size = 0, len(buffer)
        try:  # (one function, not a wrapper around the loop: a call less per read)
            while size - at >= 9:
                length_high, length_low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(buffer, at)
                length = length_high << 16 | length_low
                if length > DEFAULT_MAX_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE above the default
                    raise ProtocolError(f"a frame of {length} bytes, above our maximum of {DEFAULT_MAX_FRAME}",
                                        FRAME_SIZE_ERROR)
                end = at + 9 + length
                if end > size:
                    break
                stream_id &= 0x7fffffff
                payload = buffer[at + 9:end]
                at = end
                if self._headers is not None and kind != CONTINUATION:
                    raise ProtocolError("a header block was interrupted by another frame")
                if kind == DATA:
                    self._on_data(stream_id, flags, payload)
                else:
                    self._on_frame(kind, flags, stream_id, payload)
        except ProtocolError as exc:
            self.going_away = True
            self._goaway(exc.code)
            exc.events = events
            raise
        self._in = buffer[at:]
        if self._capacity_freed:
            self._capacity_freed = False
            events.append(_CAPACITY_FREED)
        return events

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        length = len(payload)
        if length > self._receivable:  # our credit counts once queued: a peer that had not seen it is below this
            raise ProtocolError("DATA beyond the connection's flow-control window", FLOW_CONTROL_ERROR)
        self._receivable -= length
        self._received += length
        # The connection's credit goes back as bytes arrive, once half a window was used: the streams' windows
        # bound what waits for readers (see consumed), and a stream that is not read must not stop the others.
        if self._received >= self.connection_window // 2:
            self._window_update(0, self._received)
            self._receivable += self._received
            self._received = 0
        if flags & PADDED:
            payload = self._unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None:
            self._check_known(stream_id)
            return  # a stream we reset: its bytes only count for the connection window
        if length > stream.receive_window:
            self._stream_error(stream, FLOW_CONTROL_ERROR, "DATA beyond the stream's flow-control window")
            return
        stream.receive_window -= length
        if not stream.responded:
            self._stream_error(stream, PROTOCOL_ERROR, "DATA before the response headers")
            return
        if length != len(payload):  # padding is never read by anyone: its credit goes back at once
            self.consumed(stream_id, length - len(payload))
        if payload:
            self._events.append((DATA_RECEIVED, stream.handle, payload))
        if flags & END_STREAM:
            self._end(stream_id)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == HEADERS:
            if stream_id == 0:
                raise ProtocolError("HEADERS on stream 0")
            if flags & PADDED:
                payload = self._unpad(payload)
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    raise ProtocolError("HEADERS too short for its priority fields", FRAME_SIZE_ERROR)
                payload = payload[5:]
            self._headers = (stream_id, flags, bytearray(payload))
            self._check_header_block_size(self._headers[2])
            if flags & END_HEADERS:
                self._header_block_done(self._headers)
        elif kind == CONTINUATION:
            if self._headers is None or self._headers[0] != stream_id:
                raise ProtocolError("CONTINUATION without the HEADERS it continues")
            self._headers[2].extend(payload)
            self._check_header_block_size(self._headers[2])
            if flags & END_HEADERS:
                self._header_block_done(self._headers)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            if stream_id != 0 or len(payload) != 8:
                raise ProtocolError("a PING frame must be 8 bytes on stream 0", FRAME_SIZE_ERROR)
            if flags & ACK:
                self._events.append((PING_ACKED, None, payload))
            else:
                self._out += frame(PING, ACK, 0, payload)
        elif kind == RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise ProtocolError("RST_STREAM must be 4 bytes on a stream", FRAME_SIZE_ERROR)
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                if stream in self._sending:
                    self._sending.remove(stream)
                self._events.append((STREAM_RESET, stream.handle, int.from_bytes(payload, "big")))
                self._capacity_freed = True
            else:
                self._check_known(stream_id)
        elif kind == GOAWAY:
            if stream_id != 0 or len(payload) < 8:
                raise ProtocolError("GOAWAY must be at least 8 bytes on stream 0", FRAME_SIZE_ERROR)
            self._on_goaway(payload)
        elif kind == PUSH_PROMISE:
            raise ProtocolError("PUSH_PROMISE, though we disabled push")
        elif kind == PRIORITY:
            if len(payload) != 5:
                raise ProtocolError("PRIORITY must be 5 bytes", FRAME_SIZE_ERROR)
        # any other type is an extension frame: ignored (RFC 9113 §4.1)

    def _check_header_block_size(self, block: bytearray) -> None:
        """A header block is bounded while it accumulates, not only once decoded: HEADERS followed by CONTINUATION
        frames without end (the CONTINUATION flood) would otherwise grow without limit. A block is never larger
        than the header list it encodes, so the list's limit bounds it; it cannot be skipped either (the HPACK
        table would leave the peer's), hence a connection error."""
        if len(block) > self.max_header_list_size:
            raise ProtocolError(f"a header block above {self.max_header_list_size} bytes", ENHANCE_YOUR_CALM)

    def _header_block_done(self, pending: tuple[int, int, bytearray]) -> None:
        stream_id, flags, block = pending
        self._headers = None
        headers = self._decode_block(bytes(block))
        stream = self.streams.get(stream_id)
        if stream is None:
            self._check_known(stream_id)
            return
        # A response (RFC 9113 §8.1): informational (1xx) header blocks, the response headers, DATA, and trailers
        # that end the stream; nothing after them.
        if not stream.responded:
            if headers and headers[0][0] == b":status" and headers[0][1][:1] == b"1":
                if flags & END_STREAM:
                    self._stream_error(stream, PROTOCOL_ERROR, "an informational response that ends the stream")
                return  # informational: nothing a gRPC call uses
            stream.responded = True
        elif not flags & END_STREAM:
            self._stream_error(stream, PROTOCOL_ERROR, "trailers without END_STREAM")
            return
        self._events.append((HEADERS_RECEIVED, stream.handle, headers))
        if flags & END_STREAM:
            self._end(stream_id)

    def _decode_block(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """Every block, whatever its stream, goes through the decoder: its dynamic table must follow the
        peer's encoder. A block that adds nothing to the table (table references and literals without
        indexing: what a server sends for the same headers once it indexed them) means the same until a
        block changes the table, so its decode is remembered until then. Kept for what it saves on every call:
        hpack decodes a call's response headers and trailers in 50-75 us on the loaded 2-core VM against 5-7 us
        remembered; benchmarks/http2_framing.py's call costs 0.11x h2's with it and 0.19x without."""
        stable = not _changes_table(block)
        if stable and (known := self._stable_blocks.get(block)) is not None:
            return list(known)
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as exc:
            raise ProtocolError(f"a header block does not decode: {exc}", COMPRESSION_ERROR) from exc
        if not stable:
            self._stable_blocks.clear()
        elif len(self._stable_blocks) < 64:
            self._stable_blocks[block] = tuple(headers)
        return cast("list[tuple[bytes, bytes]]", headers)  # raw=True: a list of byte pairs

    def _end(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id)
        if stream in self._sending:  # the server answered before taking the whole request
            self._sending.remove(stream)
        self._events.append((STREAM_ENDED, stream.handle, None))
        self._capacity_freed = True

    def _stream_error(self, stream: _Stream, code: int, why: str) -> None:
        """A frame that breaks one stream (RFC 9113 §5.4.2): RST_STREAM(code), reported, forgotten; the connection
        and its other streams go on."""
        self.streams.pop(stream.id, None)
        if stream in self._sending:
            self._sending.remove(stream)
        self._out += frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big"))
        self._events.append((STREAM_BROKEN, stream.handle, (code, f"{why} ({error_name(code)})")))
        self._capacity_freed = True

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError("SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError("a SETTINGS acknowledgement with a payload", FRAME_SIZE_ERROR)
            return
        if len(payload) % 6:
            raise ProtocolError("SETTINGS length is not a multiple of 6", FRAME_SIZE_ERROR)
        limit = None if self._settings_received else UNLIMITED_STREAMS  # the first SETTINGS end our own limit
        self._settings_received = True
        for at in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[at:at + 2], "big"), int.from_bytes(payload[at + 2:at + 6], "big")
            if key == SETTINGS_MAX_CONCURRENT_STREAMS:
                limit = value
            elif key == SETTINGS_ENABLE_PUSH and value != 0:
                raise ProtocolError(f"SETTINGS_ENABLE_PUSH {value} from a server")  # RFC 9113 §6.5.2
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(f"SETTINGS_INITIAL_WINDOW_SIZE {value}", FLOW_CONTROL_ERROR)
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:  # RFC 9113 §6.9.2: a connection error
                        raise ProtocolError(f"SETTINGS_INITIAL_WINDOW_SIZE {value} takes stream {stream.id}'s "
                                            f"window past 2^31-1", FLOW_CONTROL_ERROR)
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.max_frame_size = value
            # HEADER_TABLE_SIZE: we never index, so never use the peer's table; others do not apply to us
        if limit is not None:
            self.max_concurrent_streams = limit
        self._out += frame(SETTINGS, ACK, 0)
        self._send_bodies()
        self._capacity_freed = True

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("WINDOW_UPDATE must be 4 bytes", FRAME_SIZE_ERROR)
        increment = int.from_bytes(payload, "big") & 0x7fffffff
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError("a WINDOW_UPDATE of 0 for the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError("the connection window grew past 2^31-1", FLOW_CONTROL_ERROR)
        elif (stream := self.streams.get(stream_id)) is not None:
            if increment == 0:  # RFC 9113 §6.9: on a stream, a stream error
                self._stream_error(stream, PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
                return
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                self._stream_error(stream, FLOW_CONTROL_ERROR, "the stream's window grew past 2^31-1")
                return
        else:
            self._check_known(stream_id)
            return
        self._send_bodies()
        self._capacity_freed = True

    def _on_goaway(self, payload: bytes) -> None:
        last = int.from_bytes(payload[:4], "big") & 0x7fffffff
        self.going_away = True
        refused = [stream_id for stream_id in self.streams if stream_id > last]
        handles = []
        for stream_id in refused:
            stream = self.streams.pop(stream_id)
            if stream in self._sending:
                self._sending.remove(stream)
            handles.append(stream.handle)
        self._events.append((GOAWAY_RECEIVED, None, (int.from_bytes(payload[4:8], "big"), bytes(payload[8:]), handles)))

    def _unpad(self, payload: bytes) -> bytes:
        if not payload or payload[0] >= len(payload):
            raise ProtocolError("padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _check_known(self, stream_id: int) -> None:
        if stream_id >= self.next_stream_id or stream_id % 2 == 0:
            raise ProtocolError(f"a frame on stream {stream_id}, which we never opened")
