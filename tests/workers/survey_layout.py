"""Two gloo ranks, each with its own output directory (`<root>/<case>/node<rank>`), for each case named on the
command line (a case ending in `_fresh` as --overwrite_output_dir): runs `output_dir.survey` and prints one json
line per rank and case: what it returned, or the refusal. Run by test_layouts_and_faults."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ds_inference_integration.errors import InferenceSetupError
from ds_inference_integration.run import output_dir
from ds_inference_integration.topology import Topology

dist.init_process_group("gloo")
rank = dist.get_rank()
root = Path(sys.argv[1])
for case in sys.argv[2:]:
    mine = root / case / f"node{rank}"
    try:
        out = {"result": output_dir.survey(mine, Topology.from_env(), "predict_parts", fresh=case.endswith("_fresh"))}
    except InferenceSetupError as e:
        out = {"refused": str(e)}
    out["parts_left"] = (mine / "predict_parts").exists()
    # one write per line: the two ranks share the pipe (a write of under 4 KiB is never interleaved)
    os.write(1, (json.dumps({"case": case, "rank": rank, **out}) + "\n").encode())
dist.destroy_process_group()
os._exit(0)
