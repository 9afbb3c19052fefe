"""EagerReceiver (orchestrator/net/eager_receive.py): reads what trio's receive_some would, and every read is a
checkpoint, as trio's is."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from orchestrator.net.eager_receive import EagerReceiver


def stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def read_all(receiver: EagerReceiver) -> bytes:
    data = bytearray()
    while chunk := await receiver.receive_some(7):
        data += chunk
    return bytes(data)


async def test_bytes_arrive_whole_and_in_order_in_pieces_of_at_most_the_size_asked():
    ours, theirs = stream_pair()
    receiver = EagerReceiver(ours)
    payload = bytes(range(256)) * 40
    async with trio.open_nursery() as nursery:
        async def writer():
            for start in range(0, len(payload), 1000):
                await theirs.send_all(payload[start:start + 1000])
                await trio.sleep(0.001)  # the reader also finds the socket empty and waits
            await theirs.aclose()

        nursery.start_soon(writer)
        assert await read_all(receiver) == payload


async def test_every_read_is_a_checkpoint_whether_it_waited_or_found_data():
    ours, theirs = stream_pair()
    receiver = EagerReceiver(ours)
    await theirs.send_all(b"ready")
    with trio.testing.assert_checkpoints():
        assert await receiver.receive_some(100) == b"ready"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_all, b"later")
        with trio.testing.assert_checkpoints():
            assert await receiver.receive_some(100) == b"later"


async def test_a_reader_waiting_for_bytes_can_be_cancelled():
    ours, _theirs = stream_pair()
    receiver = EagerReceiver(ours)
    with trio.move_on_after(0.05) as scope:
        await receiver.receive_some(100)
    assert scope.cancelled_caught


async def test_a_peer_that_keeps_sending_does_not_starve_other_tasks():
    ours, theirs = stream_pair()
    receiver = EagerReceiver(ours)
    await theirs.send_all(b"x" * 200_000)
    other_ran = trio.Event()

    async def other_task():
        other_ran.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        while not other_ran.is_set():
            assert await receiver.receive_some(10)  # data is always there; the read still yields


async def test_a_closed_stream_is_never_read_even_if_its_descriptor_number_is_reused():
    ours, _theirs = stream_pair()
    receiver = EagerReceiver(ours)
    await ours.aclose()
    other, other_peer = stream_pair()  # likely gets the number the closed socket had
    await other_peer.send_all(b"not yours")
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive_some(100)
    assert await other.receive_some(100) == b"not yours"


async def test_a_reset_connection_is_a_broken_resource_as_with_trio():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    server.setblocking(False)
    receiver = EagerReceiver(trio.SocketStream(trio.socket.from_stdlib_socket(server)))
    client.sendall(b"a")
    assert await receiver.receive_some(100) == b"a"
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # with a zero linger time: a reset, not an orderly end
    with pytest.raises(trio.BrokenResourceError, match="read failed"):
        await receiver.receive_some(100)


async def test_a_stream_that_is_not_a_plain_socket_reads_through_its_own_receive_some():
    left, right = trio.testing.memory_stream_pair()
    receiver = EagerReceiver(left)
    await right.send_all(b"through the stream")
    assert await receiver.receive_some(100) == b"through the stream"
