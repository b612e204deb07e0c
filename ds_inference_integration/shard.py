"""Shard a Hugging Face model in place with `deepspeed.init_inference` (tensor parallelism)."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from .arguments import DeepSpeedInferenceArguments
from .policy import Policy, build_injection_policy
from .topology import ModelParallelUnit, ProcessGroups, Topology

logger = logging.getLogger(__name__)


@dataclass
class ShardReport:
    """What one rank holds after sharding."""

    policy: str
    param_bytes: int
    full_param_bytes: int

    def __str__(self) -> str:
        share = self.param_bytes / max(self.full_param_bytes, 1)
        return f"policy {self.policy}; this rank holds {self.param_bytes / 2**20:.2f} of {self.full_param_bytes / 2**20:.2f} MiB of parameters ({share:.0%})"


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def init_deepspeed_comm(topology: Topology) -> None:
    """Wrap the already-initialised torch process group in deepspeed.comm.

    On CPU, DeepSpeed's shared-memory all-reduce ignores process groups and reads LOCAL_SIZE (set by
    the `deepspeed` launcher; torchrun's LOCAL_WORLD_SIZE is copied to it): it is used only when one
    TP group spans the whole single-node world, and plain torch.distributed all-reduce otherwise.
    """
    import deepspeed

    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]  # torchrun's name for it
    local_size = os.environ.get("LOCAL_SIZE")
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ and local_size:
        # The deepspeed launcher leaves every CPU rank all cores: oversubscribed ranks stall in all-reduce.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(local_size)))
    deepspeed.init_distributed(dist_backend=None)
    comm = importlib.import_module("deepspeed.comm.comm")
    shm_ok = topology.tp_size == topology.world_size and os.environ.get("LOCAL_SIZE") == str(topology.world_size)
    if comm.cdb is not None and not shm_ok and getattr(comm.cdb, "shm_vector_kernel_level", 0):
        comm.cdb.shm_vector_kernel_level = 0


def shard_model(
    model: nn.Module,
    args: DeepSpeedInferenceArguments,
    topology: Topology,
    groups: ProcessGroups,
    policy: Policy | None,
    dtype: torch.dtype,
) -> tuple[nn.Module, ShardReport]:
    """Shard `model` in place over this rank's TP group; returns the (same) model and a report."""
    import deepspeed

    full_bytes = _param_bytes(model) * torch.finfo(dtype).bits // torch.finfo(next(model.parameters()).dtype).bits
    kwargs: dict = {"dtype": dtype, "replace_with_kernel_inject": args.replace_with_kernel_inject}
    if topology.tp_size > 1:
        kwargs["tensor_parallel"] = {
            "tp_size": topology.tp_size,
            "mpu": ModelParallelUnit(groups),
            "tp_group": groups.tp,
        }
    if policy is not None and topology.tp_size > 1 and not args.replace_with_kernel_inject:
        kwargs["injection_policy"] = build_injection_policy(policy, model)
    engine = deepspeed.init_inference(model, **kwargs)
    sharded = engine.module
    report = ShardReport(
        policy=str(policy.source) if policy else ("kernel injection" if args.replace_with_kernel_inject else "autotp"),
        param_bytes=_param_bytes(sharded),
        full_param_bytes=full_bytes,
    )
    return sharded, report
