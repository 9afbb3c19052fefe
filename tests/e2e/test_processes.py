"""The one supervisor (orchestrator/processes.py) against stand-in children: readiness, logs, stopping, from a
plain thread and from trio."""

from __future__ import annotations

import signal
import sys

import pytest
import trio

from orchestrator.processes import ManagedProcess, ProcessFailed, orchestrator_command

TALKS_THEN_WAITS = ("import sys, time; print('ready on stderr is no ready line', file=sys.stderr, flush=True); "
                    "print('some output'); print('ready http://127.0.0.1:1', flush=True); time.sleep(600)")
IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready x', flush=True); time.sleep(600)")
FAILS = "import sys; print('bad flag', file=sys.stderr); sys.exit(2)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_ready_line_comes_from_stdout_and_both_streams_go_to_the_log_file(tmp_path):
    child = ManagedProcess("talker", python(TALKS_THEN_WAITS), log_dir=tmp_path)
    try:
        assert child.wait_ready(30) == "http://127.0.0.1:1"
        assert child.alive()
    finally:
        assert child.stop(10) == -signal.SIGTERM
    log = (tmp_path / "talker.log").read_text()
    assert "ready on stderr is no ready line" in log and "some output" in log
    assert "[talker] some output" in child.tail()


def test_a_child_that_exits_before_it_is_ready_fails_with_its_code_and_last_lines(tmp_path):
    child = ManagedProcess("failing", python(FAILS), log_dir=tmp_path)
    with pytest.raises(ProcessFailed, match=r"failing exited with code 2; last lines of its log:\n  \[failing\] bad"):
        child.wait_ready(30)
    child.stop()


def test_a_command_that_cannot_start_is_a_process_failure_naming_it(tmp_path):
    with pytest.raises(ProcessFailed, match="no-such-worker could not start: /no/such/binary"):
        ManagedProcess("no-such-worker", ["/no/such/binary"], log_dir=tmp_path)


def test_sigterm_then_sigkill_after_the_timeout(tmp_path):
    child = ManagedProcess("stubborn", python(IGNORES_SIGTERM), log_dir=tmp_path)
    child.wait_ready(30)
    assert child.stop(0.5) == -signal.SIGKILL and not child.alive()


async def test_in_trio_ready_then_stop_with_sigkill_after_the_timeout_without_blocking_the_loop(tmp_path):
    child = ManagedProcess("stubborn", python(IGNORES_SIGTERM), log_dir=tmp_path)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        assert await child.wait_ready_async(30) == "x"
        with trio.fail_after(10):
            assert await child.stop_async(0.5) == -signal.SIGKILL
        nursery.cancel_scope.cancel()
    assert ticks >= 20  # the loop kept running while we waited 0.5 s for the child


async def test_in_trio_a_ready_timeout_is_a_process_failure(tmp_path):
    child = ManagedProcess("silent", python("import time; time.sleep(600)"), log_dir=tmp_path)
    try:
        with pytest.raises(ProcessFailed, match="silent did not become ready"):
            await child.wait_ready_async(0.3)
    finally:
        await child.stop_async(5)


def test_output_without_a_log_dir_goes_to_our_stderr_after_the_name(capfd):
    child = ManagedProcess("echoed", orchestrator_command("--version"))
    assert child.wait(30) == 0
    assert "[echoed] orchestrator " in capfd.readouterr().err
