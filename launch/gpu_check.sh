#!/usr/bin/env bash
# The GPU check (launch/gpu_check.py): the plugin as a user runs it on one GPU (examples in bf16/fp16 vs plain
# generate; tp 2 with both ranks on the GPU; a real-shape 1B model through the bf16 verdict; decode speed against
# the bandwidth bound, eager and compiled; loading onto CUDA; kernel injection), then a bare ~1B engine; one json
# file, under 8 minutes.
#   launch/gpu_check.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 "${PYTHON:-python3}" launch/gpu_check.py --out "${1:-gpu_check.json}" "${@:2}"
