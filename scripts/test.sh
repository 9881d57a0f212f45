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
# Headless Chromium (the Debian package) for tests/daemon/test_status_browser.py,
# which skips without it. Measured on a fresh machine: 2 min 45 s of wall time
# (apt-get update and install, ~45 s of CPU), on the side like the torch venv;
# nothing once installed. A failed install only makes that test skip.
# As root the cross-host tests must run, not skip (tests/support.need_hosts): they
# alone back the cut-off node, the cut between nodes and the README's --hosts demo.
# They need iproute2's `ip`, installed here beside Chromium where it is missing, and
# iptables for the firewall's resets (tests/multihost/test_faults.py; skipped without).
chromium_out=$(mktemp)
chromium=
packages=
[ -x /usr/bin/chromium ] || packages="chromium"
command -v ip >/dev/null || packages="$packages iproute2"
command -v iptables >/dev/null || packages="$packages iptables"
if [ -n "$packages" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # shellcheck disable=SC2086  # the package names, split on purpose
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages) \
    >"$chromium_out" 2>&1 &
  chromium=$!
fi
if [ "$(id -u)" = 0 ]; then
  export RENDEZVOUSD_TEST_REQUIRE_HOSTS=1
fi
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
if [ -n "$chromium" ] && ! wait "$chromium"; then
  echo "apt-get install $packages failed; the browser test will skip, the cross-host" \
    "tests fail without ip:" >&2
  tail -n 3 "$chromium_out" >&2
fi
rm -f "$chromium_out"
RENDEZVOUSD_TEST_TORCH_PYTHON=$(cat "$torch_out")
export RENDEZVOUSD_TEST_TORCH_PYTHON
rm -f "$torch_out"
# Four workers on two cores: many tests wait on processes, sockets and timeouts
# (four measured 126-133 s where three took 137-144 s, five no faster); worksteal
# keeps the long process tests from piling up at the end.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 4 --dist worksteal "$@"
