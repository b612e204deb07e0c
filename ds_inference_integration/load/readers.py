"""The loaders: they fill a skeleton's meta parameters in two steps around `deepspeed.init_inference` (see
`loaders.py`), reading from the original safetensors checkpoint only the rows or columns this rank keeps
(`ShardAwareLoader`) or this rank's own file of a pre-sharded directory (`PreShardedLoader`). Where a split
parameter's part comes from is read from the one record every split leaves on it, `TensorSlices` (`slices.py`,
where DeepSpeed's own record is converted into it)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import InferenceSetupError
from .checkpoint import SafetensorsCheckpoint
from .keys import KeyPlan, PackedSource
from .skeleton import initialise_missing, names_by_param, not_deferred, replace_meta
from .slices import from_deepspeed, recorded, take

logger = logging.getLogger(__name__)


@dataclass
class Loader:
    """Fills a skeleton's meta parameters; subclasses say where each tensor comes from."""

    model_dir: Path
    dtype: torch.dtype
    kind: str = ""
    seconds: float = 0.0
    bytes_read: int = 0
    key_of: dict[str, str] = field(default_factory=dict)  # parameter name -> checkpoint key
    transposed: set[str] = field(default_factory=set)  # Conv1D weights: stored [in, out]
    deferred: set[str] = field(default_factory=set)  # parameters still on meta when DeepSpeed splits
    ready_seconds: float = 0.0  # from load_model to a filled, sharded model

    missing: set[str] = field(default_factory=set)  # not in the checkpoint: initialised as from_pretrained does
    buffers: dict[str, str] = field(default_factory=dict)  # persistent buffer name -> checkpoint key

    def fill_replicated(self, model: nn.Module, device: torch.device) -> None:
        """Before the split: whole tensors of everything that is not (only) a linear's. The model's first
        parameter is always made real, since DeepSpeed takes a model whose first parameter is on `meta`
        for an all-meta model and gives every tensor, buffers included, uninitialised memory."""
        start = time.perf_counter()
        first = next(model.parameters())

        refill: set[str] = set()

        def make(names, module, p):
            if names[0] in self.missing:
                return torch.empty(p.shape, dtype=p.dtype, device=device)
            if not self._whole_before_split(p):  # a placeholder for DeepSpeed to slice; read after the split
                refill.update(names)
                return torch.zeros(p.shape, dtype=p.dtype, device=device)
            return self._read_whole(names, p).to(device)

        replace_meta(model, make, only=lambda p, owners: p is first or not_deferred(p, owners))
        if self.missing:
            initialise_missing(model, self.missing)
            logger.warning("deepspeed_inference: not in the checkpoint, initialised by the model as "
                           "from_pretrained does: %s", sorted(self.missing))
        for name, key in self.buffers.items():
            buf = model.get_buffer(name)
            with torch.no_grad():
                buf.copy_(self._read_buffer(key, buf))
        # DeepSpeed gives some of these real (unfilled) memory when it replaces their module: lm_head
        self.deferred = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta} | refill
        self.seconds += time.perf_counter() - start

    def _whole_before_split(self, p) -> bool:
        return True

    def _read_buffer(self, key: str, buf: torch.Tensor) -> torch.Tensor:
        before = self.ckpt.bytes_read
        t = self.ckpt.read(key, dtype=buf.dtype)
        self.bytes_read += self.ckpt.bytes_read - before
        slices = recorded(buf)  # a per-head buffer split here (MiniMax's decays: shard/mixers.py)
        if slices is not None and tuple(t.shape) == slices.full_shape:
            t = take(t, slices.dim, slices.ranges)
        return t

    def fill_sharded(self, model: nn.Module, tp_rank: int, device: torch.device) -> None:
        start = time.perf_counter()
        replace_meta(model, lambda names, module, p: self._read_shard(names, module, p, tp_rank).to(device),
                      also=self.deferred)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise InferenceSetupError(f"{self.kind} loading left parameters unloaded: {left[:3]}")
        self.seconds += time.perf_counter() - start

    def summary(self) -> str:
        ready = f", model ready {self.ready_seconds:.2f} s after loading began" if self.ready_seconds else ""
        return f"model loaded {self.kind}: read {self.bytes_read / 2**20:.1f} MiB in {self.seconds:.2f} s{ready}"


class ShardAwareLoader(Loader):
    """Reads from the original safetensors checkpoint, only the rows/columns this rank keeps."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, ckpt: SafetensorsCheckpoint, plan: "KeyPlan"):
        super().__init__(Path(model_dir), dtype, kind="shard-aware", key_of=plan.key_of, transposed=plan.transposed,
                         missing=plan.missing, buffers=plan.buffers)
        self.ckpt = ckpt
        self.packed = plan.packed

    def _key(self, names: list[str]) -> str:
        for n in names:
            if n in self.key_of:
                return self.key_of[n]
        raise InferenceSetupError(f"no checkpoint tensor for parameter {names[0]}")

    def _read_whole(self, names, p) -> torch.Tensor:
        before = self.ckpt.bytes_read
        key = self._key(names)
        slices = recorded(p)
        if slices is not None and not slices.ranges:  # a down bias this rank adds nothing of (shard/experts.py)
            t = torch.zeros(tuple(p.shape), dtype=self.dtype)
        elif key in self.packed:
            t = self._read_packed(self.packed[key], slices)
        elif slices is not None and tuple(self.ckpt.shape(key)) == slices.full_shape:
            # a checkpoint that stores the experts packed already (GraniteMoE's `input_linear`, saved by transformers
            # 5 as one [experts, 2 x inner, hidden] tensor): this rank's slices of it, from the mapped file's view
            # (only the pages of those slices become resident)
            t = take(self.ckpt.read(key, dtype=self.dtype, view=True), slices.dim, slices.ranges)
        else:
            t = self.ckpt.read(key, dtype=self.dtype, view=True)
        self.bytes_read += self.ckpt.bytes_read - before
        return t

    def _read_packed(self, source: PackedSource, slices) -> torch.Tensor:
        """Packed experts from the per-expert tensors: whole, or (`slices`, set by `experts.split_experts`) only this
        rank's rows of each expert's gate and up (dim 1) or columns of its down projection (dim 2)."""
        def stacked(j: int, rows=None, cols=None) -> torch.Tensor:
            return torch.stack([self.ckpt.read(k, rows=rows, cols=cols, dtype=self.dtype) for k in source.keys[j]])

        if slices is None:
            return torch.cat([stacked(j) for j in range(len(source.keys))], dim=1)
        if slices.dim == 2:
            return torch.cat([stacked(0, cols=[r]) for r in slices.ranges], dim=2)
        pieces, offset = [], 0
        starts = []
        for j in range(len(source.keys)):
            starts.append(offset)
            offset += self.ckpt.shape(source.keys[j][0])[0]
        for a, b in slices.ranges:
            j = max(i for i, s in enumerate(starts) if s <= a)
            pieces.append(stacked(j, rows=[(a - starts[j], b - starts[j])]))
        return torch.cat(pieces, dim=1)

    def _read_shard(self, names, module, p, tp_rank) -> torch.Tensor:
        name = names[0]
        key = self._key(names)
        src = self.ckpt.shape(key)
        # A Conv1D weight is stored [in, out]; it is read as a Linear's [out, in] only where its module became one
        # (tp > 1: our conv1d_to_linear or DeepSpeed's own layers). At tp 1 DeepSpeed splits nothing and the
        # module stays a Conv1D, which needs the weight as stored.
        transposed = name in self.transposed and type(module).__name__ != "Conv1D"
        full = tuple(reversed(src)) if transposed else tuple(src)
        want = tuple(p.shape)
        if p.numel() == 0:  # DeepSpeed's 64-grain split can leave trailing ranks nothing of a narrow tensor
            return torch.empty(want, dtype=self.dtype)
        slices = recorded(p)  # our split's record; DeepSpeed's split records its own, converted here
        if slices is None and want != full:
            slices = from_deepspeed(name, p, full, getattr(module, "tp_index", tp_rank))
        if slices is None:  # not split
            pieces = [((0,) * len(full), (0,) * len(full), full)]
        elif slices.full_shape != full:
            raise InferenceSetupError(f"{name}: its split was recorded on a tensor of shape {list(slices.full_shape)}, "
                                      f"the checkpoint's is {list(full)}; use --loading full")
        else:
            pieces = slices.pieces()
        before = self.ckpt.bytes_read
        if len(pieces) == 1 and tuple(pieces[0][2]) == want and not transposed:  # one block: read it in place
            s_at, _, shape = pieces[0]
            sel = [[(a, a + n)] for a, n in zip(s_at, shape)]
            t = self.ckpt.read(key, rows=sel[0], cols=sel[1] if len(sel) == 2 else None, dtype=self.dtype,
                               view=True)
            self.bytes_read += self.ckpt.bytes_read - before
            return t.reshape(want)
        out = torch.empty(want, dtype=self.dtype)
        for s_at, d_at, shape in pieces:
            region = tuple(slice(d, d + n) for d, n in zip(d_at, shape))
            sel = [[(a, a + n)] for a, n in zip(s_at, shape)]
            if transposed:
                part = self.ckpt.read(key, rows=sel[1], cols=sel[0], dtype=self.dtype).t()
            else:
                part = self.ckpt.read(key, rows=sel[0], cols=sel[1] if len(sel) == 2 else None, dtype=self.dtype)
            out[region] = part.reshape(shape)
        self.bytes_read += self.ckpt.bytes_read - before
        return out


class PreShardedLoader(Loader):
    """Reads this rank's own file of a directory written by `ds-inference shard`."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, ckpt: SafetensorsCheckpoint):
        super().__init__(Path(model_dir), dtype, kind="pre-sharded")
        self.ckpt = ckpt
        self._names: dict[int, list[str]] = {}

    def fill_replicated(self, model: nn.Module, device: torch.device) -> None:
        self._names = names_by_param(model)
        self.buffers = {n: n for n, _ in model.named_buffers() if n in self.ckpt}
        super().fill_replicated(model, device)

    def _get(self, names) -> torch.Tensor:
        for n in names:
            if n in self.ckpt:
                before = self.ckpt.bytes_read
                t = self.ckpt.read(n, dtype=self.dtype, view=True)
                self.bytes_read += self.ckpt.bytes_read - before
                return t
        raise InferenceSetupError(f"pre-sharded file {self.ckpt.files[0].name} has no tensor {names[0]}")

    def _read_whole(self, names, p) -> torch.Tensor:
        return self._get(names)

    def _whole_before_split(self, p) -> bool:
        """A tensor DeepSpeed slices outside linears (T5's relative position bias) is stored sliced: it waits."""
        names = self._names.get(id(p), [])
        stored = next((self.ckpt.shape(n) for n in names if n in self.ckpt), None)
        return stored is None or tuple(stored) == tuple(p.shape)

    def _read_shard(self, names, module, p, tp_rank) -> torch.Tensor:
        t = self._get(names)
        if tuple(t.shape) != tuple(p.shape):  # written by a version that split it otherwise (DeepSpeed's 64-row
            # blocks before `deepspeed_compat.even_grain`)
            raise InferenceSetupError(f"pre-sharded file {self.ckpt.files[0].name} holds {names[0]} as "
                                      f"{list(t.shape)}, this run splits it to {list(p.shape)}: re-run `ds-inference "
                                      "shard` with this version")
        return t
