#!/usr/bin/env bash
# The GPU check (<= 5 minutes) for a machine with a GPU and no network: its Python
# must already have CuPy with NCCL (e.g. cupy-cuda13x + nvidia-nccl-cu13). The
# project's other dependencies come from the wheels scripts/gpu_wheels.sh fetched where
# an index is reachable ($GPU_WHEELS, default artifacts/gpu-wheels), installed with
# --no-index when that folder exists; else they must be installed already. Nothing is
# downloaded: what is missing or too old is named, exactly.
#
#   1. the GPU tests (tests/trainer/test_gpu.py, test_gpu_example.py) and the check of
#      our CuPy seam and its fake against the installed CuPy (test_cupy_api.py);
#   2. 1 node x 2 ranks on one GPU through `rendezvous-run --backend nccl`, with the
#      gradient equality check against a single-process baseline, and the contract
#      suite's cross-rank semantics on the real NCCL (tests/workers/collective_semantics.py:
#      a broadcast whose ranks disagree on the root fails at once; integer AVG divides
#      towards zero);
#   3. benchmarks/recovery.py --backend nccl: kills (a worker, a node replaced, a node
#      lost) in 3 simulated nodes x 2 NCCL ranks on the one GPU, through a daemon, and
#      torchrun's NCCL workers restarted after a kill (our handler and c10d's);
#   4. benchmarks/gpu_check.py at world 2: bucketed vs raw all-reduce, pack/unpack
#      vs a device-to-device copy.
#
# Writes one JSON result to $OUT/gpu_check.json (else artifacts/gpu_check.json) and
# exits non-zero when a step failed or something is missing. The whole run keeps to
# $GPU_CHECK_BUDGET_S (300 s): each step's own limit is cut to what is left, and a step
# with nothing left is recorded as skipped (their own limits add up to 590 s, so one
# hanging step could have taken the device session with it).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET_S:-300}
# What the JSON result and the logs' archive need at the end, kept out of the steps.
reserve=15
deadline=$(($(date +%s) + budget - reserve))
left() { echo $((deadline - $(date +%s))); }
# A limit of at most $1 s within what is left, and never 0 (to timeout, no limit).
cap() {
  local l
  l=$(left)
  [ "$l" -gt "$1" ] && l=$1
  [ "$l" -lt 1 ] && l=1
  echo "$l"
}
wheels=${GPU_WHEELS:-$root/artifacts/gpu-wheels}
out_dir=${OUT:-$root/artifacts}
mkdir -p "$out_dir"
result="$out_dir/gpu_check.json"
# Run Python from outside the checkout: its top-level rendezvousd/ folder would
# shadow the installed package (client/ and trainer/ are mapped into it).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1

steps_json="[]"
now_ms() { echo $(($(date +%s%N) / 1000000)); }
record() { # name status milliseconds detail
  steps_json=$("$py" -c 'import json,sys; s=json.loads(sys.argv[1]); s.append({"step":sys.argv[2],"status":sys.argv[3],"seconds":int(sys.argv[4])/1000,"detail":sys.argv[5]}); print(json.dumps(s))' \
    "$steps_json" "$1" "$2" "$3" "$4")
}
finish() { # status [missing...]
  local status=$1
  shift
  # Every step's whole log (and recovery.py's runs), for a post-mortem of a device
  # session that cannot be repeated at will.
  tar -czf "$out_dir/gpu_check_logs.tgz" --exclude=./recovery/token -C "$work" . 2>/dev/null
  "$py" - "$status" "$steps_json" "$result" "$@" <<'PY'
import json, sys, pathlib
status, steps, path, *missing = sys.argv[1:]
doc = {"check": "gpu_check", "status": status, "missing": missing, "steps": json.loads(steps)}
bench = pathlib.Path(path).with_name("gpu_bench.json")
if bench.exists():
    doc["benchmark"] = json.loads(bench.read_text())
pathlib.Path(path).write_text(json.dumps(doc, indent=2) + "\n")
print(json.dumps(doc, indent=2))
PY
  echo "gpu_check: $status (result in $result)" >&2
  [ "$status" = "passed" ]
  exit $?
}

# -- the wheels brought along (scripts/gpu_wheels.sh) ---------------------------
if [ -f "$wheels/requirements.txt" ]; then
  started=$(now_ms)
  if timeout "$(cap 120)" "$py" -m pip install -q --disable-pip-version-check --no-index \
    --find-links "$wheels" -r "$wheels/requirements.txt" >"$work/wheels.log" 2>&1; then
    record wheels passed $(($(now_ms) - started)) "from $wheels"
  else
    record wheels failed $(($(now_ms) - started)) "$(tail -c 1500 "$work/wheels.log")"
  fi
fi

# -- what must be present ------------------------------------------------------
missing=()
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  missing+=("an NVIDIA driver (nvidia-smi -L failed)")
fi
# What CuPy lacks, one line each, with CuPy's or CUDA's own words for why: a CuPy
# that is installed but fails to import, a driver CUDA finds too old, a library that
# does not load are each named as what they are.
cupy_missing() {
  timeout "$(cap 60)" "$py" - "$py" 2>/dev/null <<'PY'
import importlib, importlib.util, sys

def why(exc):
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]

try:
    import cupy
except Exception as exc:
    if importlib.util.find_spec("cupy") is None:
        print(f"CuPy in {sys.argv[1]} (cupy-cuda13x or cupy-cuda12x, >= 13.5)")
    else:
        print(f"a CuPy that imports in {sys.argv[1]} (import cupy: {why(exc)})")
    sys.exit()
try:
    major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    cu, toolkit = f"cu{major}", f"a CUDA toolkit, or pip install 'cupy-cuda{major}x[ctk]'"
except Exception:
    cu, toolkit = "cu12 or -cu13", "a CUDA toolkit"
try:
    if cupy.cuda.runtime.getDeviceCount() == 0:
        print("a CUDA device (CuPy sees none)")
except Exception as exc:
    print(f"a CUDA device that CuPy can use (getDeviceCount: {why(exc)})")
try:
    nccl = importlib.import_module("cupy.cuda.nccl")
    if not getattr(nccl, "available", True):
        raise ImportError("CuPy cannot load libnccl.so.2")
    nccl.get_version()
except Exception as exc:
    print(f"NCCL for CuPy (nvidia-nccl-{cu}, or a system NCCL; {why(exc)})")
try:
    cupy.cuda.nvrtc.getVersion()
except Exception as exc:
    print(f"NVRTC, which CuPy compiles its kernels with (nvidia-cuda-nvrtc-{cu}, or {toolkit}; {why(exc)})")
try:
    cupy.cuda.cublas  # loaded on first use, which finds the library first
except Exception as exc:
    print(f"cuBLAS, which the example's matrix products need (nvidia-cublas-{cu}, or {toolkit}; {why(exc)})")
PY
}
while IFS= read -r line; do missing+=("$line"); done < <(cupy_missing)
probe() { timeout "$(cap 60)" "$py" -c "$1" >/dev/null 2>&1; }
bring="scripts/gpu_wheels.sh, run where a package index is reachable, fetches it into $wheels"
for pair in grpc:grpcio grpc_health:grpcio-health-checking grpc_reflection:grpcio-reflection \
  grpc_status:grpcio-status google.rpc:googleapis-common-protos google.protobuf:protobuf \
  prometheus_client:prometheus-client numpy:numpy pytest:pytest setuptools:setuptools; do
  probe "import ${pair%%:*}" || missing+=("the Python module ${pair%%:*} (${pair#*:}; $bring)")
done
probe "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" ||
  missing+=("setuptools >= 77 (to install the project without build isolation)")
# The generated code's own floors (it refuses older runtimes at import).
gen=$root/rendezvousd/_gen/rendezvous/v1
grpc_floor=$(sed -n "s/^GRPC_GENERATED_VERSION = '\([0-9.]*\)'$/\1/p" "$gen/rendezvous_pb2_grpc.py")
proto_floor=$(sed -n 's/^# Protobuf Python Version: \([0-9.]*\)$/\1/p' "$gen/rendezvous_pb2.py")
too_old() {
  timeout "$(cap 60)" "$py" - "$grpc_floor" "$proto_floor" "$bring" 2>/dev/null <<'PY'
import importlib, re, sys

def parts(version):
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])

grpc_floor, proto_floor, bring = sys.argv[1:]
for dist, module, floor in (("grpcio", "grpc", grpc_floor), ("protobuf", "google.protobuf", proto_floor)):
    try:
        found = str(importlib.import_module(module).__version__)
    except Exception:
        continue  # named above as a missing module
    if parts(found) < parts(floor):
        print(f"{dist} >= {floor}, found {found}, which rendezvousd/_gen's generated code refuses ({bring})")
PY
}
while IFS= read -r line; do missing+=("$line"); done < <(too_old)
if [ ${#missing[@]} -gt 0 ]; then
  finish missing "${missing[@]}"
fi

# -- the project, installed without the network ---------------------------------
started=$(now_ms)
if ! timeout "$(cap 120)" "$py" -m pip install -q --no-deps --no-build-isolation -e "$root" \
  >"$work/install.log" 2>&1; then
  record install failed 0 "$(tail -c 1500 "$work/install.log")"
  finish failed
fi
record install passed $(($(now_ms) - started)) ""

run_step() { # name timeout command...
  local name=$1 limit=$2
  shift 2
  local t0 code took remaining
  remaining=$(left)
  if [ "$remaining" -lt 5 ]; then
    record "$name" skipped 0 "the check's ${budget} s budget (GPU_CHECK_BUDGET_S) is spent"
    failed=1
    return
  fi
  [ "$remaining" -lt "$limit" ] && limit=$remaining
  t0=$(now_ms)
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  code=$?
  took=$(($(now_ms) - t0))
  if [ $code -eq 0 ]; then
    record "$name" passed "$took" "$(tail -c 600 "$work/$name.log")"
  else
    record "$name" failed "$took" "exit $code (limit ${limit} s): $(tail -c 1500 "$work/$name.log")"
    failed=1
  fi
}
failed=0

# 1. The GPU tests (--noconftest: they need none of the daemon-side fixtures).
RENDEZVOUSD_REQUIRE_GPU=1 run_step gpu_tests 120 \
  "$py" -m pytest -q -p no:cacheprovider --noconftest -rs --rootdir "$root" \
  "$root/tests/trainer/test_gpu.py" "$root/tests/trainer/test_gpu_example.py" \
  "$root/tests/trainer/test_cupy_api.py"

# 2. 1 node x 2 ranks on one GPU: each rank its own NCCL "host" (NCCL_HOSTID).
run_step train_world2 90 env RENDEZVOUSD_NCCL_SHARED_DEVICE=1 \
  "$py" -m rendezvousd.trainer.agent.launcher --standalone --nproc-per-node 2 --backend nccl \
  -m rendezvousd.trainer.example --steps 20 --result-dir "$work/results"
if [ -f "$work/results/rank-0.json" ]; then
  diff=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["max_abs_grad_diff_vs_single_process"])' "$work/results/rank-0.json")
  if "$py" -c "import sys; sys.exit(0 if float('$diff') <= 1e-4 else 1)"; then
    record grad_equality passed 0 "max |grad - single-process grad| = $diff"
  else
    record grad_equality failed 0 "max |grad - single-process grad| = $diff > 1e-4"
    failed=1
  fi
fi

# What tests/contract asserts through a fake NCCL, on the real one (2 ranks, 1 GPU).
run_step semantics_world2 60 env RENDEZVOUSD_NCCL_SHARED_DEVICE=1 \
  "$py" -m rendezvousd.trainer.agent.launcher --standalone --nproc-per-node 2 --backend nccl \
  "$root/tests/workers/collective_semantics.py"

# 3. Faults on NCCL: 3 simulated nodes x 2 ranks on the one GPU through a daemon; a
#    worker SIGKILLed mid-run, a node's agent SIGKILLed and replaced, a node lost for good
#    (elastic 2:3). Each run must train again (its verdicts are in the JSON).
#    torchrun's own NCCL workers, through our handler and through c10d (the setting it
#    needs to restart at all), after a worker's SIGKILL; skipped where torch is missing.
run_step recovery_nccl 200 "$py" "$root/benchmarks/recovery.py" --backend nccl \
  --scenarios fault_free,worker_kill,node_kill_replaced,node_kill_shrink \
  --torchrun-backends rendezvousd,c10d-unshared-store --torchrun-faults worker_kill \
  --keep "$work/recovery" --json-out "$out_dir/recovery_nccl.json"
if [ -f "$out_dir/recovery_nccl.json" ]; then
  # Every launcher must have ended 0 and every fault run trained again.
  if verdict=$("$py" - "$out_dir/recovery_nccl.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
names = ("fault_free", "worker_kill", "node_kill_replaced", "node_kill_shrink")
seen, bad = [], []
for name in names:
    run = report.get(name)
    if run is None:
        bad.append(f"{name}: no result")
        continue
    codes = run.get("exit_codes", {})
    if not codes or any(code != 0 for code in codes.values()):
        bad.append(f"{name}: launcher exit codes {codes}")
    if name != "fault_free" and "recovery_s" not in run:
        bad.append(f"{name}: did not train again")
    seen.append(f"{name} recovery_s={run.get('recovery_s', '-')} lost={run.get('steps_lost', '-')}")
for name, run in report.get("torchrun", {}).items():
    if not isinstance(run, dict):
        continue
    seen.append(f"torchrun {name} restarted {run['restarted']} in {run['recovery_s_median']} s")
    runs = run["runs"]
    if name.startswith("rendezvousd") and not all(r.get("restarted") for r in runs):
        bad.append(f"torchrun {name}: {[r.get('error') for r in runs]}")
print("; ".join(bad or seen))
sys.exit(1 if bad else 0)
PY
  ); then
    record recovery_nccl_verdict passed 0 "$verdict"
  else
    record recovery_nccl_verdict failed 0 "$verdict"
    failed=1
  fi
fi

# 4. The benchmark at world 2.
run_step benchmark 120 "$py" "$root/benchmarks/gpu_check.py" --world 2 \
  --json-out "$out_dir/gpu_bench.json" "$@"

if [ $failed -eq 0 ]; then finish passed; else finish failed; fi
