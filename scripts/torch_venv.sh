#!/usr/bin/env bash
# The one torch venv, for the torchrun tests and the benchmarks' side-by-side anchors
# (TCPStore, torchrun's c10d rendezvous, gloo). Kept apart from .venv so the product's
# own venv never depends on torch, and keyed on torch's version so later runs on the
# same machine reuse it. Prints the venv's python on stdout; quiet otherwise.
#
# torch==2.13.0 is the CPU build on these machines (a wheel on local disk, ~40 s to
# install, ~0.9 GB); any other version (RENDEZVOUSD_TORCH_VERSION) may be the CUDA
# build, several GB, which `import torch` needs even on a CPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
version=${RENDEZVOUSD_TORCH_VERSION:-2.13.0}
venv=.venv-torch-$version
stamp=$venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" >&2
  # torch first: the `torch` extra's range is then already met and pulls nothing.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[torch]" >&2
  touch "$stamp"
fi
echo "$PWD/$venv/bin/python"
