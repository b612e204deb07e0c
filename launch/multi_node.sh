#!/usr/bin/env bash
# Several machines: run this on the first host; DeepSpeed starts the ranks on every host listed in
# the hostfile over passwordless ssh (see launch/hostfile.example). Keep --tp_size within one node
# (e.g. 8) so all-reduces stay on the fast intra-node links; the nodes become data-parallel replicas.
#   HOSTFILE=launch/hostfile launch/multi_node.sh --output_dir out --do_predict --tp_size 8
set -euo pipefail
cd "$(dirname "$0")/.."
exec deepspeed --hostfile "${HOSTFILE:-launch/hostfile}" examples/run_translation.py \
  --predict_with_generate --source_lang en --target_lang ro \
  --source_prefix 'translate English to Romanian: ' --deepspeed_inference "$@"
