#!/usr/bin/env bash
# mypy --strict over the three source folders as the one package they install as.
# mypy cannot follow setuptools' package-dir mapping (client/ -> rendezvousd.client),
# so we lay out the installed shape as a tree of directory links under build/ and
# check that. Directory links keep new files visible without reinstalling.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree="$root/build/typecheck"
rm -rf "$tree" && mkdir -p "$tree/rendezvousd"
for entry in "$root"/rendezvousd/*; do
  ln -s "$entry" "$tree/rendezvousd/$(basename "$entry")"
done
ln -s "$root/client" "$tree/rendezvousd/client"
ln -s "$root/trainer" "$tree/rendezvousd/trainer"
cd "$tree"
exec "${PYTHON:-python}" -m mypy --config-file "$root/pyproject.toml" -p rendezvousd "$@"
