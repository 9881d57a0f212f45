#!/usr/bin/env bash
# The main job: rendezvousd + a simulated 2-node x 2-worker CPU training run,
# with rank 0's progress and a scorecard (artifacts/multinode_smoke.json).
# Usage: scripts/demo.sh [--steps N] [--out PATH] [--hosts N]
# --hosts N (as root): the same run with the daemon and N nodes on their own network
# hosts (Linux namespaces with their own addresses), torn down afterwards.
set -euo pipefail
# "" (no extra) explicitly: sourced without arguments, _venv.sh would get our "$1".
source "$(dirname "$0")/_venv.sh" ""
exec .venv/bin/python -m rendezvousd.trainer.demo "$@"
