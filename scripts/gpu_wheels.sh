#!/usr/bin/env bash
# The wheels a GPU machine without a network needs for scripts/gpu_check.sh, fetched
# here, where a package index is reachable, into an ignored folder to carry there.
#
#   bash scripts/gpu_wheels.sh [DIR]      (DIR: artifacts/gpu-wheels by default)
#
# The lent GPU image has Python 3.12 with CuPy (cupy-cuda13x, and so numpy), NCCL and
# torch, but not the project's gRPC extras (grpcio-health-checking, grpcio-reflection,
# grpcio-status, googleapis-common-protos), and its grpcio and protobuf may be older
# than the generated code accepts. So: the project's runtime dependencies, pytest and
# setuptools, for CPython 3.12 on manylinux x86_64, binary wheels only, with their own
# dependencies; numpy is left out (CuPy does not import without it, and it is 16 MB of
# the budget: everything here must travel with the working tree, 64 MiB in all).
# DIR/requirements.txt lists what gpu_check.sh installs from DIR with --no-index.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/artifacts/gpu-wheels}
py=${PYTHON:-python3}
# The generated code's floors (rendezvousd/_gen), so this list cannot fall behind them.
gen=$root/rendezvousd/_gen/rendezvous/v1
grpc_floor=$(sed -n "s/^GRPC_GENERATED_VERSION = '\([0-9.]*\)'$/\1/p" "$gen/rendezvous_pb2_grpc.py")
proto_floor=$(sed -n 's/^# Protobuf Python Version: \([0-9.]*\)$/\1/p' "$gen/rendezvous_pb2.py")
if [ -z "$grpc_floor" ] || [ -z "$proto_floor" ]; then
  echo "gpu_wheels.sh: cannot read the generated code's grpcio/protobuf floors in $gen" >&2
  exit 1
fi
proto_major=${proto_floor%%.*}
mkdir -p "$dir"
rm -f "$dir"/*.whl
cat >"$dir/requirements.txt" <<EOF
grpcio>=$grpc_floor
grpcio-health-checking>=$grpc_floor
grpcio-reflection>=$grpc_floor
grpcio-status>=$grpc_floor
protobuf>=$proto_floor,<$((proto_major + 1))
googleapis-common-protos>=1.63
prometheus-client>=0.20
pytest>=8
setuptools>=77
EOF
# Each tag named: pip (23.2 here) does not widen a custom manylinux_2_28 platform to
# the manylinux2014 (glibc 2.17) tag grpcio's and protobuf's wheels carry.
"$py" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d "$dir" -r "$dir/requirements.txt"
total=$(du -cb "$dir"/*.whl | tail -n1 | cut -f1)
count=$(find "$dir" -name '*.whl' | wc -l)
echo "gpu_wheels.sh: $count wheels, $((total / 1048576)) MiB in $dir"
if [ "$total" -gt $((40 * 1048576)) ]; then
  echo "gpu_wheels.sh: over the 40 MiB that may travel to the device; trim the list" >&2
  exit 1
fi
