#!/usr/bin/env bash
# One machine, N GPUs (or N CPU ranks when there is no GPU), DeepSpeed's launcher.
# Use this by default: it sets LOCAL_SIZE, which DeepSpeed's fast CPU all-reduce needs.
#   NUM_GPUS=4 launch/single_node.sh --output_dir out --do_predict [--tp_size 2 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU ranks (no GPU): give each rank its share of the cores, as torchrun does.
python -c 'import torch, sys; sys.exit(torch.cuda.is_available())' 2>/dev/null && \
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / ${NUM_GPUS:-2} > 0 ? $(nproc) / ${NUM_GPUS:-2} : 1 ))}"
exec deepspeed --num_gpus "${NUM_GPUS:-2}" examples/run_translation.py \
  --predict_with_generate --source_lang en --target_lang ro \
  --source_prefix 'translate English to Romanian: ' --deepspeed_inference "$@"
