#!/usr/bin/env bash
# Install everything the project needs on a fresh Debian machine: etcd (for the etcd tests and
# configs) from Debian, and the package with its test and benchmark extras into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
