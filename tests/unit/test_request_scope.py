"""frontend/request_scope.py: one object per request decides how it is cut short and records why; the drain
waits on the requests in flight without polling."""

import pytest
import trio

from orchestrator.frontend.request_scope import Ending, InFlight, RequestScope


class Server:
    """on_disconnect as our server offers it: the callback, called later by the connection's reader task."""

    def __init__(self):
        self.callbacks = []

    def on_disconnect(self, callback):
        self.callbacks.append(callback)

    def client_goes(self):
        for callback in self.callbacks:
            callback()


async def test_a_request_that_was_not_cut_short_has_no_ending():
    request = RequestScope(Server().on_disconnect)
    with request.cancel_scope:
        async with trio.open_nursery() as nursery:
            request.watch(nursery)
    assert request.ended is None and not request.cancel_scope.cancelled_caught


async def test_the_client_going_cancels_the_request_nursery_only_and_is_a_disconnect():
    server = Server()
    request = RequestScope(server.on_disconnect)
    after_the_nursery = False
    with request.cancel_scope:
        async with trio.open_nursery() as nursery:
            request.watch(nursery)
            assert len(server.callbacks) == 1  # registered once the flow runs, not before
            server.client_goes()
            await trio.sleep_forever()
        after_the_nursery = True
    assert after_the_nursery and not request.cancel_scope.cancelled_caught
    assert nursery.cancel_scope.cancelled_caught and request.ended is Ending.DISCONNECT


async def test_the_shutdown_cancels_the_whole_request_and_is_a_shutdown():
    request = RequestScope(Server().on_disconnect)
    with request.cancel_scope:
        request.shut_down()
        await trio.sleep_forever()
    assert request.cancel_scope.cancelled_caught and request.ended is Ending.SHUTDOWN


async def test_the_request_nursery_deadline_passing_is_a_deadline(autojump_clock):
    request = RequestScope(Server().on_disconnect)
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + 2
        request.watch(nursery)
        await trio.sleep_forever()
    assert request.ended is Ending.DEADLINE


async def test_a_body_that_does_not_arrive_in_time_is_the_limit(autojump_clock):
    request = RequestScope(Server().on_disconnect)
    with pytest.raises(trio.TooSlowError):
        with request.body_limit(1.0):
            await trio.sleep_forever()
    assert request.ended is Ending.LIMIT


async def test_the_first_reason_wins():
    server = Server()
    request = RequestScope(server.on_disconnect)
    with request.cancel_scope:
        async with trio.open_nursery() as nursery:
            request.watch(nursery)
            server.client_goes()
            request.shut_down()
            await trio.sleep_forever()
    assert request.ended is Ending.DISCONNECT


async def test_the_cut_shuts_down_every_request_in_flight():
    in_flight = InFlight()
    requests = [RequestScope(Server().on_disconnect) for _ in range(3)]
    for request in requests:
        in_flight.add(request)
    assert in_flight.cut() == 3 and [r.ended for r in requests] == [Ending.SHUTDOWN] * 3
    assert all(r.cancel_scope.cancel_called for r in requests)


async def test_waiting_for_no_request_in_flight_returns_at_once_when_there_is_none():
    with trio.fail_after(1):
        await InFlight().wait_until_none()


async def test_the_drain_wakes_when_the_last_request_ends_and_not_before(autojump_clock):
    in_flight = InFlight()
    first, second = RequestScope(Server().on_disconnect), RequestScope(Server().on_disconnect)
    in_flight.add(first)
    in_flight.add(second)
    woke_at = []

    async def drain():
        await in_flight.wait_until_none()
        woke_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await trio.sleep(1)
        in_flight.discard(first)
        await trio.sleep(1)
        assert woke_at == []
        in_flight.discard(second)
    assert woke_at == [2.0] and len(in_flight) == 0
