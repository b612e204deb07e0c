#!/usr/bin/env bash
# The GPU check: run on a machine with one GPU (H200 here), no network needed. About 1B parameters,
# fp16/bf16 x kernel injection on/off x batch 1-64; tokens/s and peak memory into one json file.
#   launch/gpu_check.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python launch/gpu_check.py --out "${1:-gpu_check.json}"
