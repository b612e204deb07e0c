"""Who is who: world, tensor-parallel (TP) and data-parallel (DP) sizes and ranks, computed once.

Ranks are laid out TP-innermost: TP groups are runs of consecutive ranks ([0, 1], [2, 3] for
world 4, tp 2) and each DP group holds one rank of every TP group ([0, 2], [1, 3]). This matches
accelerate's device-mesh order, so its data loader gives every rank of a TP group the same batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InferenceSetupError

if TYPE_CHECKING:  # torch where a group is made or asked (arguments.py says why not at import)
    import torch.distributed as dist


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    tp_size: int

    @classmethod
    def from_env(cls, tp_size: int | None = None) -> "Topology":
        """Read the launcher's WORLD_SIZE/RANK; `tp_size` defaults to the world size."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        return cls.create(world, rank, tp_size)

    @classmethod
    def create(cls, world_size: int, rank: int, tp_size: int | None = None) -> "Topology":
        tp = world_size if tp_size is None else tp_size
        if tp < 1 or tp > world_size or world_size % tp:
            raise InferenceSetupError(
                f"--tp_size {tp} does not fit {world_size} rank(s): it must divide the world size; "
                f"valid: {', '.join(map(str, _divisors(world_size)))}"
            )
        return cls(world_size, rank, tp)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    def tp_group_ranks(self) -> list[list[int]]:
        return [list(range(s, s + self.tp_size)) for s in range(0, self.world_size, self.tp_size)]

    def dp_group_ranks(self) -> list[list[int]]:
        return [list(range(o, self.world_size, self.tp_size)) for o in range(self.tp_size)]

    def __str__(self) -> str:
        return f"world {self.world_size} = tp {self.tp_size} x dp {self.dp_size} (rank {self.rank})"


@dataclass
class ProcessGroups:
    """The torch process groups of this rank, and the device mesh accelerate reads for data layout."""

    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    mesh: object | None


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads for each of `local_ranks` ranks on one machine: the cores shared out, as torchrun does (the
    deepspeed launcher leaves every CPU rank all cores, and oversubscribed ranks stall in all-reduce)."""
    import os

    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def serving_threads(local_ranks: int, front: bool) -> int:
    """CPU threads for each of a server's `local_ranks` ranks on this machine (every replica's, where several share
    it), one core left to the front where it runs here (`front`) and the machine has a core to spare: the front
    decodes, frames and sends every token, and with the ranks on every core it took their time. Measured on the
    embedded T5 at tp 1 on 2 cores (`bench serve` load, 64 requests of 8-128 tokens, concurrency 16, 2026-12-05):
    the rank at 2 threads used 1.7 cores and served 2417 output tok/s (step engine) and 1501 (batch engine); at 1
    thread 2767-2891 and 1756-1791."""
    import os

    cores = os.cpu_count() or 1
    spare = 1 if front and cores > local_ranks else 0
    return max(1, (cores - spare) // max(1, local_ranks))


def init_process_groups(topology: Topology, device_type: str, timeout: float | None = None) -> ProcessGroups:
    """Create the (dp, tp) device mesh; every rank must call this, in the same order.

    `timeout` (seconds) is given to the mesh's TP and DP groups too: `init_device_mesh` creates them with
    the backend's default (gloo 30 minutes, NCCL 10), not the default group's `--ddp_timeout`."""
    import torch.distributed as dist

    if topology.world_size == 1 or not dist.is_initialized():
        return ProcessGroups(tp=None, dp=None, mesh=None)
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device_type, (topology.dp_size, topology.tp_size), mesh_dim_names=("dp_shard", "tp")
    )
    groups = ProcessGroups(tp=mesh["tp"].get_group(), dp=mesh["dp_shard"].get_group(), mesh=mesh)
    if timeout is not None:
        for group in (groups.tp, groups.dp):
            # c10d's own setter (private, but the one torch offers for a group that already exists)
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout), group)
    return groups


class ModelParallelUnit:
    """The `mpu` object DeepSpeed's inference engine reads its TP/DP groups from."""

    def __init__(self, groups: ProcessGroups):
        self._tp, self._dp = groups.tp, groups.dp

    def get_model_parallel_group(self):
        return self._tp

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self._tp)

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self._tp)

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self._dp)

    def get_data_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self._dp)
