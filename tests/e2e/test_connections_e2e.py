"""File descriptors against a real `orchestrator serve` process: the soft open-files limit is raised to the
hard one at start-up, and client connections are capped below it (http.max_connections), so a flood of idle
connections cannot stop service."""

import sys

import httpx
import trio

from orchestrator.testkit.plugin import ManagedProcess, write_config
from serve_helpers import chat_body

# The server starts with a soft limit of 256 open files under a hard limit of 1,024, as a service manager
# may start it (1,024 is common for both; a lower soft limit keeps the test small).
_WITH_LIMIT = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'orchestrator', *sys.argv[1:]])")


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise LookupError("no 'Max open files' line")


async def flood(url: str, count: int) -> list[trio.SocketStream]:
    """`count` connections that never send a request."""
    host, port = url.removeprefix("http://").split(":")
    return [await trio.open_tcp_stream(host, int(port)) for _ in range(count)]


async def closed_by_server(streams: list[trio.SocketStream], wait: float = 1.0) -> list[bool]:
    """Which of `streams` the server has closed (their end is read within `wait`)."""
    closed = [False] * len(streams)

    async def watch(i: int, stream: trio.SocketStream) -> None:
        closed[i] = await stream.receive_some(1) == b""

    with trio.move_on_after(wait):
        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(streams):
                nursery.start_soon(watch, i, stream)
    return closed


async def timed_request(url: str) -> tuple[int, float]:
    started = trio.current_time()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    return response.status_code, trio.current_time() - started


def start_with_low_limit(tmp_path, worker, **http) -> ManagedProcess:
    config = write_config(tmp_path / "fds.yaml", "aggregated", {"aggregated": [worker.address]}, http=http)
    return ManagedProcess("orchestrator-fds", [sys.executable, "-c", _WITH_LIMIT, "serve", "-c", str(config),
                                               "--port", "0"], log_dir=tmp_path)


async def test_the_open_files_limit_is_raised_so_idle_connections_do_not_stop_service(tmp_path, sim_workers):
    """400 idle connections against a server started with a soft limit of 256: it used to run out of
    descriptors (a normal request then waited 16 s, for keep-alive to close idle ones, and the log had a
    traceback every 0.1 s); the soft limit is now raised to the hard one at start-up."""
    server = start_with_low_limit(tmp_path, sim_workers.start("aggregated", "--time-scale", "0.02"))
    idle: list[trio.SocketStream] = []
    try:
        url = server.wait_ready(60)
        limit = open_files_limit(server.pid)
        idle = await flood(url, 400)
        status, seconds = await timed_request(url)
        log = server.tail(400)
    finally:
        for stream in idle:
            await trio.aclose_forcefully(stream)
        server.stop()
    print(f"open files limit {limit}; a request behind 400 idle connections took {seconds:.2f} s")
    assert limit == (1024, 1024)
    assert status == 200 and seconds < 5, seconds
    assert "Traceback" not in log and "Too many open files" not in log, log


async def test_connections_beyond_http_max_connections_close_the_longest_idle_ones(tmp_path, sim_workers):
    server = start_with_low_limit(tmp_path, sim_workers.start("aggregated", "--time-scale", "0.02"),
                                  max_connections=200)
    idle: list[trio.SocketStream] = []
    try:
        url = server.wait_ready(60)
        idle = await flood(url, 400)
        status, seconds = await timed_request(url)
        closed = await closed_by_server(idle)
    finally:
        for stream in idle:
            await trio.aclose_forcefully(stream)
        server.stop()
    print(f"a request behind 400 idle connections took {seconds:.2f} s; the server closed {sum(closed)} of them")
    assert status == 200 and seconds < 5, seconds
    assert 195 <= sum(closed) <= 205, sum(closed)  # room for the 200 newer ones and the request's connection
    assert all(closed[:150]) and not any(closed[250:])  # the longest idle went first
