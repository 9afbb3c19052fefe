#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 into .venv-dynamo for benchmarks/vs_dynamo.py (never a dependency of the project,
# never part of the test run). A .venv-dynamo already stamped with this version is left as it is.
#
# Only the frontend (`python -m dynamo.frontend`) and the mock engine (`python -m dynamo.mocker`) are used, with
# file discovery, the TCP request plane and the ZMQ event plane: neither etcd nor NATS is needed.
#
# ai-dynamo 1.6.1 also requires `aisimulate`, a placeholder on PyPI whose build downloads the real wheel from
# NVIDIA's own package index; only Dynamo's planner imports it. So ai-dynamo goes in without its dependencies and
# then every other requirement of its wheel (no extras) is installed from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.6.1
venv=.venv-dynamo
stamp=$venv/.dynamo-installed
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
rm -f "$stamp"
"$venv/bin/python" -m pip install -q --upgrade pip packaging
"$venv/bin/python" -m pip install -q --no-deps "ai-dynamo==$version" "ai-dynamo-runtime==$version"
# the requirements of both wheels that apply here (markers evaluated, extras left out), less aisimulate
mapfile -t requirements < <("$venv/bin/python" - <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement

for distribution in ("ai-dynamo", "ai-dynamo-runtime"):
    for line in requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.name == "aisimulate" or requirement.name.startswith("ai-dynamo"):
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            print(str(requirement).split(";")[0].strip())
EOF
)
"$venv/bin/python" -m pip install -q "${requirements[@]}"
"$venv/bin/python" -c "import dynamo.frontend, dynamo.mocker"
echo "$version" > "$stamp"
