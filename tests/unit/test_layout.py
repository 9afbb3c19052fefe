"""The house rules a newcomer can rely on, checked on the source tree."""

from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

import orchestrator

PACKAGE = Path(orchestrator.__file__).parent


def test_http_statuses_live_only_in_the_frontend():
    offenders = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                 if not path.relative_to(PACKAGE).as_posix().startswith(("frontend/", "openengine/v1/", "sim/",
                                                                          "bench/"))
                 and "ApiError" in path.read_text()]
    assert offenders == []


def test_every_test_file_sits_in_a_layer():
    """tests/unit or tests/e2e (docs/testing.md); tests/ itself holds only the helpers both import."""
    tests = Path(__file__).resolve().parents[1]
    assert sorted(path.name for path in tests.glob("test_*.py")) == []


def test_the_coordinator_stays_small():
    assert len((PACKAGE / "flow" / "coordinator.py").read_text().splitlines()) <= 200


# ---- layers call down, never up -------------------------------------------------------------------------
# The contracts are pyproject.toml's [tool.importlinter] (scripts/lint.sh runs them as `lint-imports`): the layers
# frontend > flow > prefill | decode > kv > workers | convert > discovery > engine > transport over the leaves, with
# the entry points on top; the simulator imported only where stepping its scheduler needs it; nothing importing the
# testkit, the bench or (but check-config) the launcher; no cycle between the modules of any package. Here they run
# on the package's real import graph, and on that graph with one import added, to show that they can fail.
PYPROJECT = PACKAGE.parent / "pyproject.toml"
CONTRACT_TYPES = {contract.type_name: contract for contract in (LayersContract, ForbiddenContract,
                                                                   AcyclicSiblingsContract)}


def _contracts() -> dict[str, Contract]:
    configuration = read_configuration(str(PYPROJECT))
    return {options["id"]: CONTRACT_TYPES[options["type"]](options["name"], configuration["session_options"], options)
            for options in configuration["contracts_options"]}


@pytest.fixture
def import_graph() -> grimp.ImportGraph:
    """The package's imports as the contracts see them (each test its own: a check removes ignored imports)."""
    return grimp.build_graph("orchestrator", cache_dir=None)


def _broken(contract_id: str, graph: grimp.ImportGraph) -> bool:
    return not _contracts()[contract_id].check(graph, verbose=False).kept


def test_every_contract_names_a_type_this_test_knows():
    assert {options["type"] for options in read_configuration(str(PYPROJECT))["contracts_options"]} <= set(
        CONTRACT_TYPES)


@pytest.mark.parametrize("contract_id", sorted(_contracts()))
def test_the_package_keeps_every_import_contract(contract_id, import_graph):
    assert not _broken(contract_id, import_graph)


@pytest.mark.parametrize(("importer", "imported"), [
    ("orchestrator.transport.calls", "orchestrator.engine.events"),  # one layer up
    ("orchestrator.kv.release", "orchestrator.decode.stage"),  # the cycle there was
    ("orchestrator.engine.capabilities", "orchestrator.workers.pool"),  # the other cycle there was
    ("orchestrator.decode.stage", "orchestrator.prefill.stage"),  # two stages of one layer are independent
    ("orchestrator.config", "orchestrator.workers.pool"),  # a leaf is a leaf
])
def test_the_layers_catch_an_import_that_goes_up(import_graph, importer, imported):
    import_graph.add_import(importer=importer, imported=imported)
    assert _broken("layers", import_graph)


def test_the_layers_catch_an_upward_import_through_a_third_module(import_graph):
    import_graph.add_import(importer="orchestrator.roles", imported="orchestrator.sim.server")
    import_graph.add_import(importer="orchestrator.sim.server", imported="orchestrator.frontend.app")
    assert _broken("layers", import_graph)


def test_the_frontend_may_import_the_layers_below_it(import_graph):
    import_graph.add_import(importer="orchestrator.frontend.app", imported="orchestrator.transport.calls")
    assert not _broken("layers", import_graph)


def test_a_new_module_at_the_root_must_take_a_place_in_the_layers(import_graph):
    import_graph.add_module("orchestrator.newcomer")
    assert _broken("layers", import_graph)


@pytest.mark.parametrize("importer", ["orchestrator.flow.coordinator", "orchestrator.workers.pool",
                                      "orchestrator.bench.loadgen", "orchestrator.testkit.plugin"])
def test_only_the_launcher_the_planner_and_the_reuse_bench_import_the_simulator(import_graph, importer):
    import_graph.add_import(importer=importer, imported="orchestrator.sim.scheduler")
    assert _broken("sim-leaf", import_graph)


def test_the_simulator_catches_an_import_of_the_request_path(import_graph):
    import_graph.add_import(importer="orchestrator.sim.cli", imported="orchestrator.workers.routing")
    assert _broken("sim-outside-the-request-path", import_graph)


@pytest.mark.parametrize(("importer", "imported", "contract_id"), [
    ("orchestrator.serve", "orchestrator.testkit.fakes", "nothing-imports-the-testkit-or-the-bench"),
    ("orchestrator.frontend.app", "orchestrator.bench.loadgen", "nothing-imports-the-testkit-or-the-bench"),
    ("orchestrator.bench.cli", "orchestrator.launch", "launcher"),
    ("orchestrator.workers.states", "orchestrator.workers.pool", "acyclic"),
])
def test_the_other_contracts_catch_what_they_forbid(import_graph, importer, imported, contract_id):
    import_graph.add_import(importer=importer, imported=imported)
    assert _broken(contract_id, import_graph)
