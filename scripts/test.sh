#!/usr/bin/env bash
# The whole test suite: lint, types, codegen drift, unit and process tests.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (as on CI
# machines): otherwise each of the suite's ~600 Python processes compiles our
# modules again (about 0.1 s of CPU each), and each pytest worker rewrites and
# compiles every test module again (about 2.5 s of CPU each).
unset PYTHONDONTWRITEBYTECODE
# The torch venv for the torchrun tests (scripts/torch_venv.sh: ~90 s on a fresh
# machine, reused after), made on the side while ruff and mypy run.
torch_out=$(mktemp)
bash scripts/torch_venv.sh >"$torch_out" &
torch_venv=$!
# On the second core while ruff and mypy run: byte-compile our sources, and
# collect once so pytest's assertion-rewritten test modules are cached for the
# workers below (a collection error is reported by the run itself).
(
  .venv/bin/python -m compileall -q -j 0 rendezvousd client trainer tests >/dev/null
  .venv/bin/python -m pytest -q -p no:cacheprovider --collect-only >/dev/null || true
) &
warm=$!
.venv/bin/ruff check .
.venv/bin/ruff format --check .
PYTHON="$PWD/.venv/bin/python" scripts/typecheck.sh
wait "$warm"
if ! wait "$torch_venv"; then
  echo "scripts/torch_venv.sh failed: the torchrun tests need it" >&2
  exit 1
fi
RENDEZVOUSD_TEST_TORCH_PYTHON=$(cat "$torch_out")
export RENDEZVOUSD_TEST_TORCH_PYTHON
rm -f "$torch_out"
# Four workers on two cores: many tests wait on processes, sockets and timeouts
# (four measured 126-133 s where three took 137-144 s, five no faster); worksteal
# keeps the long process tests from piling up at the end.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 4 --dist worksteal "$@"
