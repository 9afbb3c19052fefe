"""The house rules a newcomer can rely on, checked on the source tree."""

import ast
from pathlib import Path

import pytest

import orchestrator

PACKAGE = Path(orchestrator.__file__).parent
# The simulator is a leaf: only the launcher, the planner and the reuse bench (they step the simulator's
# scheduler on a virtual clock) and the testkit may import it; the orchestrator itself talks to every worker
# over gRPC.
MAY_IMPORT_SIM = {"launch.py", "bench/plan.py", "bench/reuse.py", "testkit/plugin.py"}
# `orchestrator check-config` runs the launcher's own checks; nothing else calls into the launcher (the frontend
# starts its other processes with the supervisor of orchestrator/processes.py, as the launcher does).
MAY_IMPORT_LAUNCH = {"config_check.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            # `from orchestrator import engine` imports the package too, as the name it binds
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_outside_the_simulator_imports_it_but_the_launcher_the_benches_and_the_testkit():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("sim/", "openengine/v1/")) or relative in MAY_IMPORT_SIM:
            continue
        if any(name == "orchestrator.sim" or name.startswith("orchestrator.sim.") for name in _imports(path)):
            offenders.append(relative)
    assert offenders == []


def test_nothing_imports_the_testkit_and_only_check_config_imports_the_launcher():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        for name in _imports(path):
            if name.startswith("orchestrator.testkit") and not relative.startswith("testkit/"):
                offenders.append(f"{relative} imports {name}")
            if name == "orchestrator.launch" and relative not in MAY_IMPORT_LAUNCH:
                offenders.append(f"{relative} imports {name}")
    assert offenders == []


def test_http_statuses_live_only_in_the_frontend():
    offenders = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                 if not path.relative_to(PACKAGE).as_posix().startswith(("frontend/", "openengine/v1/", "sim/",
                                                                          "bench/"))
                 and "ApiError" in path.read_text()]
    assert offenders == []


def test_the_coordinator_stays_small():
    assert len((PACKAGE / "flow" / "coordinator.py").read_text().splitlines()) <= 200


# ---- layers call down, never up -------------------------------------------------------------------------
# A request goes frontend -> convert -> flow (plan, then prefill, KV lease, decode, migration) -> engine ->
# transport; each package may import only what lies below it. Listed: the imports each package must never make.
# The errors every transport reports are transport/errors.py's; engine/errors.py adds the engine's own on top.
NEVER_IMPORTS = {
    "flow/": ("frontend",),
    "decode/": ("frontend", "flow"),
    "prefill/": ("frontend", "flow"),
    "kv/": ("frontend", "flow", "prefill"),
    "workers/": ("frontend", "flow", "decode", "prefill", "kv", "convert"),
    "convert/": ("frontend", "flow", "decode", "prefill", "kv", "workers"),
    "engine/": ("frontend", "flow", "decode", "prefill", "kv", "convert"),
    "transport/": ("frontend", "flow", "decode", "prefill", "kv", "convert", "workers", "engine"),
}


def _imported_packages(path: Path) -> set[str]:
    return {name.split(".")[1] for name in _imports(path) if name.startswith("orchestrator.")}


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_a_layer_never_imports_the_layers_above_it(package):
    offenders = sorted(f"{path.relative_to(PACKAGE).as_posix()} imports orchestrator.{above}"
                       for path in (PACKAGE / package).rglob("*.py")
                       for above in _imported_packages(path) & set(NEVER_IMPORTS[package]))
    assert offenders == []


def test_the_layering_rules_catch_an_upward_import():
    """The check itself: the frontend's app imports the flow, which the flow may not do the other way round."""
    app = PACKAGE / "frontend" / "app.py"
    assert "flow" in _imported_packages(app) and "flow" in NEVER_IMPORTS["decode/"]


def test_the_layering_rules_see_a_package_imported_from_the_root(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("from orchestrator import engine\n")
    assert "engine" in _imported_packages(module) and "engine" in NEVER_IMPORTS["transport/"]
