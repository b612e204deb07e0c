"""The lock-step guard: before each batch, the ranks of a TP group compare a cheap fingerprint of their inputs
and stop with one clear error if they differ (a tensor-parallel forward on mixed inputs returns garbage, or
hangs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import LockstepError
from ..topology import Topology


def fingerprint(inputs: dict) -> torch.Tensor:
    """A cheap summary of a batch (shapes and position-weighted sums of the integer tensors; for a float tensor,
    speech features, the same sums of its values' bit patterns, so that equal inputs give equal sums exactly)."""
    parts = []
    for key in sorted(inputs):
        value = inputs[key]
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                value = value.detach().to(torch.float32).contiguous().view(torch.int32)
            flat = value.reshape(-1).to(torch.int64)
            weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
            parts += [*value.shape, int((flat * weights).sum()), int(flat.sum())]
    return torch.tensor(parts, dtype=torch.int64)


def check_lockstep(inputs: dict, topology: Topology, tp_group, device, batch_index: int) -> None:
    """Every rank of the TP group calls this with its batch; raises LockstepError on every rank if any differ."""
    mine = fingerprint(inputs).to(device)
    peers = [torch.empty_like(mine) for _ in range(topology.tp_size)]
    dist.all_gather(peers, mine, group=tp_group)
    differ = [r for r, p in enumerate(peers) if not torch.equal(p, peers[0])]
    if differ:
        group = topology.tp_group_ranks()[topology.dp_rank]
        raise LockstepError(
            f"lock-step guard: batch {batch_index} differs between ranks {group[0]} and "
            f"{', '.join(str(group[r]) for r in differ)} of TP group {group}; refusing to generate from mixed inputs",
            ranks=group,
        )
