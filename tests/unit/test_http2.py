"""Our HTTP/2 client framing (transport/http2.py), I/O-free: checked against h2's server side, an independent
implementation of RFC 9113, and against hand-made frames for what a broken peer can send."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.transport import http2

REQUEST_HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/openengine.v1.Engine/Generate"),
                   (b":authority", b"127.0.0.1:50051"), (b"content-type", b"application/grpc"),
                   (b"te", b"trailers"), (b"user-agent", b"orchestrator-h2")]
BLOCK = http2.encode_headers(REQUEST_HEADERS)


class Recorder:
    """What the connection reported, in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self.consumer: http2.ClientConnection | None = None

    def record(self, events: list[http2.Event]) -> None:
        for event in events:
            kind = event[0]
            if kind == http2.HEADERS_RECEIVED:
                self.log.append(("headers", event[1], event[2]))
            elif kind == http2.DATA_RECEIVED:
                self.log.append(("data", event[1], event[2]))
                if self.consumer is not None:  # a reader that takes every message at once: credit goes back
                    streams = self.consumer.streams.items()
                    stream_id = next((i for i, stream in streams if stream.handle == event[1]), None)
                    if stream_id is not None:  # (not if the same read ended it)
                        self.consumer.consumed(stream_id, len(event[2]))
            elif kind == http2.STREAM_ENDED:
                self.log.append(("end", event[1]))
            elif kind == http2.STREAM_RESET:
                self.log.append(("reset", event[1], event[2]))
            elif kind == http2.STREAM_BROKEN:
                self.log.append(("stream_error", event[1], event[2][0]))
            elif kind == http2.GOAWAY_RECEIVED:
                self.log.append(("goaway", *event[2]))
            elif kind == http2.PING_ACKED:
                self.log.append(("ping_ack", event[2]))
            # CAPACITY_FREED: reported often; what it signals is checked through can_open and the windows

    def of(self, kind):
        return [entry for entry in self.log if entry[0] == kind]


class RecordingConnection(http2.ClientConnection):
    """Our framing, with the events each receive() returns recorded in order (those before a ProtocolError too)."""

    def __init__(self, recorder: Recorder, **options):
        super().__init__(**options)
        self.recorder = recorder

    def receive(self, data: bytes) -> list[http2.Event]:
        try:
            events = super().receive(data)
        except http2.ProtocolError as exc:
            self.recorder.record(exc.events)
            raise
        self.recorder.record(events)
        return events


class Pair:
    """Our client connected to an h2 server, bytes passed by hand."""

    def __init__(self, receive_window=http2.DEFAULT_WINDOW, server_settings=None, auto_ack=True, consume=True,
                 connection_window=None):
        self.events = Recorder()
        self.client = RecordingConnection(self.events, receive_window=receive_window,
                                          connection_window=connection_window)
        self.events.consumer = self.client if consume else None
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.auto_ack = auto_ack
        self.server_events: list = []
        self.server.initiate_connection()
        if server_settings:
            self.server.update_settings(server_settings)
        self.client.initiate()
        self.pump()

    def to_server(self):
        for event in self.server.receive_data(self.client.data_to_send()):
            self.server_events.append(event)
            if self.auto_ack and isinstance(event, h2.events.DataReceived):
                self.server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def to_client(self):
        self.client.receive(self.server.data_to_send())

    def pump(self, rounds=4):
        for _ in range(rounds):
            self.to_server()
            self.to_client()

    def received(self, kind):
        return [e for e in self.server_events if isinstance(e, kind)]


def test_request_headers_decode_to_what_was_encoded_and_never_touch_the_dynamic_table():
    decoder = hpack.Decoder()
    long_value = b"x" * 300  # a length that needs HPACK's multi-byte integer
    headers = REQUEST_HEADERS + [(b"x-long", long_value), (b":scheme", b"https"), (b":method", b"GET")]
    assert decoder.decode(http2.encode_headers(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0


def test_a_call_round_trip_against_h2_headers_body_messages_and_trailers():
    pair = Pair()
    stream_id = pair.client.open_stream("call", BLOCK, b"\x00\x00\x00\x00\x03abc")
    pair.to_server()
    request = pair.received(h2.events.RequestReceived)[0]
    assert request.stream_id == stream_id == 1 and request.headers == REQUEST_HEADERS
    assert b"".join(e.data for e in pair.received(h2.events.DataReceived)) == b"\x00\x00\x00\x00\x03abc"
    assert pair.received(h2.events.StreamEnded)
    pair.server.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    pair.server.send_data(stream_id, b"one")
    pair.server.send_data(stream_id, b"two", pad_length=7)
    pair.server.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
    pair.to_client()
    assert pair.events.log == [
        ("headers", "call", [(b":status", b"200"), (b"content-type", b"application/grpc")]),
        ("data", "call", b"one"), ("data", "call", b"two"),
        ("headers", "call", [(b"grpc-status", b"0")]), ("end", "call")]
    assert pair.client.streams == {}


def test_every_split_of_the_bytes_reports_the_same_events():
    wire = _two_calls_answered()
    one_read, byte_by_byte = Recorder(), Recorder()
    connections = (RecordingConnection(one_read), RecordingConnection(byte_by_byte))
    for connection in connections:
        for handle in ("a", "b"):
            connection.open_stream(handle, BLOCK, b"body")
    connections[0].receive(wire)
    for at in range(len(wire)):
        connections[1].receive(wire[at:at + 1])
    assert byte_by_byte.log == one_read.log and len(one_read.of("end")) == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), max_size=12))
def test_receive_returns_the_same_events_for_every_split_of_the_bytes(cuts):
    """The events are values: whatever the reads, their concatenation is what one read of everything returns."""
    wire = _two_calls_answered()
    whole = http2.ClientConnection()
    for handle in ("a", "b"):
        whole.open_stream(handle, BLOCK, b"body")
    expected = whole.receive(wire)
    split = http2.ClientConnection()
    for handle in ("a", "b"):
        split.open_stream(handle, BLOCK, b"body")
    events, at = [], 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        if at < cut <= len(wire):
            events += split.receive(wire[at:cut])
            at = cut
    capacity = (http2.CAPACITY_FREED, None, None)
    assert [e for e in events if e != capacity] == [e for e in expected if e != capacity]
    assert expected[-1] == capacity and expected.count(capacity) == 1
    assert [e[0] for e in expected[:5]] == [http2.HEADERS_RECEIVED, http2.DATA_RECEIVED, http2.HEADERS_RECEIVED,
                                            http2.STREAM_ENDED, http2.HEADERS_RECEIVED]


def _two_calls_answered() -> bytes:
    """What an h2 server sends back to two calls (streams 1 and 3): headers, padded DATA, trailers, each."""
    pair = Pair()
    for handle in ("a", "b"):
        pair.client.open_stream(handle, BLOCK, b"body")
    pair.to_server()
    for stream_id in (1, 3):
        pair.server.send_headers(stream_id, [(b":status", b"200")])
        pair.server.send_data(stream_id, b"m" * 40, pad_length=3)
        pair.server.send_headers(stream_id, [(b"grpc-status", b"0"), (b"grpc-message", b"fine")], end_stream=True)
    return pair.server.data_to_send()


def test_events_of_a_stream_reset_by_the_caller_stop_with_the_next_receive():
    """A caller that resets a stream while acting on a read's events skips that read's remaining events of it
    itself; the framing reports nothing of it from the next read on."""
    wire = _two_calls_answered()
    connection = http2.ClientConnection()
    for handle in ("a", "b"):
        connection.open_stream(handle, BLOCK, b"body")
    connection.reset(1)
    events = connection.receive(wire)
    assert {e[1] for e in events} == {"b", None} and (http2.CAPACITY_FREED, None, None) in events


def test_the_events_before_a_broken_frame_come_with_the_protocol_error():
    pair = Pair()
    pair.client.open_stream("s", BLOCK, b"x")
    pair.pump()
    pair.server.send_headers(1, [(b":status", b"200")])
    with pytest.raises(http2.ProtocolError) as info:
        http2.ClientConnection.receive(pair.client, pair.server.data_to_send() + http2.frame(http2.DATA, 0, 0, b"x"))
    assert info.value.events == [(http2.HEADERS_RECEIVED, "s", [(b":status", b"200")])]


def test_a_body_larger_than_the_windows_waits_for_window_updates_and_arrives_whole():
    pair = Pair(auto_ack=False)
    body = bytes(range(256)) * 4096  # 1 MB against h2's 65,535-byte windows
    pair.client.open_stream("big", BLOCK, body)
    pair.to_server()
    got = b"".join(e.data for e in pair.received(h2.events.DataReceived))
    assert len(got) == 65535 and not pair.received(h2.events.StreamEnded)  # stalled on the window
    pair.auto_ack = True
    for event in pair.received(h2.events.DataReceived):
        pair.server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    for _ in range(40):
        pair.to_client()
        pair.to_server()
    assert b"".join(e.data for e in pair.received(h2.events.DataReceived)) == body
    assert len(pair.received(h2.events.StreamEnded)) == 1


def test_a_larger_initial_window_from_the_peer_applies_to_open_streams():
    pair = Pair(auto_ack=False)
    pair.client.open_stream("s", BLOCK, b"z" * 50_000)
    pair.to_server()
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10_000})  # shrinks: window now negative
    pair.to_client()
    pair.server.increment_flow_control_window(1_000_000)
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 200_000})
    pair.to_client()
    pair.to_server()
    assert sum(len(e.data) for e in pair.received(h2.events.DataReceived)) == 50_000


def test_the_receive_window_is_given_back_once_half_was_used():
    pair = Pair(receive_window=100_000)
    pair.client.open_stream("s", BLOCK, b"q")
    pair.pump()
    pair.server.send_headers(1, [(b":status", b"200")])
    sent = 0
    while sent < 300_000:  # three times our window: stalls unless we credit it back
        room = min(pair.server.local_flow_control_window(1), 16_384)
        assert room > 0, f"the server ran out of window after {sent} bytes"
        pair.server.send_data(1, b"d" * room)
        sent += room
        pair.to_client()
        pair.to_server()
    assert sum(len(e[2]) for e in pair.events.of("data")) == sent


def test_the_server_max_concurrent_streams_is_honoured():
    pair = Pair(server_settings={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2})
    pair.client.open_stream("a", BLOCK, b"")
    pair.client.open_stream("b", BLOCK, b"")
    assert not pair.client.can_open
    with pytest.raises(RuntimeError):
        pair.client.open_stream("c", BLOCK, b"")
    pair.to_server()
    pair.server.send_headers(1, [(b":status", b"200"), (b"grpc-status", b"0")], end_stream=True)
    pair.to_client()
    assert pair.client.can_open and pair.events.of("end") == [("end", "a")]


def test_our_reset_reaches_the_server_and_what_follows_on_that_stream_is_ignored():
    pair = Pair()
    pair.client.open_stream("gone", BLOCK, b"x")
    pair.pump()
    pair.server.send_headers(1, [(b":status", b"200")])
    pair.to_client()
    pair.client.reset(1)
    pair.client.reset(1)  # twice is harmless
    pair.to_server()
    assert [e.error_code for e in pair.received(h2.events.StreamReset)] == [http2.CANCEL]
    # bytes the server had in flight before it saw the reset: counted for the window, not reported
    late = http2.frame(http2.DATA, 0, 1, b"late")
    pair.client.receive(late)
    assert pair.events.of("data") == []


def test_a_reset_from_the_server_is_reported_with_its_code():
    pair = Pair()
    pair.client.open_stream("refused", BLOCK, b"x")
    pair.pump()
    pair.server.reset_stream(1, http2.REFUSED_STREAM)
    pair.to_client()
    assert pair.events.of("reset") == [("reset", "refused", http2.REFUSED_STREAM)] and pair.client.streams == {}


def test_goaway_refuses_the_streams_above_its_last_id_and_closes_the_connection_to_new_ones():
    pair = Pair()
    for handle in ("kept", "refused-1", "refused-2"):
        pair.client.open_stream(handle, BLOCK, b"x")
    pair.to_server()
    pair.server.close_connection(last_stream_id=1, error_code=http2.ENHANCE_YOUR_CALM, additional_data=b"max_age")
    pair.to_client()
    assert pair.events.of("goaway") == [("goaway", http2.ENHANCE_YOUR_CALM, b"max_age", ["refused-1", "refused-2"])]
    assert list(pair.client.streams) == [1] and not pair.client.can_open


def test_pings_are_answered_and_our_own_ping_is_acknowledged():
    pair = Pair()
    pair.server.ping(b"12345678")
    pair.to_client()
    pair.to_server()
    assert [e.ping_data for e in pair.received(h2.events.PingAckReceived)] == [b"12345678"]
    pair.client.ping(b"abcdefgh")
    pair.to_server()
    pair.to_client()
    assert pair.events.of("ping_ack") == [("ping_ack", b"abcdefgh")]  # the payload, to be matched to ours


def test_long_trailers_arrive_in_continuation_frames():
    pair = Pair()
    pair.client.open_stream("s", BLOCK, b"x")
    pair.pump()
    message = b"m" * 40_000  # above the 16 KB frame size: HEADERS + CONTINUATION
    pair.server.send_headers(1, [(b":status", b"200")])
    pair.server.send_headers(1, [(b"grpc-status", b"13"), (b"grpc-message", message)], end_stream=True)
    wire = pair.server.data_to_send()
    assert wire.count(bytes([http2.CONTINUATION])) >= 1
    pair.client.receive(wire)
    assert pair.events.of("headers")[-1][2] == [(b"grpc-status", b"13"), (b"grpc-message", message)]
    assert pair.events.of("end") == [("end", "s")]


def test_unknown_frame_types_and_priority_frames_are_ignored():
    pair = Pair()
    pair.client.receive(http2.frame(0xfa, 0, 0, b"extension") + http2.frame(http2.PRIORITY, 0, 1, b"\x00" * 5))
    assert pair.events.log == []


def test_stream_ids_running_out_makes_the_connection_take_no_new_streams():
    connection = RecordingConnection(Recorder())
    connection.next_stream_id = http2.MAX_STREAM_ID
    assert connection.open_stream("last", BLOCK, b"") == http2.MAX_STREAM_ID
    assert not connection.can_open


def _opened() -> http2.ClientConnection:
    connection = RecordingConnection(Recorder())
    connection.initiate()
    connection.open_stream("s", BLOCK, b"x")
    connection.data_to_send()
    return connection


@pytest.mark.parametrize("wire, code, why", [
    (http2.frame(http2.DATA, 0, 0, b"x"), http2.PROTOCOL_ERROR, "DATA on stream 0"),
    ((20_000).to_bytes(3, "big") + bytes([http2.DATA, 0]) + (1).to_bytes(4, "big"), http2.FRAME_SIZE_ERROR,
     "above our maximum"),
    (http2.frame(http2.PUSH_PROMISE, 4, 1, b"\x00\x00\x00\x02"), http2.PROTOCOL_ERROR, "PUSH_PROMISE"),
    (http2.frame(http2.CONTINUATION, 4, 1, b""), http2.PROTOCOL_ERROR, "CONTINUATION without"),
    (http2.frame(http2.HEADERS, 0, 1, b"\x88") + http2.frame(http2.PING, 0, 0, b"\x00" * 8), http2.PROTOCOL_ERROR,
     "interrupted"),
    (http2.frame(http2.PING, 0, 0, b"short"), http2.FRAME_SIZE_ERROR, "8 bytes"),
    (http2.frame(http2.SETTINGS, 0, 0, b"\x00\x04\x00"), http2.FRAME_SIZE_ERROR, "multiple of 6"),
    (http2.frame(http2.SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"), http2.FLOW_CONTROL_ERROR, "INITIAL_WINDOW"),
    (http2.frame(http2.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x10"), http2.PROTOCOL_ERROR, "MAX_FRAME_SIZE"),
    (http2.frame(http2.SETTINGS, 0, 0, b"\x00\x02\x00\x00\x00\x01"), http2.PROTOCOL_ERROR, "ENABLE_PUSH"),
    (http2.frame(http2.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), http2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0"),
    (http2.frame(http2.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"), http2.FLOW_CONTROL_ERROR, "2^31-1"),
    (http2.frame(http2.DATA, 0, 7, b"x"), http2.PROTOCOL_ERROR, "never opened"),
    (http2.frame(http2.HEADERS, 4, 1, b"\xff\xff\xff\xff\xff"), http2.COMPRESSION_ERROR, "does not decode"),
    (http2.frame(http2.DATA, http2.PADDED, 1, b"\x05ab"), http2.PROTOCOL_ERROR, "padding"),
])
def test_a_peer_that_breaks_the_protocol_ends_the_connection_with_a_goaway(wire, code, why):
    connection = _opened()
    with pytest.raises(http2.ProtocolError) as info:
        connection.receive(wire)
    assert info.value.code == code and why in str(info.value)
    goaway = connection.data_to_send()
    assert goaway[3] == http2.GOAWAY and int.from_bytes(goaway[13:17], "big") == code
    assert not connection.can_open


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_from_the_peer_either_parse_or_raise_protocol_error(data):
    connection = _opened()
    try:
        connection.receive(data)
    except http2.ProtocolError:
        pass


frames = st.builds(http2.frame, st.integers(0, 11), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5]),
                   st.binary(max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.lists(frames, max_size=8))
def test_any_sequence_of_well_framed_but_arbitrary_frames_parses_or_raises_protocol_error(wire):
    connection = _opened()
    connection.open_stream("t", BLOCK, b"y" * 70_000)  # a body still waiting for window, too
    try:
        connection.receive(b"".join(wire))
    except http2.ProtocolError:
        assert connection.data_to_send()[-17:][3] == http2.GOAWAY  # the last frame queued: 9 + 8 bytes


def test_header_blocks_of_table_references_mean_what_the_table_says_when_they_arrive():
    """Remembered decodes of index-only blocks (the same response headers again) must not outlive a change
    of the dynamic table: after x-b is indexed, the byte that meant x-a means x-b."""
    pair = Pair()
    for handle in "abcd":
        pair.client.open_stream(handle, BLOCK, b"x")
    pair.pump()
    blocks = []
    for stream_id, header in zip((1, 3, 5, 7), ((b"x-a", b"1"), (b"x-a", b"1"), (b"x-b", b"2"), (b"x-b", b"2"))):
        pair.server.send_headers(stream_id, [(b":status", b"200"), header])
        wire = pair.server.data_to_send()
        blocks.append(wire[9:])
        pair.client.receive(wire)
    assert blocks[1] == blocks[3]  # the same bytes, four requests apart
    assert [entry[2] for entry in pair.events.of("headers")] == [
        [(b":status", b"200"), (b"x-a", b"1")], [(b":status", b"200"), (b"x-a", b"1")],
        [(b":status", b"200"), (b"x-b", b"2")], [(b":status", b"200"), (b"x-b", b"2")]]


def test_grpc_core_trailers_after_the_first_call_change_no_table():
    """What grpcio's server sent the second time (captured from a sim worker): grpc-status by index, an
    empty grpc-message as a literal without indexing."""
    assert not http2._changes_table(bytes.fromhex("be000c677270632d6d65737361676500"))
    assert not http2._changes_table(bytes.fromhex("88c0bf"))
    assert http2._changes_table(bytes.fromhex("400b677270632d7374617475730130000c677270632d6d65737361676500"))
    assert not http2._changes_table(http2.encode_headers(REQUEST_HEADERS + [(b"x-long", b"v" * 500)]))
    assert http2._changes_table(b"\x3f\xe1\x1f")  # a table size update
    assert http2._changes_table(b"\x00\x05ab")  # cut short: cannot be walked


header_lists = st.lists(st.tuples(st.sampled_from([b"grpc-status", b"grpc-message", b"x-a", b"content-type",
                                                   b"x-" + b"n" * 200]),
                                  st.binary(max_size=150), st.booleans()), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(header_lists, min_size=1, max_size=8), st.sampled_from([256, 4096]))
def test_a_block_said_to_leave_the_table_alone_does(blocks, table_size):
    """Soundness of the remembered decodes: whatever hpack's own encoder writes (incremental indexing,
    never-indexed fields, evictions in a small table), a block that changes the decoder's table is seen
    as one."""
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    encoder.header_table_size = table_size
    for headers in blocks:
        block = encoder.encode([hpack.NeverIndexedHeaderTuple(n, v) if secret else (n, v) for n, v, secret in headers])
        before = (list(decoder.header_table.dynamic_entries), decoder.header_table.maxsize)
        decoder.decode(block, raw=True)
        after = (list(decoder.header_table.dynamic_entries), decoder.header_table.maxsize)
        if before != after:
            assert http2._changes_table(block)


def test_bytes_that_could_not_be_sent_go_out_first_next_time():
    connection = RecordingConnection(Recorder())
    connection.initiate()
    preface = connection.data_to_send()
    assert not connection.wants_to_send
    connection.ping(b"12345678")
    connection.put_back(preface[20:])  # the socket took the first 20 bytes only
    assert connection.wants_to_send
    assert connection.data_to_send() == preface[20:] + http2.frame(http2.PING, 0, 0, b"12345678")


# ---- per-stream rules (RFC 9113 §5.1, §8.1): what breaks one response is that stream's error -------------------

def _two_open_streams(consume=True) -> Pair:
    pair = Pair(consume=consume)
    pair.client.open_stream("a", BLOCK, b"x")
    pair.client.open_stream("b", BLOCK, b"x")
    pair.pump()
    return pair


def _assert_only_a_failed(pair: Pair, code: int) -> None:
    """Stream 1 ("a") was reset with `code` and reported once; stream 3 ("b") still completes on the connection."""
    assert pair.events.of("stream_error") == [("stream_error", "a", code)]
    assert ("end", "a") not in pair.events.log
    pair.to_server()
    assert [(e.stream_id, e.error_code) for e in pair.received(h2.events.StreamReset)] == [(1, code)]
    pair.server.send_headers(3, [(b":status", b"200")])
    pair.server.send_data(3, b"fine")
    pair.server.send_headers(3, [(b"grpc-status", b"0")], end_stream=True)
    pair.to_client()
    assert pair.events.of("end") == [("end", "b")] and pair.client.streams == {} and pair.client.can_open


def test_data_before_the_response_headers_is_that_streams_error():
    pair = _two_open_streams()
    pair.client.receive(http2.frame(http2.DATA, 0, 1, b"early"))
    assert pair.events.of("data") == []
    _assert_only_a_failed(pair, http2.PROTOCOL_ERROR)


def test_trailers_without_end_stream_are_that_streams_error_and_a_third_header_block_is_not_reported():
    pair = _two_open_streams()
    pair.server.send_headers(1, [(b":status", b"200")])
    pair.to_client()
    trailers = http2.encode_headers([(b"grpc-status", b"0")])
    pair.client.receive(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, trailers)
                        + http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, trailers))
    assert [entry[2] for entry in pair.events.of("headers")] == [[(b":status", b"200")]]
    _assert_only_a_failed(pair, http2.PROTOCOL_ERROR)


def test_informational_header_blocks_before_the_response_headers_are_skipped():
    pair = Pair()
    pair.client.open_stream("s", BLOCK, b"x")
    pair.pump()
    pair.client.receive(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, http2.encode_headers([(b":status", b"103")])))
    pair.server.send_headers(1, [(b":status", b"200")])
    pair.server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    pair.to_client()
    assert pair.events.log == [("headers", "s", [(b":status", b"200")]), ("headers", "s", [(b"grpc-status", b"0")]),
                               ("end", "s")]


def test_a_header_block_is_bounded_across_continuation_frames():
    """The CONTINUATION flood: a header block that never ends must not accumulate (32 MB here) before it fails."""
    connection = _opened()
    with pytest.raises(http2.ProtocolError) as info:
        for count in range(2000):
            connection.receive(http2.frame(http2.CONTINUATION if count else http2.HEADERS, 0, 1, b"\x00" * 16384))
    assert info.value.code == http2.ENHANCE_YOUR_CALM and count <= 4


def test_a_stream_window_update_of_zero_is_that_streams_error():
    pair = _two_open_streams()
    pair.client.receive(http2.frame(http2.WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x00"))
    _assert_only_a_failed(pair, http2.PROTOCOL_ERROR)


def test_a_stream_send_window_past_2_31_minus_1_is_that_streams_error():
    pair = _two_open_streams()
    pair.client.receive(http2.frame(http2.WINDOW_UPDATE, 0, 1, (2**31 - 1).to_bytes(4, "big")))
    _assert_only_a_failed(pair, http2.FLOW_CONTROL_ERROR)


def test_an_initial_window_size_that_overflows_an_open_streams_window_is_a_connection_error():
    connection = _opened()
    connection.receive(http2.frame(http2.WINDOW_UPDATE, 0, 1, (2**31 - 1 - http2.DEFAULT_WINDOW).to_bytes(4, "big")))
    with pytest.raises(http2.ProtocolError) as info:
        connection.receive(http2.frame(http2.SETTINGS, 0, 0,
                                       b"\x00\x04" + (http2.DEFAULT_WINDOW + 10).to_bytes(4, "big")))
    assert info.value.code == http2.FLOW_CONTROL_ERROR


def test_until_the_server_settings_arrive_at_most_100_streams_are_opened():
    """RFC 9113 §5.1.2 recommends a limit of no less than 100; before the server names its own, a burst at connect
    above that would be refused by a server whose limit is 100."""
    connection = RecordingConnection(Recorder())
    connection.initiate()
    for handle in range(100):
        connection.open_stream(handle, BLOCK, b"")
    assert not connection.can_open
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 250})
    server.receive_data(connection.data_to_send())
    connection.receive(server.data_to_send())
    assert connection.can_open and connection.max_concurrent_streams == 250
    silent = RecordingConnection(Recorder())  # SETTINGS without a limit: none
    silent.receive(http2.frame(http2.SETTINGS, 0, 0))
    assert silent.max_concurrent_streams > 10**9


def test_a_stream_window_is_credited_as_its_reader_consumes_and_the_connection_window_as_bytes_arrive():
    pair = Pair(receive_window=100_000, connection_window=1_000_000, consume=False)
    pair.client.open_stream("s", BLOCK, b"q")
    pair.pump()
    pair.server.send_headers(1, [(b":status", b"200")])
    while (room := min(pair.server.local_flow_control_window(1), 16_384)) > 0:
        pair.server.send_data(1, b"d" * room)
    pair.to_client()
    pair.to_server()
    unread = sum(len(entry[2]) for entry in pair.events.of("data"))
    assert unread == 100_000 and pair.server.local_flow_control_window(1) == 0  # the reader has read nothing
    assert pair.server.outbound_flow_control_window > 0  # one slow stream does not stop the others
    pair.client.consumed(1, 30_000)  # under half the window: not worth a frame yet
    pair.to_server()
    assert pair.server.local_flow_control_window(1) == 0
    pair.client.consumed(1, 70_000)
    pair.to_server()
    assert pair.server.local_flow_control_window(1) == 100_000


def test_a_peer_that_overruns_a_stream_window_gets_that_streams_flow_control_error():
    pair = _two_open_streams(consume=False)
    pair.server.send_headers(1, [(b":status", b"200")])
    pair.to_client()
    pair.client.receive(b"".join(http2.frame(http2.DATA, 0, 1, b"d" * 16_384) for _ in range(4)))  # 65,536 > 65,535
    _assert_only_a_failed(pair, http2.FLOW_CONTROL_ERROR)
