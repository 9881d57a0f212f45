# Sourced by demo.sh and test.sh: make .venv and install the project into it.
# Idempotent and quiet; a fresh machine needs only python3 (>= 3.11) and the
# package index.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# $1: the extra to install with the project (none when absent).
extra=${1:-}
stamp=.venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${extra:-base}
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
