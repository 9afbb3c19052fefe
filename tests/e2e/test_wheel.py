"""The package as it ships: its wheel (what Containerfile installs) built from the source, installed into a fresh
venv without the source tree, and its console script serving a request there. The image itself is not built
here (no container runtime, no registry); docs/deployment.md says how to build it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import yaml

from orchestrator.testkit.plugin import ManagedProcess

ROOT = Path(__file__).resolve().parents[2]


def pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_wheel_installs_into_a_fresh_venv_and_its_console_script_serves(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "orchestrator", source / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
    # the build backend is this environment's setuptools (offline); `./` makes pip read it as a path, not a name
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), "./source",
        cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("orchestrator-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and any(n.endswith("licenses/LICENSE") for n in names)
    assert "orchestrator/models/tiny-chat/tokenizer.json" in names and "orchestrator/sim/calibration.json" in names

    # A venv of its own; the wheel goes in without its dependencies, which come from this environment's
    # site-packages (a .pth line: the editable install of the source tree there is not processed from it).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    pip("--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    site_packages = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig."
                                         "get_paths()['purelib'])"], capture_output=True, text=True,
                                        check=True).stdout.strip())
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    assert where.startswith(str(site_packages)), where  # the wheel's copy, not the source tree

    script = str(venv / "bin" / "orchestrator")
    version = subprocess.run([script, "--version"], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert version.stdout.strip() == "orchestrator 0.1.0"
    worker = ManagedProcess("wheel-sim", [script, "sim-worker", "--role", "aggregated", "--port", "0",
                                          "--time-scale", "0"], log_dir=tmp_path)
    server = None
    try:
        address = worker.wait_ready(60)
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_dump({"mode": "aggregated", "discovery": {"static": {"aggregated": [address]}}}))
        server = ManagedProcess("wheel-serve", [script, "serve", "-c", str(config), "--port", "0"], log_dir=tmp_path)
        url = server.wait_ready(60)
        answer = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": "Describe the sea"}]})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    finally:
        if server is not None:
            server.stop()
        worker.stop()


def test_the_containerfile_installs_the_wheel_and_the_kubernetes_example_uses_its_image():
    text = (ROOT / "Containerfile").read_text()
    assert "pip wheel --no-deps" in text and "pip install --no-cache-dir /wheels/orchestrator-" in text
    assert 'ENTRYPOINT ["orchestrator"]' in text and "USER " in text  # the console script, not as root
    tag = next(line.split()[-2] for line in text.splitlines() if line.startswith("#") and " -t " in line)
    images = {container["image"] for document in yaml.safe_load_all(
        (ROOT / "configs" / "trtllm" / "k8s" / "disagg.yaml").read_text()) if document["kind"] == "Deployment"
        for container in document["spec"]["template"]["spec"]["containers"] if "orchestrator" in container["image"]}
    assert images == {tag}, (images, tag)
