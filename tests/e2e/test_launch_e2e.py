"""`orchestrator launch` as operators run it: whole topologies up, requests, down, nothing left behind."""

import base64
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.testkit.plugin import ManagedProcess, ProcessFailed, orchestrator_command
from sim_helpers import png_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def log_text(process: ManagedProcess) -> str:
    if process.log_path is None:
        raise AssertionError(f"{process.name} was started without a log_dir")
    return process.log_path.read_text()


def child_pids(launcher: ManagedProcess) -> dict[str, int]:
    text = log_text(launcher)
    return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", text)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): read its state
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def requests(url: str) -> list[str]:
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    bodies: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "Describe the mountains"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": image}}]}],
         "multi_modal_uuids": ["red-pixel"]},
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        out = []
        for body in bodies:
            response = http.post("/v1/chat/completions",
                                 json={"model": "tiny-chat", "max_tokens": 10, "seed": 4, **body})
            assert response.status_code == 200, response.text
            out.append(response.json()["choices"][0]["message"]["content"])
        return out


def run_topology(tmp_path, config: str) -> list[str]:
    launcher = ManagedProcess(f"launch-{Path(config).stem}",
                              orchestrator_command("launch", str(CONFIGS / config), "--http-port", "0"),
                              log_dir=tmp_path)
    try:
        url = launcher.wait_ready(120)
        pids = child_pids(launcher)
        assert pids and all(alive(pid) for pid in pids.values())
        outputs = requests(url)
        launcher.signal(signal.SIGINT)
        assert launcher.process.wait(60) == 0
    finally:
        launcher.stop()
    left = [name for name, pid in pids.items() if alive(pid)]
    assert left == [], f"children left running: {left}"
    log = log_text(launcher)
    assert "[orchestrator]" in log and "[sim-" in log  # child logs are prefixed by component
    return outputs


def test_agg_and_disagg_topologies_give_the_same_answers_and_leave_nothing_behind(tmp_path):
    agg = run_topology(tmp_path, "agg.yaml")
    disagg = run_topology(tmp_path, "disagg.yaml")
    assert agg == disagg and all(text.strip() for text in agg)


@pytest.mark.etcd
def test_disagg_with_a_launched_etcd(tmp_path):
    outputs = run_topology(tmp_path, "disagg-etcd.yaml")
    assert len(outputs) == 2


def test_a_child_that_dies_during_startup_tears_down_and_shows_its_log_tail(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text((CONFIGS / "disagg.yaml").read_text().replace(
        "    - role: decode\n      sim: {profile: llama3-8b-h100, time_scale: 0.1, schema_revision: 3}",
        "    - role: decode\n      sim: {profile: llama3-8b-h100, time_scale: 0.1, schema_revision: 3, "
        "args: [--crash-after-tokens, lots]}"))
    launcher = ManagedProcess("launch-broken", orchestrator_command("launch", str(config), "--http-port", "0"),
                              log_dir=tmp_path)
    with pytest.raises(ProcessFailed):
        launcher.wait_ready(60)
    assert launcher.process.wait(30) == 1
    pids = child_pids(launcher)
    log = log_text(launcher)
    assert "launch failed: sim-decode-0 exited with code 2" in log
    assert "invalid int value: 'lots'" in log.split("launch failed:")[1]  # the tail of the child's log
    assert not any(alive(pid) for pid in pids.values())
    launcher.stop()


def environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_each_launched_worker_gets_its_own_env_as_the_trtllm_example_gives_each_its_gpu(tmp_path):
    """Real workers on one host: `env` per worker (CUDA_VISIBLE_DEVICES), for commands and simulated workers."""
    import yaml

    from orchestrator import config as config_module

    shipped = config_module.load(CONFIGS / "trtllm" / "disagg.yaml", check_paths=False)
    gpus = {w.role: w.env["CUDA_VISIBLE_DEVICES"] for w in shipped.launch.workers}
    assert gpus == {"prefill": "0", "decode": "1"}  # each worker on its own GPU, as the file's comment says
    worker = orchestrator_command("sim-worker", "--port", "{port}", "--time-scale", "0")
    config = tmp_path / "envs.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "disaggregated", "discovery": {"static": {"prefill": [], "decode": []}},
        "limits": {"health_interval_s": 0.2},
        "launch": {"workers": [
            {"role": "prefill", "env": {"CUDA_VISIBLE_DEVICES": "0"}, "command": [*worker, "--role", "prefill"]},
            {"role": "decode", "env": {"CUDA_VISIBLE_DEVICES": "1"},
             "sim": {"profile": "llama3-8b-h100", "time_scale": 0}}]}}))
    launcher = ManagedProcess("launch-env", orchestrator_command("launch", str(config), "--http-port", "0"),
                              log_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "7"})
    try:
        url = launcher.wait_ready(60)
        answer = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": "Describe the sea"}]})
        assert answer.status_code == 200, answer.text
        pids = child_pids(launcher)
        assert environment(pids["prefill-0"])["CUDA_VISIBLE_DEVICES"] == "0"
        assert environment(pids["sim-decode-0"])["CUDA_VISIBLE_DEVICES"] == "1"
        assert environment(pids["orchestrator"])["CUDA_VISIBLE_DEVICES"] == "7"  # the rest keep the launcher's
    finally:
        launcher.stop()


@pytest.mark.parametrize("taken", ["before", "meanwhile"])
def test_a_busy_port_names_the_launch_flag(tmp_path, taken):
    """`launch` takes --http-port (it refuses --port): its hint must say so, whether it finds the port taken
    before starting anything or the orchestrator it started finds it taken."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = orchestrator_command("launch", str(CONFIGS / "agg.yaml"), "--http-port", str(port))
        if taken == "meanwhile":  # launch's own check passed; the port is taken by the time serve binds it
            from orchestrator import config as config_module
            from orchestrator.launch import Launcher

            planned = Launcher(config_module.load(CONFIGS / "agg.yaml"), CONFIGS / "agg.yaml", http_port=port,
                               host=None)
            argv = planned.serve_argv(["--worker", "aggregated=grpc://127.0.0.1:9"])
        launcher = ManagedProcess(f"launch-busy-{taken}", argv, log_dir=tmp_path)
        assert launcher.process.wait(60) != 0
    log = log_text(launcher)
    assert f"cannot listen on 127.0.0.1:{port}" in log and "choose another with --http-port or http.port" in log, log
    if taken == "before":
        assert "started " not in log  # no worker was started for nothing
