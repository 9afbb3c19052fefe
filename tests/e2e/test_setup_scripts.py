"""scripts/setup.sh, demo.sh, lint.sh and test.sh on a stand-in machine: a copy of the scripts and pyproject.toml, and
fake apt-get, etcd and .venv/bin/python that only log how they were called. What they install, and when they
install nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def system_tool(name: str) -> str:
    """The path of a tool the stand-in machine takes from this one."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not on PATH")
    return path


LOGGING_STUB = '#!/bin/bash\necho "$(basename "$0") $*" >> "$CALLS"\n'
TOOLS = ("bash", "dirname", "basename", "sha256sum", "cut", "id", "rm")  # what the scripts use from the system


class Machine:
    def __init__(self, root: Path, *, etcd: bool, etcdctl: bool, redis: bool = True):
        self.root, self.calls = root / "repo", root / "calls.log"
        shutil.copytree(ROOT / "scripts", self.root / "scripts")
        shutil.copy(ROOT / "pyproject.toml", self.root / "pyproject.toml")
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in TOOLS:
            (self.bin / tool).symlink_to(system_tool(tool))
        stubs = ["apt-get"] + ["etcd"] * etcd + ["etcdctl"] * etcdctl + ["redis-server"] * redis
        venv = self.root / ".venv" / "bin"
        venv.mkdir(parents=True)
        for path in [self.bin / name for name in stubs] + [venv / name for name in ("python", "orchestrator", "ruff",
                                                                                    "mypy", "lint-imports")]:
            path.write_text(LOGGING_STUB)
            path.chmod(0o755)
        (self.bin / "sudo").write_text('#!/bin/bash\nexec "$@"\n')  # when the suite does not run as root
        (self.bin / "sudo").chmod(0o755)

    def run(self, script: str, *args: str) -> list[str]:
        """The calls the stubs logged during this run."""
        self.calls.write_text("")
        done = subprocess.run([system_tool("bash"), f"scripts/{script}", *args], cwd=self.root, capture_output=True,
                              text=True, timeout=30, env={"PATH": str(self.bin), "CALLS": str(self.calls),
                                                          "HOME": os.environ.get("HOME", "/root")})
        assert done.returncode == 0, done.stderr
        return self.calls.read_text().splitlines()


def pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("python -m pip install") and "--upgrade pip" not in call]


def test_setup_installs_etcdctl_from_etcd_client_where_it_installs_etcd(tmp_path):
    machine = Machine(tmp_path, etcd=True, etcdctl=False)  # etcd-server alone: the README's etcdctl is missing
    calls = machine.run("setup.sh")
    (install,) = [call for call in calls if call.startswith("apt-get install")]
    assert "etcd-client" in install.split() and "etcd-server" in install.split()


def test_setup_installs_redis_server_for_the_shared_response_store_tests(tmp_path):
    machine = Machine(tmp_path, etcd=True, etcdctl=True, redis=False)
    (install,) = [call for call in machine.run("setup.sh") if call.startswith("apt-get install")]
    assert "redis-server" in install.split()


def test_a_second_set_up_from_the_same_pyproject_installs_nothing(tmp_path):
    machine = Machine(tmp_path, etcd=True, etcdctl=True)
    assert pip_installs(machine.run("setup.sh")) == ["python -m pip install -q -e .[test,bench]"]
    assert machine.run("setup.sh") == []
    assert machine.run("test.sh", "-k", "x") == ["python -m pytest -k x"]  # straight to pytest
    (machine.root / "pyproject.toml").write_text((machine.root / "pyproject.toml").read_text() + "\n# changed\n")
    assert pip_installs(machine.run("setup.sh")) == ["python -m pip install -q -e .[test,bench]"]


@pytest.mark.parametrize("installed_before", [False, True])
def test_the_demo_installs_only_the_package_and_no_etcd(tmp_path, installed_before):
    machine = Machine(tmp_path, etcd=False, etcdctl=False)
    if installed_before:  # everything is there already (test.sh ran): nothing to do
        machine.run("setup.sh")
        assert machine.run("demo.sh") == ["orchestrator launch configs/disagg.yaml"]
        return
    calls = machine.run("demo.sh")
    assert not [call for call in calls if call.startswith(("apt-get", "sudo"))]
    assert pip_installs(calls) == ["python -m pip install -q -e ."]
    assert calls[-1] == "orchestrator launch configs/disagg.yaml"
    assert machine.run("demo.sh") == ["orchestrator launch configs/disagg.yaml"]
    assert pip_installs(machine.run("setup.sh")) == ["python -m pip install -q -e .[test,bench]"]  # the extras now


def test_lint_sets_up_then_runs_ruff_over_the_tree_mypy_and_the_import_contracts_as_configured(tmp_path):
    machine = Machine(tmp_path, etcd=True, etcdctl=True)
    calls = machine.run("lint.sh")
    # ruff, mypy and import-linter come with `test`
    assert pip_installs(calls) == ["python -m pip install -q -e .[test,bench]"]
    # no arguments: their files, options and contracts are in pyproject.toml (no cache: nothing left in the tree)
    gates = ["ruff check .", "mypy ", "lint-imports --no-cache"]
    assert calls[-3:] == gates
    assert machine.run("lint.sh") == gates
