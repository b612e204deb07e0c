"""Load only your shard: build the model without initialising it, then read only what this rank keeps.

Three ways to a sharded model, chosen by `load_model` (under `--deepspeed_inference`):

* **pre-sharded**: the model directory was written by `ds-inference shard` (it has `manifest.json`):
  each rank reads its own `rank-R-of-N.safetensors` and nothing else;
* **shard-aware**: the model directory has safetensors weights (one file, or shards with an index):
  each rank reads the replicated tensors whole and, of every tensor DeepSpeed splits, only its rows
  or columns;
* **full** (the naive path, and the fallback): `from_pretrained` on every rank, then `init_inference`.

The first two build a skeleton: parameters on the `meta` device (no memory, no random init),
buffers real (they are computed from the config: rotary frequencies, masks). `shard_model` then
fills it in two steps around `deepspeed.init_inference`, which splits meta tensors as metadata only:

1. before: parameters that no linear layer owns (embeddings, norms, relative position biases) are
   read whole; they are replicated, and DeepSpeed slices the few it splits itself;
2. after: each linear's parameter, now of its shard's shape, is read from the checkpoint. Where its
   rows/columns come from is taken from what the splitting recorded: DeepSpeed's per-parameter
   partition metadata (dimension, sizes, this rank's index), and our own `ColumnShard.source_rows`
   for attention heads split here. Every read is checked against the shape DeepSpeed produced.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import InferenceSetupError
from ..run.collector import collector_paused
from .checkpoint import SafetensorsCheckpoint, ranges_of
from .presharded import MANIFEST, check_manifest, read_manifest, verify_in_group
from .slices import take

logger = logging.getLogger(__name__)

DEFERRED_TYPES = ("Linear", "Conv1D", "ColumnShard")  # modules whose parameters wait for the split
PACKED_KEY = "<packed>"  # KeyPlan.key_of's key for a parameter built from several checkpoint tensors


@dataclass
class PendingLoad:
    """What `load_model` leaves for `shard_model` when it returns a skeleton: where this rank's weights will come
    from (`loader`, or a pre-sharded directory's `manifest`, checked and opened per rank once the policy is known:
    `open`) and when loading began (for the log line's time to a ready model). Registered against the model
    (`pending_load`), not stored on it: the model stays a plain transformers model; `shard_model` takes it off
    once every weight is read."""

    start: float
    loader: "Loader | None" = None
    manifest: dict | None = None
    model_dir: Path | None = None

    def open(self, tp_size: int, tp_rank: int, policy_identity: str, dtype: torch.dtype, group=None) -> "Loader":
        """This rank's loader. A pre-sharded directory is checked here: the manifest against the run, then the rank
        files (`presharded.verify_in_group`, agreed over `group`)."""
        if self.loader is None:
            check_manifest(self.manifest, self.model_dir, tp_size, policy_identity, dtype)
            verify_in_group(self.manifest, self.model_dir, tp_rank, group)
            record = next(r for r in self.manifest["files"] if r["rank"] == tp_rank)
            self.loader = PreShardedLoader(self.model_dir, dtype,
                                           SafetensorsCheckpoint([self.model_dir / record["name"]]))
        return self.loader


_PENDING: "weakref.WeakKeyDictionary[nn.Module, PendingLoad]" = weakref.WeakKeyDictionary()


def pending_load(model: nn.Module) -> PendingLoad | None:
    """The load `load_model` left for this skeleton, or None (a model with every weight already)."""
    return _PENDING.get(model)


def loaded(model: nn.Module) -> None:
    """Every weight of `model` is read: it is no longer a skeleton."""
    _PENDING.pop(model, None)


def is_skeleton(model: nn.Module) -> bool:
    return model in _PENDING


def _names_by_param(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    return owners


def _replace_meta(model: nn.Module, make, only=None, also: set[str] = frozenset()) -> int:
    """Give every meta parameter (for which `only(param, owners)` holds), and every parameter named in `also`,
    a real tensor `make(names, module, param)`; parameters shared between modules stay shared.
    Returns the number of tensors made."""
    names = _names_by_param(model)
    owners = _owners(model)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not (p.is_meta or any(n in also for n in names[id(p)])):
                continue
            if id(p) not in made:
                if only is not None and not only(p, owners[id(p)]):
                    continue
                tensor = make(names[id(p)], module, p)
                if tuple(tensor.shape) != tuple(p.shape):
                    raise InferenceSetupError(f"checkpoint tensor for {names[id(p)][0]} has shape {list(tensor.shape)}, "
                                              f"the model wants {list(p.shape)}")
                made[id(p)] = nn.Parameter(tensor, requires_grad=False)
            module._parameters[attr] = made[id(p)]
    return len(made)


def initialise_missing(model: nn.Module, missing: set[str]) -> None:
    """Initialise the parameters named in `missing`, and nothing else, the way `from_pretrained` does: every other
    parameter is flagged `_is_hf_initialized`, which transformers' init functions skip, then the model's own
    `initialize_weights` runs. (Calling `_init_weights(module)` on the module would also reset the tensors of
    that module that were just read: a LayerNorm missing only its bias would get its weight reset to 1.)"""
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in missing:
            p._is_hf_initialized = True
    for module in model.modules():  # from_config marked every module done when it built the (meta) skeleton
        module.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        model.initialize_weights()


def _not_deferred(param, owners) -> bool:
    return not all(isinstance(m, nn.Linear) or type(m).__name__ in DEFERRED_TYPES for m in owners)


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

        _replace_meta(model, make, only=lambda p, owners: p is first or _not_deferred(p, owners))
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
        slices = getattr(buf, "tensor_slices", None)  # a per-head buffer split here (MiniMax's decays: shard/mixers.py)
        if slices is not None and tuple(t.shape) == slices.full_shape:
            t = take(t, slices.dim, slices.ranges)
        return t

    def fill_sharded(self, model: nn.Module, tp_rank: int, device: torch.device) -> None:
        start = time.perf_counter()
        _replace_meta(model, lambda names, module, p: self._read_shard(names, module, p, tp_rank).to(device),
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
        slices = getattr(p, "tensor_slices", None)
        if slices is not None and not slices.ranges:  # a down bias this rank adds nothing of (shard/experts.py)
            t = torch.zeros(tuple(p.shape), dtype=self.dtype)
        elif key in self.packed:
            t = self._read_packed(self.packed[key], slices)
        elif slices is not None and tuple(self.ckpt.shape(key)) == slices.full_shape:
            # a checkpoint that stores the experts packed already (GraniteMoE's `input_linear`, saved by transformers
            # 5 as one [experts, 2 x inner, hidden] tensor): this rank's slices of it, from the mapped file's view
            # (only the pages of those slices become resident)
            whole = self.ckpt.read(key, dtype=self.dtype, view=True)
            index = [slice(None)] * whole.ndim
            parts = []
            for a, b in slices.ranges:
                index[slices.dim] = slice(a, b)
                parts.append(whole[tuple(index)])
            t = torch.cat(parts, dim=slices.dim).contiguous()
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
        rows = getattr(module, "source_rows", None)
        head_rows = getattr(p, "head_rows", None)
        if head_rows is not None:  # a per-head parameter of an attention (inject.split_per_head_parameters)
            pieces = [((head_rows[0],), (0,), (head_rows[1] - head_rows[0],))]
        elif rows is not None:  # a ColumnShard: our own head split recorded its rows
            pieces, at = [], 0
            for a, b in ranges_of(rows):
                pieces.append(((a,) + (0,) * (len(full) - 1), (at,) + (0,) * (len(full) - 1), (b - a,) + full[1:]))
                at += b - a
        elif want == full:
            pieces = [((0,) * len(full), (0,) * len(full), full)]
        else:
            pieces = _deepspeed_pieces(name, module, p, full, tp_rank)
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


def _unravel(offset: int, shape: tuple) -> tuple:
    at = []
    for n in reversed(shape):
        at.append(offset % n)
        offset //= n
    return tuple(reversed(at))


def _row_major(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))


def _deepspeed_pieces(name: str, module: nn.Module, p: torch.Tensor, full: tuple, tp_rank: int) -> list:
    """Which blocks of the full tensor (shape `full`) DeepSpeed put where in this rank's shard, read from the
    layout it records on each parameter it splits (its universal-checkpoint affine map): a list of
    (start in the full tensor, start in the shard, block shape)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    want = tuple(p.shape)
    meta = getattr(p, DS_AUTOTP_UC_META, None) or {}
    rank = getattr(module, "tp_index", tp_rank)
    amap = (meta.get("conversion") or {}).get("affine_map") or {}
    info = (amap.get("ranks") or {}).get(rank) or (amap.get("ranks") or {}).get(str(rank))
    if not info or tuple(amap.get("logical_shape", ())) != full or tuple(info["shard_shape"]) != want:
        raise InferenceSetupError(f"cannot tell which part of {name} ({list(full)} -> {list(want)}) this rank "
                                  "holds (DeepSpeed recorded no layout for it); use --loading full")
    pieces = []
    for piece in info["pieces"]:
        shape = tuple(piece["shape"])
        (s_off, s_strides), (d_off, d_strides) = piece["source"], piece["dest"]
        if list(s_strides) != _row_major(full) or list(d_strides) != _row_major(want):
            raise InferenceSetupError(f"{name}: DeepSpeed's layout for this rank is strided in a way this loader "
                                      "does not read; use --loading full")
        pieces.append((_unravel(s_off, full), _unravel(d_off, want), shape))
    covered = sum(int(torch.Size(shape).numel()) for _, _, shape in pieces)
    if covered != p.numel():
        raise InferenceSetupError(f"{name}: DeepSpeed's layout covers {covered} of {p.numel()} elements; use --loading full")
    return pieces


class PreShardedLoader(Loader):
    """Reads this rank's own file of a directory written by `ds-inference shard`."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, ckpt: SafetensorsCheckpoint):
        super().__init__(Path(model_dir), dtype, kind="pre-sharded")
        self.ckpt = ckpt
        self._names: dict[int, list[str]] = {}

    def fill_replicated(self, model: nn.Module, device: torch.device) -> None:
        self._names = _names_by_param(model)
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
        return self._get(names)


# Choosing the path ---------------------------------------------------------------------------------

@dataclass
class PackedSource:
    """A parameter transformers builds at load from several checkpoint tensors (packed experts): `keys[j][e]` is
    source pattern j's tensor of expert e; the parameter is those stacked over experts (MergeModulelist, dim 0),
    the patterns then concatenated along dim 1 (Concatenate: gate then up) when there are several."""

    keys: list[list[str]]

    def shape(self, ckpt: SafetensorsCheckpoint) -> tuple[int, ...]:
        first = tuple(ckpt.shape(self.keys[0][0]))
        return (len(self.keys[0]), sum(ckpt.shape(k[0])[0] for k in self.keys), *first[1:])


def _packing(converter) -> bool:
    """The conversions read here: experts stacked (MergeModulelist dim 0), then gate and up joined (Concatenate
    dim 1) or not; transformers applies them to every packed-experts family (conversion_mapping.py)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def _checkpoint_names(model: nn.Module, ckpt: SafetensorsCheckpoint
                      ) -> tuple[dict[str, str], dict[str, PackedSource], str | None]:
    """Model name -> checkpoint key, renamed the way `from_pretrained` renames them (transformers' own
    key renamings and base-model prefix); packed experts -> their per-expert tensors; a reason instead when a
    key needs another conversion."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta_state = dict(model.state_dict())
    out: dict[str, str] = {}
    parts: dict[str, dict[tuple[int, int], str]] = {}
    for key in ckpt.entries:
        name, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                          meta_state)
        if pattern is not None:
            converter = next((c for c in converters if pattern in getattr(c, "source_patterns", ())), None)
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
            if converter is None or not _packing(converter) or expert is None:
                return {}, {}, f"checkpoint tensor {key} needs conversion ({pattern}), not only slicing"
            parts.setdefault(name, {})[(converter.source_patterns.index(pattern), int(expert.group(1)))] = key
            continue
        out.setdefault(name, key)
    packed = {}
    for name, found in parts.items():
        patterns = sorted({j for j, _ in found})
        experts = sorted({e for _, e in found})
        if any((j, e) not in found for j in patterns for e in experts) or experts != list(range(len(experts))):
            return {}, {}, f"checkpoint tensors of {name} do not cover every expert of every part"
        packed[name] = PackedSource([[found[(j, e)] for e in experts] for j in patterns])
    return out, packed, None


@dataclass
class KeyPlan:
    key_of: dict[str, str]  # parameter name -> checkpoint key
    transposed: set[str]  # Conv1D weights, stored [in, out]
    missing: set[str]  # replicated parameters the checkpoint lacks (the model initialises them)
    buffers: dict[str, str]  # persistent buffers the checkpoint has
    packed: dict[str, PackedSource] = field(default_factory=dict)  # parameter name -> its per-expert tensors


def plan_keys(model: nn.Module, ckpt: SafetensorsCheckpoint) -> tuple[KeyPlan | None, str | None]:
    """Map every parameter of a skeleton to a checkpoint tensor of the right shape.
    Returns (plan, None) or (None, a reason why the checkpoint does not fit)."""
    key_by_name, packed, reason = _checkpoint_names(model, ckpt)
    if reason:
        return None, reason
    plan = KeyPlan({}, set(), set(), {})
    for name, source in packed.items():
        want = tuple(dict(model.named_parameters(remove_duplicate=False))[name].shape)
        if source.shape(ckpt) != want:
            return None, f"checkpoint tensors of {name} make shape {list(source.shape(ckpt))}, the model wants {list(want)}"
        key_by_name[name] = PACKED_KEY + name
        plan.packed[PACKED_KEY + name] = source
    for module_name, module in model.named_modules(remove_duplicate=False):
        if type(module).__name__ == "Conv1D":
            plan.transposed.add(f"{module_name}.weight" if module_name else "weight")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = _owners(model)
    for group in _names_by_param(model).values():
        found = next((key_by_name[n] for n in group if n in key_by_name), None)
        if found is None:
            if not _not_deferred(None, owners[id(params[group[0]])]):
                return None, f"the checkpoint has no tensor for {group[0]}"
            plan.missing.update(group)
            continue
        if not found.startswith(PACKED_KEY) and tuple(ckpt.shape(found)) != shapes[group[0]]:
            return None, (f"checkpoint tensor {found} has shape {list(ckpt.shape(found))}, the model wants "
                          f"{list(shapes[group[0]])}")
        for name in group:
            plan.key_of[name] = found
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent and name in key_by_name and tuple(ckpt.shape(key_by_name[name])) == tuple(buf.shape):
            plan.buffers[name] = key_by_name[name]
    return plan, None


def build_skeleton(model_cls, config, dtype: torch.dtype, model_dir: Path) -> nn.Module:
    """The model with parameters on `meta` (no memory, no initialisation) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights

    # `no_init_weights` (what from_pretrained builds under with ZeRO-3): without it `from_config` ran every
    # `_init_weights` on the meta parameters, which torch computes through its reference decompositions: 0.25 of the
    # 0.37 s this function took for a 32-layer Llama (cProfile, 2026-12-04), for tensors that are read, not drawn.
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = model_cls.from_config(config, dtype=dtype)
    # Buffers as `from_pretrained` makes them: it builds the model under the checkpoint's dtype, too, then computes
    # again every tensor the checkpoint did not fill with the model's own `_init_weights` (`initialize_weights`),
    # which makes some buffers in fp32. Without this, GPT-J's sinusoidal positions kept the values computed under
    # bf16 (0.011 off from one device's), and its greedy ids through shard-aware and pre-sharded loading differed
    # from the full load (`ds-inference policy matrix --dtype bf16`, 2026-12-04). The parameters, still on meta and
    # read from the checkpoint later, are marked as done, as from_pretrained marks the ones it loaded; the marks
    # `from_config` left on modules and buffers (it ran the same initialisation under the checkpoint's dtype) go.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for buffer in module.buffers(recurse=False):
            buffer.__dict__.pop("_is_hf_initialized", None)
    for param in model.parameters():
        param._is_hf_initialized = True
    model.initialize_weights()
    model.tie_weights()  # from_config skips tying when the parameters are on meta
    model.eval()
    if (Path(model_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def model_class_for(config):
    """The Auto class that builds a model of this config for generation: speech-to-text (Whisper), other
    encoder-decoders, or decoder-only."""
    import transformers as tr
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    if getattr(config, "model_type", None) in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return tr.AutoModelForSpeechSeq2Seq
    return tr.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tr.AutoModelForCausalLM


def check_model_kind(config, model_cls, model_dir) -> None:
    """One `InferenceSetupError` before anything loads when the Auto class `model_cls` builds no model of this
    config's type (a decoder-only model given to a seq2seq script: an AttributeError on decoder_start_token_id, or
    transformers' ValueError listing every class, otherwise)."""
    mapping = model_cls._model_mapping
    if type(config) in mapping:
        return
    names = sorted(mapping._model_mapping)
    familiar = [n for n in ("t5", "bart", "mbart", "marian", "pegasus", "led", "whisper", "speech_to_text",
                            "speech-encoder-decoder", "llama", "gpt2") if n in names] or names[:8]
    raise InferenceSetupError(f"{model_dir} holds a {config.model_type!r} model, which {model_cls.__name__} does not "
                              f"build; valid: one of its {len(names)} types, such as {', '.join(familiar)}")


def policy_id(policy) -> str:
    """A stable name for the policy a run resolves: autotp, or the policy's name and content hash."""
    from ..policy.schema import Policy, policy_identity

    if not isinstance(policy, Policy):
        return "autotp" if policy in (None, "autotp") else str(policy)
    return f"{policy.name}:{policy_identity(policy)}"


@collector_paused()  # a full collection inside would walk every object of the process (run/collector.py)
def load_model(model_cls, model_dir: str | Path, config=None, *, inference_args=None, training_args=None,
               dtype: torch.dtype | None = None, mode: str | None = None, **from_pretrained_kwargs) -> nn.Module:
    """`model_cls.from_pretrained`, or under `--deepspeed_inference` a skeleton that `shard_model` fills
    with only this rank's shard (see the module docstring). `mode` (default: `--loading`): auto, full,
    shard-aware, pre-sharded; auto takes the first that the directory allows, in the order pre-sharded,
    shard-aware, full."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    enabled = inference_args is not None and inference_args.deepspeed_inference
    mode = mode or (inference_args.loading if enabled else "full")
    if mode not in ("auto", "full", "shard-aware", "pre-sharded"):
        raise InferenceSetupError(f"--loading {mode!r} is unknown; valid: auto, full, shard-aware, pre-sharded")
    if enabled and inference_args.replace_with_kernel_inject and mode != "full":
        if mode != "auto":
            raise InferenceSetupError(f"--loading {mode} does not work with --replace_with_kernel_inject; use --loading full")
        mode = "full"
    if dtype is None and inference_args is not None:
        dtype = inference_args.resolve_dtype(fp16=getattr(training_args, "fp16", False),
                                             bf16=getattr(training_args, "bf16", False))
    dtype = dtype or torch.float32
    config = config or AutoConfig.from_pretrained(model_dir)
    if hasattr(model_cls, "_model_mapping"):  # an Auto class: one line where it builds no model of this config
        check_model_kind(config, model_cls, model_dir)
    start = time.perf_counter()
    reason = None
    if mode in ("auto", "pre-sharded"):
        manifest = read_manifest(model_dir)  # refuses a half-written or foreign-format directory
        if manifest is not None:
            model = build_skeleton(model_cls, config, dtype, model_dir)
            _PENDING[model] = PendingLoad(start, manifest=manifest, model_dir=model_dir)  # opened per rank in shard_model
            return model
        if mode == "pre-sharded":
            raise InferenceSetupError(f"{model_dir} has no {MANIFEST}: it was not written by `ds-inference shard`")
    if mode in ("auto", "shard-aware"):
        ckpt = SafetensorsCheckpoint.open(model_dir)
        if ckpt is None:
            reason = "no safetensors weights"
        else:
            model = build_skeleton(model_cls, config, dtype, model_dir)
            plan, reason = plan_keys(model, ckpt)
            if reason is None:
                _PENDING[model] = PendingLoad(start, loader=ShardAwareLoader(model_dir, dtype, ckpt, plan))
                return model
        if mode == "shard-aware":
            raise InferenceSetupError(f"--loading shard-aware: {model_dir}: {reason}; valid here: --loading full")
    if enabled:  # in the run's dtype, as a one-device `from_pretrained(dtype=...)`: buffers made as it makes them
        from_pretrained_kwargs.setdefault("dtype", dtype)
    model = model_cls.from_pretrained(model_dir, config=config, **from_pretrained_kwargs)
    if enabled:
        why = f" ({reason})" if reason else ""
        logger.warning("deepspeed_inference: model loaded full on every rank%s in %.2f s", why, time.perf_counter() - start)
    return model
