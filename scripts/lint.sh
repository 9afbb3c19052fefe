#!/usr/bin/env bash
# Style, type and layer gates (what CI runs before the tests): ruff's lint rules over the tree, mypy over the
# orchestrator package, its tests and the benchmarks, and import-linter's contracts (the layers, the leaves, no
# package cycle: docs/architecture.md), all configured in pyproject.toml. Set-up first (nothing when .venv has
# it already).
# Fix what ruff can fix safely with: .venv/bin/ruff check --fix
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
