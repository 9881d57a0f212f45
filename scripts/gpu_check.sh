#!/usr/bin/env bash
# Single-GPU check (< 5 minutes): the GPU tests, then world-1 NCCL timings as
# JSON on stdout. Exits non-zero, saying why, when no GPU is usable.
# Extra arguments go to benchmarks/gpu_check.py (e.g. --sizes-mib 1 64).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}

fail() {
  echo "gpu_check: $*" >&2
  exit 1
}

# Checked before anything is installed: without a driver there is nothing to test.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  fail "no NVIDIA GPU or driver visible (nvidia-smi -L failed)"
fi

if ! "$py" -c "import cupy" >/dev/null 2>&1; then
  echo "gpu_check: CuPy not found, installing cupy-cuda12x into $("$py" -c 'import sys; print(sys.prefix)')" >&2
  "$py" -m pip install --quiet cupy-cuda12x || fail "could not install cupy-cuda12x"
fi

# Without an install, lay out the installed package shape (client/ and trainer/
# live outside rendezvousd/) as links, the way scripts/typecheck.sh does.
if ! "$py" -c "import rendezvousd.trainer.nccl" >/dev/null 2>&1; then
  tree=$(mktemp -d)
  trap 'rm -rf "$tree"' EXIT
  mkdir "$tree/rendezvousd"
  for entry in "$root"/rendezvousd/*; do
    ln -s "$entry" "$tree/rendezvousd/$(basename "$entry")"
  done
  ln -s "$root/client" "$tree/rendezvousd/client"
  ln -s "$root/trainer" "$tree/rendezvousd/trainer"
  export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
fi

devices=$("$py" -c "from rendezvousd.trainer import nccl; print(nccl.device_count())") ||
  fail "cannot import rendezvousd.trainer.nccl"
[ "$devices" -ge 1 ] || fail "CuPy sees no CUDA device"
echo "gpu_check: $devices CUDA device(s)" >&2

cd "$root"
export RENDEZVOUSD_REQUIRE_GPU=1
if "$py" -c "import pytest" >/dev/null 2>&1; then
  # --noconftest: the GPU tests need nothing from the daemon-side fixtures.
  timeout 150 "$py" -m pytest -q -p no:cacheprovider --noconftest -rs tests/trainer/test_gpu.py >&2 ||
    fail "tests/trainer/test_gpu.py failed"
else
  fail "pytest is not installed in $py's environment"
fi
timeout 150 "$py" benchmarks/gpu_check.py "$@" || fail "benchmarks/gpu_check.py failed"
