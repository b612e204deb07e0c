"""Setting up tensor-parallel inference, without a Trainer: flags checked against the device, policy resolved,
process groups (with the run's timeout) and the watchdog started, the model sharded in place. The Trainer
mixin calls `setup_inference`; a script without a Trainer can too."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..arguments import DeepSpeedInferenceArguments
from ..deepspeed_compat import init_deepspeed_comm
from ..load.loaders import pending_load
from ..policy.derive import policy_for_model
from ..policy.schema import Policy, check_head_counts, policy_for_run
from ..run import lifecycle, watchdog
from ..topology import ProcessGroups, Topology, init_process_groups
from .inject import ShardReport, shard_model

logger = logging.getLogger(__name__)


@dataclass
class InferenceSetup:
    model: nn.Module  # the sharded model (this rank's part)
    topology: Topology
    groups: ProcessGroups  # its TP and DP groups and the (dp_shard, tp) mesh; all None in a world of one
    report: ShardReport
    dtype: torch.dtype


def setup_inference(model: nn.Module, inference_args: DeepSpeedInferenceArguments, topology: Topology,
                    device: torch.device, *, fp16: bool = False, bf16: bool = False,
                    policy: Policy | str | None = None) -> InferenceSetup:
    """Shard `model` over this rank's TP group. Every rank calls this, in the same order. `policy`: a Policy,
    or None for `--injection_policy` (a file, `auto`, `autotp`) resolved here."""
    inf, device = inference_args, torch.device(device)
    dtype = inf.resolve_dtype(fp16=fp16, bf16=bf16)
    inf.check_device(on_gpu=device.type == "cuda", dtype=dtype)
    if policy is None and inf.injection_policy != "autotp":
        policy = policy_for_run(inf.injection_policy, model.config, topology.tp_size)
    else:
        check_head_counts(policy, model.config, topology.tp_size)
    policy = policy_for_model(policy, model, topology.tp_size)  # a Policy or None (AutoTP) from here on
    lifecycle.install_exit_rules()  # for a script that built its parser itself (the Trainer's own checks come first)
    groups = init_process_groups(topology, device.type, inf.inference_timeout)
    if topology.world_size > 1:  # before the watchdog: exit handlers run last first, so it marks this rank done first
        lifecycle.tear_down_at_exit()
    watchdog.start(topology.rank, topology.world_size, inf.inference_timeout)
    all_reduce = init_deepspeed_comm(topology) if groups.mesh is not None else None
    # where loading (step 2) ends: the skeleton `load_model` returned hands its pending load over here
    model, report = shard_model(model, inf, topology, groups, policy, dtype, device=device, pending=pending_load(model))
    logger.warning("deepspeed_inference: %s%s; %s", topology, f", all-reduce {all_reduce}" if all_reduce else "", report)
    return InferenceSetup(model=model, topology=topology, groups=groups, report=report, dtype=dtype)
