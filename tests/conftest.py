"""The suite's two layers (docs/testing.md): tests/unit (no worker, server or etcd process: fast) and tests/e2e
(real processes). Each test gets its layer's marker here, by its directory, so `-m unit` / `-m e2e` select them;
the helpers shared by both (serve_helpers, sim_helpers, ...) live in this directory and import as top-level
modules."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
LAYERS = ("unit", "e2e")
sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        layer = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        if layer in LAYERS:
            item.add_marker(layer)
