"""`orchestrator launch` as operators run it: whole topologies up, requests, down, nothing left behind."""

import base64
import json
import os
import re
import signal
import subprocess
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


def requests(url: str, with_image: bool = True) -> list[str]:
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    bodies: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "Describe the mountains"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": image}}]}],
         "multi_modal_uuids": ["red-pixel"]} if with_image else
        {"messages": [{"role": "user", "content": "What is this?"}]},
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        out = []
        for body in bodies:
            response = http.post("/v1/chat/completions",
                                 json={"model": "tiny-chat", "max_tokens": 10, "seed": 4, **body})
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            # the demo's model thinks first (reasoning_parser qwen3): ten tokens may all be reasoning
            out.append((message.get("reasoning_content") or "") + (message["content"] or ""))
        return out


def run_topology(tmp_path, config: str, with_image: bool = True) -> list[str]:
    launcher = ManagedProcess(f"launch-{Path(config).stem}",
                              orchestrator_command("launch", str(CONFIGS / config), "--http-port", "0"),
                              log_dir=tmp_path)
    try:
        url = launcher.wait_ready(120)
        pids = child_pids(launcher)
        assert pids and all(alive(pid) for pid in pids.values())
        outputs = requests(url, with_image)
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


def test_the_multi_model_config_launches_each_models_workers_for_that_model(tmp_path):
    """configs/multi-model.yaml: tiny-chat on its own prefill and decode workers, tiny-chat-small on its own
    aggregated one, each simulated worker started with its model's name; both served through one port."""
    launcher = ManagedProcess("launch-multi", orchestrator_command(
        "launch", str(CONFIGS / "multi-model.yaml"), "--http-port", "0"), log_dir=tmp_path)
    try:
        url = launcher.wait_ready(120)
        assert set(child_pids(launcher)) == {"sim-tiny-chat-prefill-0", "sim-tiny-chat-decode-0",
                                             "sim-tiny-chat-small-aggregated-0", "orchestrator"}
        with httpx.Client(base_url=url, timeout=60) as http:
            health = http.get("/health").json()
            assert {name: (each["mode"], each["ready_workers"]) for name, each in health["models"].items()} == {
                "tiny-chat": ("disaggregated", {"prefill": 1, "decode": 1}),
                "tiny-chat-small": ("aggregated", {"aggregated": 1})}
            for model in ("tiny-chat", "small"):
                answer = http.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
                assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        launcher.signal(signal.SIGINT)
        assert launcher.process.wait(60) == 0
    finally:
        launcher.stop()


def test_a_child_that_dies_during_startup_tears_down_and_shows_its_log_tail(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text((CONFIGS / "disagg.yaml").read_text().replace(
        "    - role: decode\n      sim: {profile: llama3-8b-h100, time_scale: 0.1, schema_revision: 3,",
        "    - role: decode\n      sim: {profile: llama3-8b-h100, time_scale: 0.1, schema_revision: 3, "
        "args: [--crash-after-tokens, lots],"))
    assert "lots" in config.read_text()  # the replacement found its line
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


# ---- every shipped config, launched the way operators launch it ------------------------------------------

TOPOLOGIES_ABOVE = {"agg.yaml", "disagg.yaml", "disagg-etcd.yaml"}  # launched by the tests above


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name not in TOPOLOGIES_ABOVE))
def test_every_other_shipped_config_serves_requests_and_leaves_nothing_behind(tmp_path, config):
    from orchestrator import config as config_module

    # Images need workers of the sibling server's schema (revision 3); revision 1 refuses them.
    launched = config_module.load(CONFIGS / config).launch.workers
    with_image = all(w.sim is not None and w.sim.schema_revision == 3 for w in launched)
    outputs = run_topology(tmp_path, config, with_image)
    assert len(outputs) == 2 and all(text.strip() for text in outputs)


FAKE_TRTLLM_SERVE = '''#!{python}
"""A stand-in for `trtllm-serve` (tests/e2e/test_launch_e2e.py): records how it was started, refuses what a real
one would refuse (an options file it cannot open), then serves as a simulated worker."""
import json, os, sys
from pathlib import Path

argv = sys.argv[1:]
options = argv[argv.index("--extra_llm_api_options") + 1]
role = Path(options).name.split("-")[0]
Path({records!r}, role + ".json").write_text(json.dumps({{
    "argv": argv, "cwd": os.getcwd(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "options": Path(options).read_text() if Path(options).is_file() else None}}))
if not Path(options).is_file():
    sys.exit(f"--extra_llm_api_options file not found: {{options}}")
os.execv(sys.executable, [sys.executable, "-m", "orchestrator", "sim-worker", "--role", role, "--time-scale", "0",
                          "--model", "meta-llama/Llama-3.1-8B-Instruct", "--port", argv[argv.index("--port") + 1]])
'''


def test_the_shipped_trtllm_config_launches_from_any_directory_with_what_trtllm_serve_expects(tmp_path):
    """configs/trtllm/disagg.yaml as shipped (only model.dir points at a tokenizer this host has), launched from
    an unrelated directory, with a fake `trtllm-serve` first on PATH that checks its argv and environment."""
    import shutil
    import sys

    shipped = CONFIGS / "trtllm"
    deployment = tmp_path / "trtllm"
    shutil.copytree(shipped, deployment, ignore=shutil.ignore_patterns("k8s"))
    config = deployment / "disagg.yaml"
    text = config.read_text()
    assert "  dir: /models/Llama-3.1-8B-Instruct " in text
    config.write_text(text.replace("  dir: /models/Llama-3.1-8B-Instruct ", "  dir: builtin:tiny-chat "))
    records, bin_dir, elsewhere = tmp_path / "records", tmp_path / "bin", tmp_path / "elsewhere"
    for directory in (records, bin_dir, elsewhere):
        directory.mkdir()
    fake = bin_dir / "trtllm-serve"
    fake.write_text(FAKE_TRTLLM_SERVE.format(python=sys.executable, records=str(records)))
    fake.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    launcher = ManagedProcess("launch-trtllm", orchestrator_command("launch", str(config), "--http-port", "0",
                                                                    "--host", "127.0.0.1"),
                              log_dir=tmp_path, cwd=elsewhere, env={"PATH": path})
    try:
        url = launcher.wait_ready(120)
        answer = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Describe the sea"}]})
        assert answer.status_code == 200, answer.text
        pids = child_pids(launcher)
    finally:
        launcher.stop()
    assert not any(alive(pid) for pid in pids.values())
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        record = json.loads((records / f"{role}.json").read_text())
        argv = record["argv"]
        port = argv[argv.index("--port") + 1]
        assert argv == ["/models/Llama-3.1-8B-Instruct", "--grpc", "--grpc-protocol", "openengine",
                        "--host", "127.0.0.1", "--port", port, "--extra_llm_api_options", f"{role}-engine.yaml"]
        assert port.isdigit() and record["cuda"] == gpu
        assert record["options"] == (shipped / f"{role}-engine.yaml").read_text()  # found beside the config
        assert Path(record["cwd"]) == deployment


BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "bench"


@pytest.mark.parametrize("config", sorted(p.name for p in BENCH_CONFIGS.glob("*.yaml")))
def test_every_bench_config_runs_with_the_command_its_comment_gives(tmp_path, config):
    """Each configs/bench file names the command that runs it; that command starts on it and is still working
    a second later (a full run takes minutes: this is about the file and the command as written)."""
    import shlex

    documented = [line for line in (BENCH_CONFIGS / config).read_text().splitlines()
                  if line.startswith("#   orchestrator bench ")]
    assert len(documented) == 1, f"{config}: expected one `#   orchestrator bench ...` line"
    words = shlex.split(documented[0].removeprefix("#").split("[")[0])
    assert words[3] == f"configs/bench/{config}"
    argv = orchestrator_command(*words[1:])
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    bench = ManagedProcess(f"bench-{Path(config).stem}", argv, log_dir=tmp_path,
                           cwd=Path(__file__).resolve().parents[2])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            bench.wait(3)  # imports, loads the file, starts working: no early exit
    finally:
        bench.signal(signal.SIGINT)
        code = bench.wait(60)
    log = log_text(bench)
    assert "Error" not in log.replace("KeyboardInterrupt", ""), log
    assert code != 2, log  # not a usage or configuration error
