"""One rank, tp 1 (a one-GPU machine): `load_model` + `setup_inference` (no Trainer) in each loading mode against
`from_pretrained(dtype=...)` in the same process, for each model directory given after the dtype; prints one json
line per model and mode. Run by test_loading (one process for its models: each Python's imports cost ~5 CPU-s)."""

import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ds_inference_integration import setup_inference
from ds_inference_integration.arguments import DTYPES, DeepSpeedInferenceArguments
from ds_inference_integration.load.loaders import load_model
from ds_inference_integration.topology import Topology

dtype, model_dirs = DTYPES[sys.argv[1]], sys.argv[2:]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1")
torch.distributed.init_process_group("gloo")
topology = Topology.from_env()
ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
args = DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=1, inference_dtype=sys.argv[1])
for model_dir in model_dirs:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    buffers = {n: b.dtype for n, b in reference.named_buffers() if b.is_floating_point()}
    config = AutoConfig.from_pretrained(model_dir)
    for mode in ("full", "shard-aware"):
        model = load_model(AutoModelForCausalLM, model_dir, config, inference_args=args, dtype=dtype, mode=mode)
        model = setup_inference(model, args, topology, torch.device("cpu")).model  # no Trainer needed
        with torch.no_grad():
            got = model(input_ids=ids).logits
        print(json.dumps({"model": os.path.basename(model_dir), "mode": mode,
                          "max_abs_diff": float((got.float() - want.float()).abs().max()),
                          "buffers_as_reference": all(model.get_buffer(n).dtype == d for n, d in buffers.items()),
                          "buffers": sorted(buffers)}), flush=True)
