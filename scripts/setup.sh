#!/usr/bin/env bash
# Install what the project needs on a fresh Debian machine into .venv:
#   scripts/setup.sh          everything the tests need: etcd (etcd-server, and etcd-client for etcdctl) and
#                             redis-server from Debian, and the package with its test and benchmark extras
#   scripts/setup.sh --demo   only what the demo needs: the package itself
# A .venv already installed from this very pyproject.toml with those extras is left as it is (the stamp file
# .venv/.orchestrator-installed says what was installed); delete .venv to install afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="test,bench"
if [ "${1:-}" = "--demo" ]; then
  extras=""
fi

# etcd (discovery) and Redis (the Responses API's shared store) are real servers in the tests
if [ -n "$extras" ] && ! { command -v etcd && command -v etcdctl && command -v redis-server; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client redis-server >/dev/null
fi

stamp=.venv/.orchestrator-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ]; then
  read -r have have_extras < "$stamp" || true
  # the same pyproject, and every extra asked for (the full install covers the demo's)
  if [ "$have" = "$want" ] && { [ -z "$extras" ] || [ "${have_extras:-}" = "$extras" ]; }; then
    exit 0
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
echo "$want $extras" > "$stamp"
