#!/usr/bin/env bash
# The whole test suite: lint, types, codegen drift, unit and process tests.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
PYTHON="$PWD/.venv/bin/python" scripts/typecheck.sh
# Two workers: most tests wait on processes, sockets and timeouts, not the CPU.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"
