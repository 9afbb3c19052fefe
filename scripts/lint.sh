#!/usr/bin/env bash
# Style and type gates (what CI runs before the tests): ruff's lint rules over the tree and mypy over the
# orchestrator package, its tests and the benchmarks, both configured in pyproject.toml. Set-up first (nothing
# when .venv has it already).
# Fix what ruff can fix safely with: .venv/bin/ruff check --fix
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
