#!/usr/bin/env bash
# The whole test suite: lint, types, codegen drift, unit and process tests.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
PYTHON="$PWD/.venv/bin/python" scripts/typecheck.sh
# Byte-compile our sources once: with PYTHONDONTWRITEBYTECODE set (as on CI
# machines) each of the suite's ~1,000 Python processes would otherwise compile
# them again (about 0.1 s of CPU each).
.venv/bin/python -m compileall -q -j 0 rendezvousd client trainer tests >/dev/null
# Three workers on two cores: most tests wait on processes, sockets and timeouts;
# worksteal keeps the long process tests from piling up at the end.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist worksteal "$@"
