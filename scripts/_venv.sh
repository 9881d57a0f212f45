# Sourced by demo.sh and test.sh: make .venv and install the project into it.
# Idempotent and quiet; a fresh machine needs only python3 (>= 3.11) and the
# package index.
# Usage: source _venv.sh EXTRA   (always pass it, "" for none: a script sourcing this
# without arguments would hand it its own "$1", such as demo.sh's --hosts)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$#" -ne 1 ]; then
  echo "_venv.sh: source it with exactly one argument, the extra to install (\"\" for none)" >&2
  return 2 2>/dev/null || exit 2
fi
# $1: the extra to install with the project (none when empty).
extra=$1
if ! [[ "$extra" =~ ^([a-z0-9][a-z0-9_-]*)?$ ]]; then
  echo "_venv.sh: '$extra' is not an extra of pyproject.toml (pass \"\" for none)" >&2
  return 2 2>/dev/null || exit 2
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
prefix=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
stamp=$prefix-${extra:-base}
# The base install is part of every extra's: a .venv set up for the tests serves the demo.
if [ -z "$extra" ] && compgen -G "$prefix-*" >/dev/null; then
  stamp=$(compgen -G "$prefix-*" | head -n1)
fi
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
