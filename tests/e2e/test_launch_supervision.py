"""`orchestrator launch` as a supervisor: a worker that dies after start-up is restarted (or not, as its
`restart` policy says) while the rest keeps serving, and nothing it started outlives the launcher."""

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.launch import RestartBackoff, describe_exit, should_restart
from orchestrator.testkit.plugin import ManagedProcess, orchestrator_command
from test_launch_e2e import alive, child_pids, log_text


def write_deployment(tmp_path: Path, restart: str = "on-failure", count: int = 2) -> Path:
    """Two simulated aggregated workers at zero cost, quick health checks and restarts: a lean deployment."""
    config = tmp_path / f"agg-{restart}.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "aggregated", "discovery": {"static": {"aggregated": []}},
        "limits": {"health_interval_s": 0.2},
        "launch": {"restart_backoff_s": 0.2, "workers": [
            {"role": "aggregated", "count": count, "restart": restart,
             "sim": {"profile": "llama3-8b-h100", "time_scale": 0}}]}}))
    return config


def start_launcher(tmp_path: Path, config: Path) -> tuple[ManagedProcess, str]:
    launcher = ManagedProcess(f"launch-{config.stem}", orchestrator_command("launch", str(config), "--http-port", "0"),
                              log_dir=tmp_path)
    return launcher, launcher.wait_ready(60)


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": "tiny-chat", "prompt": "Describe the sea", "max_tokens": 3})


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def supervised(url: str, name: str) -> dict:
    return next(w for w in health(url)["supervisor"]["workers"] if w["name"] == name)


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not hold within {timeout:.0f} s")


def port_free(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---- the pure rules --------------------------------------------------------------------------------------

def test_restart_policies_follow_the_exit_code():
    assert should_restart("always", 0) and should_restart("always", -9)
    assert should_restart("on-failure", 1) and should_restart("on-failure", -9)
    assert not should_restart("on-failure", 0)
    assert not should_restart("never", -9) and not should_restart("never", 1)


def test_a_crash_loop_backs_off_doubling_up_to_the_cap_and_a_long_run_resets_it():
    backoff = RestartBackoff(1.0, 8.0)
    assert [backoff.delay(uptime=0.5) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.delay(uptime=8.0) == 1.0  # it ran as long as the cap: a fresh crash, not a loop
    assert backoff.delay(uptime=0.1) == 2.0


def test_an_exit_is_described_by_its_signal_or_code():
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


# ---- real processes --------------------------------------------------------------------------------------

def test_a_worker_killed_after_startup_is_restarted_on_its_address_while_the_rest_serves(tmp_path):
    launcher, url = start_launcher(tmp_path, write_deployment(tmp_path))
    try:
        before = supervised(url, "sim-aggregated-0")
        os.kill(before["pid"], signal.SIGKILL)
        # The deployment keeps serving on the other worker meanwhile (and on both again after).
        for _ in range(4):
            answer = complete(url)
            assert answer.status_code == 200, answer.text
        after = wait_until(lambda: (w := supervised(url, "sim-aggregated-0"))["restarts"] == 1
                           and w["state"] == "running" and w, what="the restart")
        assert after["pid"] != before["pid"] and after["address"] == before["address"]
        assert after["last_exit"].startswith("was killed by SIGKILL after ")
        wait_until(lambda: health(url)["ready_workers"] == {"aggregated": 2}, what="the worker rejoining the pool")
        assert complete(url).status_code == 200
        assert launcher.alive()
    finally:
        launcher.signal(signal.SIGINT)
        assert launcher.wait(60) == 0
    log = log_text(launcher)
    assert "sim-aggregated-0 was killed by SIGKILL after" in log and "restarting it on grpc://" in log
    assert "sim-aggregated-0 restarted (pid" in log
    assert not any(alive(pid) for pid in child_pids(launcher).values())


def test_with_restart_never_a_dead_worker_stays_down_and_the_others_serve(tmp_path):
    launcher, url = start_launcher(tmp_path, write_deployment(tmp_path, "never"))
    try:
        os.kill(supervised(url, "sim-aggregated-1")["pid"], signal.SIGKILL)
        gone = wait_until(lambda: (w := supervised(url, "sim-aggregated-1"))["state"] == "stopped" and w,
                          what="the worker being marked stopped")
        assert gone["restarts"] == 0 and gone["pid"] is None
        wait_until(lambda: health(url)["ready_workers"] == {"aggregated": 1}, what="the pool noticing")
        for _ in range(3):
            assert complete(url).status_code == 200
        assert launcher.alive()
    finally:
        launcher.signal(signal.SIGINT)
        assert launcher.wait(60) == 0
    assert "restart: never, so the deployment serves on without it" in log_text(launcher)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_nothing_the_launcher_started_outlives_it(tmp_path, how):
    """SIGHUP (the terminal closed) stops the deployment as Ctrl-C does; SIGKILL leaves no time for that, and
    still nothing stays bound: the children hear it from the kernel (PDEATHSIG) and from their lifeline."""
    launcher, url = start_launcher(tmp_path, write_deployment(tmp_path, count=1))
    pids = child_pids(launcher)
    assert set(pids) == {"sim-aggregated-0", "orchestrator"} and all(alive(pid) for pid in pids.values())
    launcher.signal(how)
    code = launcher.wait(60)
    assert code == (-signal.SIGKILL if how == signal.SIGKILL else 0)
    wait_until(lambda: not any(alive(pid) for pid in pids.values()), timeout=10, what="every child exiting")
    assert port_free(url)
    if how == signal.SIGHUP:
        assert "SIGHUP: stopping everything in reverse order" in log_text(launcher)


@pytest.mark.etcd
def test_with_etcd_discovery_a_restarted_worker_registers_again(tmp_path):
    config = tmp_path / "disagg-etcd.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "disaggregated", "discovery": {"etcd": {"namespace": "supervised", "lease_ttl_s": 2}},
        "limits": {"health_interval_s": 0.2},
        "launch": {"etcd": {"enabled": True}, "restart_backoff_s": 0.2, "workers": [
            {"role": "prefill", "sim": {"profile": "llama3-8b-h100", "time_scale": 0}},
            {"role": "decode", "count": 2, "sim": {"profile": "llama3-8b-h100", "time_scale": 0}}]}}))
    launcher, url = start_launcher(tmp_path, config)
    try:
        os.kill(supervised(url, "sim-prefill-0")["pid"], signal.SIGKILL)
        wait_until(lambda: supervised(url, "sim-prefill-0")["restarts"] == 1, what="the restart")
        # The only prefill worker: serving again means the restarted one was found in etcd again.
        wait_until(lambda: health(url)["ready_workers"] == {"prefill": 1, "decode": 2}, what="it registering again")
        answer = complete(url)
        assert answer.status_code == 200, answer.text
    finally:
        launcher.signal(signal.SIGINT)
        assert launcher.wait(60) == 0
