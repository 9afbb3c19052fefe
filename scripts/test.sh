#!/usr/bin/env bash
# The whole test suite (what CI runs): set-up (nothing when .venv has it already), then pytest. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
