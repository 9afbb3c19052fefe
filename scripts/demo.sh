#!/usr/bin/env bash
# The main job: the disaggregated demo (1 prefill + 1 decode simulated TRT-LLM worker + the
# orchestrator on http://127.0.0.1:8000). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo  # the package alone; nothing when .venv has it already
exec .venv/bin/orchestrator launch configs/disagg.yaml "$@"
