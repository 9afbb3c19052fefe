"""gRPC over HTTP/2, one response's framing (PROTOCOL-HTTP2.md), pure: length-prefixed messages cut from DATA
whatever its split, compressed ones inflated, and the call's status read from its header blocks. No I/O.

transport/h2_channel.py feeds each call's `ResponseFraming` what transport/http2.py reported for its stream and
acts on the result; what fails the call is a `CallFailure` (a gRPC status and why), which the channel turns into
the call's EngineError (transport/errors.py, the one mapping of a status).
- messages: at most MAX_MESSAGE_BYTES (64 MiB, as grpcio): a larger length prefix fails the call
  RESOURCE_EXHAUSTED at once, nothing of it buffered; a message flagged compressed is inflated when the response's
  `grpc-encoding` is gzip or deflate, to at most MAX_MESSAGE_BYTES, and fails the call INTERNAL otherwise (as do
  flags other than 0 and 1);
- the status: `grpc-status` / `grpc-message` from the trailers or a trailers-only response; a grpc-status that is
  not a number fails INTERNAL; without a grpc-status, a `:status` other than 200 maps as gRPC maps HTTP statuses (a
  proxy, or no gRPC server); a `content-type` other than application/grpc* fails INTERNAL; a stream that ends
  inside a message, or without a grpc-status, fails (no status: a broken response).
"""

from __future__ import annotations

import urllib.parse
import zlib

import attrs
import grpc

from orchestrator.transport.errors import grpc_status_from_number

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a response message above this fails its call, as grpcio's limit does
HEADER = 5  # gRPC message prefix: 1 byte compressed flag, 4 bytes big-endian length


def prefix(message: bytes) -> bytes:
    """The prefix of an uncompressed message (ours are never compressed)."""
    return b"\x00" + len(message).to_bytes(4, "big")


@attrs.frozen
class CallFailure:
    """Why a call failed on what its response said: the gRPC status it fails with (None: the response broke off,
    a plain error without a status) and the message."""

    status: grpc.StatusCode | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(grpc.StatusCode)))
    why: str = attrs.field(validator=attrs.validators.instance_of(str))


# The encodings of a compressed response we inflate. We ask for none (grpc-accept-encoding: identity): inflating
# costs CPU on every token. But a grpc-core server with a default compression algorithm (grpc.aio.server's
# `compression`) compresses whatever the client accepts: such a server is read as grpcio reads it.
DECOMPRESSORS = {b"gzip": lambda: zlib.decompressobj(wbits=31), b"deflate": lambda: zlib.decompressobj(wbits=15)}

# gRPC's mapping of HTTP statuses from a server that is not a gRPC server (or a proxy in front of one).
HTTP_TO_GRPC = {b"400": grpc.StatusCode.INTERNAL, b"401": grpc.StatusCode.UNAUTHENTICATED,
                b"403": grpc.StatusCode.PERMISSION_DENIED, b"404": grpc.StatusCode.UNIMPLEMENTED,
                b"429": grpc.StatusCode.UNAVAILABLE, b"502": grpc.StatusCode.UNAVAILABLE,
                b"503": grpc.StatusCode.UNAVAILABLE, b"504": grpc.StatusCode.UNAVAILABLE}


class ResponseFraming:
    """One call's response, as its bytes and header blocks arrive. After a failure (`failure` set, or one
    returned) the call is over: feed it nothing more."""

    __slots__ = ("_encoding", "_message", "_status", "failure", "pending")

    def __init__(self) -> None:
        self.pending = bytearray()  # a message in part (read only: transport/h2_channel.py checks it is empty)
        self._status: int | None = None
        self._message = ""
        self._encoding = b"identity"  # the response's grpc-encoding: what its messages flagged compressed used
        self.failure: CallFailure | None = None  # what data() stopped at

    def data(self, data: bytes) -> list[bytes]:
        """The messages `data` completes, in order; a message cut by its end waits for the rest. When a message
        fails the call, the ones before it are returned and `failure` says why."""
        buffer = self.pending
        if not buffer and len(data) >= HEADER and data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5:
            return [data[5:]]  # the usual case: one whole message in one frame
        buffer += data
        messages: list[bytes] = []
        while len(buffer) >= HEADER:
            flag, length = buffer[0], int.from_bytes(buffer[1:5], "big")
            if length > MAX_MESSAGE_BYTES or (flag and (flag != 1 or self._encoding not in DECOMPRESSORS)):
                self.failure = self._refused(flag, length)  # known from its prefix, before it is buffered
                buffer.clear()
                return messages
            if len(buffer) < HEADER + length:
                break
            payload = bytes(buffer[HEADER:HEADER + length])
            del buffer[:HEADER + length]
            if flag:
                inflated = self._inflate(payload)
                if inflated is None:
                    return messages
                payload = inflated
            messages.append(payload)
        return messages

    def _inflate(self, payload: bytes) -> bytes | None:
        """A message compressed with the response's grpc-encoding, inflated to at most MAX_MESSAGE_BYTES (a small
        message can inflate to gigabytes); None when the call failed on it instead (`failure`)."""
        inflater = DECOMPRESSORS[self._encoding]()
        try:
            message = inflater.decompress(payload, MAX_MESSAGE_BYTES + 1)
        except zlib.error as exc:
            self.failure = CallFailure(grpc.StatusCode.INTERNAL, f"the worker sent a {self._encoding.decode()} "
                                                                 f"message that does not inflate: {exc}")
            return None
        if len(message) > MAX_MESSAGE_BYTES:
            self.failure = CallFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the worker sent a message that "
                                       f"inflates above our limit of {MAX_MESSAGE_BYTES} bytes")
            return None
        return message

    def _refused(self, flag: int, length: int) -> CallFailure:
        if flag == 1:
            encoding = self._encoding.decode(errors="replace")
            return CallFailure(grpc.StatusCode.INTERNAL, f"the worker sent a compressed message with grpc-encoding "
                                                         f"{encoding!r}, which we do not inflate")
        if flag != 0:
            return CallFailure(grpc.StatusCode.INTERNAL, f"the worker sent a message with flags {flag:#x}")
        return CallFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the worker sent a message of {length} bytes, above our limit of {MAX_MESSAGE_BYTES}")

    def headers(self, headers: list[tuple[bytes, bytes]]) -> CallFailure | None:
        """A header block of the response (its headers, its trailers, or both in a trailers-only response);
        what fails the call, if anything."""
        http_status = content_type = grpc_status = None
        for name, value in headers:
            if name == b":status":
                http_status = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-status":
                grpc_status = value
            elif name == b"grpc-message":
                self._message = urllib.parse.unquote(value.decode(errors="replace"))
            elif name == b"grpc-encoding":
                self._encoding = value
        if grpc_status is not None:
            if not grpc_status.isdigit():  # this call's trailers are broken, not the connection
                return CallFailure(grpc.StatusCode.INTERNAL, f"the worker sent grpc-status "
                                                             f"{grpc_status.decode(errors='replace')!r}, not a number")
            self._status = int(grpc_status)
        elif http_status is not None and http_status != b"200":  # not a gRPC answer: a proxy's, or no gRPC server
            return CallFailure(HTTP_TO_GRPC.get(http_status, grpc.StatusCode.UNKNOWN),
                               f"HTTP status {http_status.decode(errors='replace')} from the worker")
        if http_status is not None and content_type is not None and not content_type.startswith(b"application/grpc"):
            return CallFailure(grpc.StatusCode.INTERNAL, f"the worker answered with content-type "
                                                         f"{content_type.decode(errors='replace')!r}, not gRPC")
        return None

    def end(self) -> CallFailure | None:
        """The stream ended: None when the call succeeded (grpc-status 0), else why it failed."""
        if self.pending:
            return CallFailure(None, "the stream ended inside a message")
        if self._status is None:
            return CallFailure(None, "the stream ended without a grpc-status")
        if self._status == 0:
            return None
        return CallFailure(grpc_status_from_number(self._status), self._message)
