"""The live lane's gate itself: skip when unset, FAIL when required and missing or unreachable, pass on a
real OpenEngine endpoint (our simulated workers stand in for TRT-LLM here)."""

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.testkit.plugin import free_port

TESTS = Path(__file__).resolve().parent


def run_lane(**env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    environment.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "live_engine",
                           str(TESTS / "test_live_engine.py")], capture_output=True, text=True, env=environment,
                          cwd=TESTS.parents[1], timeout=300)


def test_without_endpoints_the_lane_skips():
    result = run_lane()
    assert result.returncode == 0 and "2 skipped" in result.stdout, result.stdout


def test_required_lane_without_endpoints_fails():
    result = run_lane(ORCH_REQUIRE_LIVE_ENGINE="1")
    # a failing fixture is reported as an error: the run fails (exit 1) and nothing passed or skipped
    assert result.returncode == 1 and "2 errors" in result.stdout, result.stdout
    assert "passed" not in result.stdout and "skipped" not in result.stdout
    assert "ORCH_REQUIRE_LIVE_ENGINE=1 but" in result.stdout


def test_required_lane_with_unreachable_endpoints_fails():
    dead = f"grpc://127.0.0.1:{free_port()}"
    result = run_lane(ORCH_REQUIRE_LIVE_ENGINE="1", ORCH_LIVE_PREFILL=dead, ORCH_LIVE_DECODE=dead,
                      ORCH_LIVE_TIMEOUT="2")
    assert result.returncode == 1 and "failed" in result.stdout and "passed" not in result.stdout, result.stdout


def test_required_lane_passes_against_real_openengine_endpoints(sim_workers):
    prefill = sim_workers.start("prefill", "--time-scale", "0.02")
    decode = sim_workers.start("decode", "--time-scale", "0.02")
    result = run_lane(ORCH_REQUIRE_LIVE_ENGINE="1", ORCH_LIVE_PREFILL=prefill.address, ORCH_LIVE_DECODE=decode.address)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout + result.stderr
