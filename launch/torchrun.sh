#!/usr/bin/env bash
# One machine with torchrun (PyTorch's launcher), e.g. inside a cluster job that already uses it.
# Results are identical to the deepspeed launcher; on CPU the all-reduce falls back to gloo.
#   NPROC=4 launch/torchrun.sh --output_dir out --do_predict --tp_size 2
set -euo pipefail
cd "$(dirname "$0")/.."
exec torchrun --nproc_per_node "${NPROC:-2}" examples/run_translation.py \
  --predict_with_generate --source_lang en --target_lang ro \
  --source_prefix 'translate English to Romanian: ' --deepspeed_inference "$@"
