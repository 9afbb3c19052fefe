"""EagerSender (orchestrator/net/eager_send.py): a write the kernel takes at once skips the scheduler; anything
else behaves as trio's send_all."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from orchestrator.net.eager_send import EagerSender


def stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def read_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(65536)
        assert chunk, "the stream ended early"
        data += chunk
    return bytes(data)


async def test_a_write_with_room_in_the_socket_does_not_pass_through_the_scheduler():
    ours, theirs = stream_pair()
    sender = EagerSender(ours)
    with trio.testing.assert_no_checkpoints():
        for i in range(100):
            await sender.send_all(b"event %d\n" % i)
    assert await read_exactly(theirs, sum(len(b"event %d\n" % i) for i in range(100))) == b"".join(
        b"event %d\n" % i for i in range(100))


async def test_a_write_larger_than_the_socket_buffer_waits_for_room_and_arrives_whole_and_in_order():
    ours, theirs = stream_pair()
    sender = EagerSender(ours)
    payload = bytes(range(256)) * 32768  # 8 MB: far beyond the socket buffers
    received = []
    async with trio.open_nursery() as nursery:
        async def reader():
            await trio.sleep(0.05)  # the writer fills the buffer first
            received.append(await read_exactly(theirs, len(payload) + 5))

        nursery.start_soon(reader)
        with trio.testing.assert_checkpoints():  # it had to wait: that is a checkpoint
            await sender.send_all(payload)
        await sender.send_all(b"after")
    assert received == [payload + b"after"]


async def test_a_closed_stream_is_never_written_even_if_its_descriptor_number_is_reused():
    ours, _theirs = stream_pair()
    sender = EagerSender(ours)
    await ours.aclose()
    other, other_peer = stream_pair()  # likely gets the number the closed socket had
    with pytest.raises(trio.ClosedResourceError):
        await sender.send_all(b"stray")
    await other.send_all(b"x")
    assert await other_peer.receive_some(10) == b"x"  # nothing else arrived there


async def test_a_peer_that_went_away_is_a_broken_resource():
    ours, theirs = stream_pair()
    sender = EagerSender(ours)
    await theirs.aclose()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):  # the first write may still be taken by the kernel
            await sender.send_all(b"x" * 65536)


async def test_streams_that_are_not_plain_sockets_use_their_own_send_all():
    ours, theirs = trio.testing.memory_stream_pair()
    sender = EagerSender(ours)
    with trio.testing.assert_checkpoints():
        await sender.send_all(b"through send_all")
    assert await theirs.receive_some(100) == b"through send_all"
