"""Inject tensor parallelism: shard a Hugging Face model in place with `deepspeed.init_inference`.

Before DeepSpeed runs, the model is prepared: Conv1D layers become nn.Linear (GPT-2); fused QKV and
fewer-KV-heads-than-ranks projections are split here (`shard/attention.py`); what DeepSpeed 0.19 itself gets
wrong is worked around in `deepspeed_compat.py`. After it, attention attributes are set to this rank's
values and a skeleton's weights are read (`load/loaders.py`).
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..arguments import DeepSpeedInferenceArguments, InferenceSetupError
from ..deepspeed_compat import (
    autotp_replacements,
    buffers_kept_apart,
    even_grain,
    kv_heads_seen_by_deepspeed,
    lm_head_not_copied,
    lm_head_reads_any_rank,
    lm_head_tied_as_the_model_ties,
    modules_kept_apart,
    modules_printed_once,
    parameter_dtypes,
    plain_subclass,
    restore_buffers,
    restore_parameter_dtypes,
    shared_modules_split_once,
    yuan_named_apart,
)
from ..errors import first_line, sharding_failure
from ..load.loaders import PendingLoad, is_skeleton, loaded, policy_id
from ..load.readers import PreShardedLoader
from ..load.slices import record
from ..policy.derive import derive_policy, derived_summary, head_values, is_derived
from ..policy.schema import (
    AttentionSpec,
    Policy,
    build_injection_policy,
    config_value,
    names_module,
    reading_configured_values,
    replicated_match,
    under_replicated,
)
from ..run.collector import collector_paused
from ..topology import ModelParallelUnit, ProcessGroups, Topology
from .attention import HeadLayout, split_fused_qkv, split_heads, whole
from .biases import cut_head_inputs, slice_head_biases
from .experts import experts_modules, split_experts
from .mixers import split_ssm_mixer, ssm_mixers
from .packed import split_packed
from .reduction import reduce_in_fp32
from .statistics import statistics_across_ranks
from .weight_share import WeightShare, full_sizes, measure

logger = logging.getLogger(__name__)


@dataclass
class ShardReport:
    """What one rank holds after sharding."""

    policy: str
    param_bytes: int
    full_param_bytes: int
    replicated_kv: bool = False
    policy_object: Policy | None = None  # the policy applied (derived ones included)
    loading: str = ""  # how the weights were loaded, and how long it took
    weight_share: WeightShare | None = None  # of the layer weights, against the policy's target (tp > 1)

    def __str__(self) -> str:
        share = self.param_bytes / max(self.full_param_bytes, 1)
        kv = "; KV heads replicated (fewer KV heads than ranks)" if self.replicated_kv else ""
        loading = f"; {self.loading}" if self.loading else ""
        return (f"policy {self.policy}; this rank holds {self.param_bytes / 2**20:.2f} of "
                f"{self.full_param_bytes / 2**20:.2f} MiB of parameters ({share:.0%}){kv}{loading}")


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# Preparation: what DeepSpeed would get wrong, made right on the model first --------------------------

def _layers(model: nn.Module, policy: Policy) -> list[nn.Module]:
    patterns = {*policy.layers, *policy.replicated, *policy.experts, *policy.mixers, *policy.packed, *policy.head_inputs}
    return [m for m in model.modules() if any(fnmatch.fnmatchcase(type(m).__name__, p) for p in patterns)]


def conv1d_to_linear(layer: nn.Module) -> None:
    """transformers' Conv1D (GPT-2) is a linear with a transposed weight: make it an nn.Linear."""
    for name, child in list(layer.named_modules()):
        if type(child).__name__ == "Conv1D":
            linear = nn.Linear(child.weight.shape[0], child.weight.shape[1], bias=child.bias is not None,
                               device=child.weight.device, dtype=child.weight.dtype)
            linear.weight.data.copy_(child.weight.detach().t())
            if child.bias is not None:
                linear.bias.data.copy_(child.bias.detach())
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, attr, linear)


def _own_forward(linear: nn.Module) -> bool:
    """A subclass of nn.Linear with a forward of its own (Llama 4's router returns scores and logits): a
    ColumnShard in its place would change what it returns."""
    return type(linear) is not nn.Linear and type(linear).forward is not nn.Linear.forward


def replicate_modules(layers: list[nn.Module], policy: Policy, apart: list[nn.Module] | None = None,
                      kept_ids: set[int] | None = None) -> int:
    """Keep every linear under the policy's `replicated` modules whole on every rank (a ColumnShard of all its
    rows, which DeepSpeed neither splits nor all-reduces); returns how many linears were kept whole. A linear
    with a forward of its own is left in place and added to `apart`, to be hidden from DeepSpeed while it
    splits (`deepspeed_compat.modules_kept_apart`). The ids of every module kept whole, and of every module
    inside one, are added to `kept_ids` (a layer class nested in another's whole module: Zamba2's mamba layer)."""
    kept, found = 0, set()
    apart = [] if apart is None else apart
    kept_ids = set() if kept_ids is None else kept_ids

    def keep(owner: nn.Module, name: str, linear: nn.Module) -> None:
        nonlocal kept
        if _own_forward(linear):
            apart.append(linear)
        else:
            _replace(owner, name, whole(linear))
        kept += 1

    for layer in layers:
        for pattern, paths in policy.replicated.items():
            if not fnmatch.fnmatchcase(type(layer).__name__, pattern):
                continue
            for path in paths:
                for hit, module in list(layer.named_modules()):
                    if hit and replicated_match(path, hit, module):
                        found.add((pattern, path))
                        kept_ids.update(id(m) for m in module.modules())
                        if isinstance(module, nn.Linear):  # the path names a linear itself (a router: mlp.gate.wg)
                            keep(layer, hit, module)
                            continue
                        for name, child in list(module.named_modules()):
                            if name and isinstance(child, nn.Linear):
                                keep(module, name, child)
                            elif name and isinstance(child, nn.Embedding):
                                # DeepSpeed slices any embedding in a layer by its columns: Granite Speech's
                                # relative-position table in its whole attention, half of it per rank at tp 2
                                # (its weight share 64.6% against 69.8%, `policy sweep`, 2026-12-06)
                                apart.append(child)
    missing = [(pattern, path) for pattern, paths in policy.replicated.items() for path in paths
               if (pattern, path) not in found]
    if missing:
        raise InferenceSetupError(f"policy {policy.source}: replicated {missing[0][1]!r} names no module inside "
                                  f"{missing[0][0]}")
    return kept


def _embeddings_not_per_head(layers: list[nn.Module], config: object) -> list[nn.Module]:
    """Embeddings inside the layers whose columns are not one per head, to keep whole (hidden from DeepSpeed, which
    slices every embedding in a layer by its columns: right for T5's relative-attention bias, [buckets, heads]).
    SeamlessM4T v2's conformer `distance_embedding` ([positions, head size]) cut in half failed its attention's einsum
    at tp 2 (`policy sweep`, 2026-12-06)."""
    counts = head_values(config)
    found: dict[int, nn.Module] = {}
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, nn.Embedding) and module.weight.shape[1] not in set(counts or ()):
                found.setdefault(id(module), module)
    return list(found.values())


def _head_layout(policy: Policy, config: object, topology: Topology) -> HeadLayout:
    spec = policy.attention
    q, kv = (v if isinstance(v, int) else config_value(config, v) for v in (spec.query_heads, spec.kv_heads))
    if not isinstance(q, int) or not isinstance(kv, int):
        raise InferenceSetupError(f"policy {policy.source}: config has no integer {spec.query_heads!r} / {spec.kv_heads!r}")
    return HeadLayout(q, kv, topology.tp_size, topology.tp_rank)


def _replace(layer: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent, _, attr = path.rpartition(".")
    owner = layer.get_submodule(parent) if parent else layer
    setattr(owner, attr, module)
    return owner


def split_attention(layer: nn.Module, spec: AttentionSpec, heads: HeadLayout, rows: tuple[str, ...] = ()
                    ) -> tuple[nn.Module, int] | None:
    """Split this layer's fused QKV (always) or separate Q/K/V (when KV heads < ranks) here, as `spec` (one of
    the policy's table's `variants()`) names them. Returns the attention module and head dim, or None where the
    layer has no such attention. Where the query is split here, any other linear of the attention that writes the
    query's width (a per-head output gate: AFMoE's `gate_proj`) keeps the same heads; `rows` (the layer's
    row-parallel paths) are never such a linear."""
    if spec.fused_qkv:
        if not _has(layer, spec.fused_qkv):
            return None  # e.g. a cross-attention-free variant of the layer
        shard, head_dim = split_fused_qkv(layer.get_submodule(spec.fused_qkv), spec.layout, heads)
        return _replace(layer, spec.fused_qkv, shard), head_dim, heads
    if not _has(layer, spec.key):
        if heads.replicated and _has(layer, spec.query):
            return _split_query_only(layer, spec, heads, rows)
        return None
    heads, head_dim = layer_heads(layer, spec, heads)
    if not heads.replicated and not heads.own:
        return layer.get_submodule(spec.key.rpartition(".")[0]) if "." in spec.key else layer, head_dim, heads
    query = layer.get_submodule(spec.query)
    q, _ = split_heads(query, heads.q_heads(), heads.query_heads)
    k, _ = split_heads(layer.get_submodule(spec.key), heads.kv_heads_of_rank(), heads.kv_heads)
    if _has(layer, spec.value):  # not where the key is the value (derive._value_is_key: Gemma 4's full attention)
        v, _ = split_heads(layer.get_submodule(spec.value), heads.kv_heads_of_rank(), heads.kv_heads)
        _replace(layer, spec.value, v)
    _replace(layer, spec.query, q)
    attention = _replace(layer, spec.key, k)
    _split_query_gates(layer, spec.key.rpartition(".")[0], heads, attention, query, rows)
    return attention, head_dim, heads


def _split_query_only(layer: nn.Module, spec: AttentionSpec, heads: HeadLayout, rows: tuple[str, ...]
                      ) -> tuple[nn.Module, int, HeadLayout]:
    """A layer whose attention has a query and no key or value of its own: it reads the keys and values an earlier
    layer made (Gemma 3n's last `num_kv_shared_layers`). Its query keeps this rank's heads as the other layers'
    queries do here (where the KV heads are copied: fewer than ranks). Left to DeepSpeed, its 64-row blocks gave
    one rank two heads of 32 and another none (Gemma 3n at tp 4: "mat1 and mat2 shapes cannot be multiplied
    (30x64 and 32x128)" in the shared layer's `o_proj`)."""
    query = layer.get_submodule(spec.query)
    q, head_dim = split_heads(query, heads.q_heads(), heads.query_heads)
    attention = _replace(layer, spec.query, q)
    _split_query_gates(layer, spec.query.rpartition(".")[0], heads, attention, query, rows)
    return attention, head_dim, heads


def _split_packed(layers: list[nn.Module], policy: Policy, topology: Topology) -> None:
    """Each linear a policy names `packed` (two halves read apart) cut to this rank's share of each half; a name that
    matches nothing in any layer of its class is one line."""
    found = set()
    for layer in layers:
        for pattern, paths in policy.packed.items():
            if not fnmatch.fnmatchcase(type(layer).__name__, pattern):
                continue
            for path in paths:
                if _has(layer, path) and isinstance(layer.get_submodule(path), nn.Linear):
                    linear = layer.get_submodule(path)
                    _replace(layer, path, split_packed(linear, topology.tp_size, topology.tp_rank,
                                                       f"{type(layer).__name__}.{path}"))
                    found.add((pattern, path))
    missing = [(pattern, path) for pattern, paths in policy.packed.items() for path in paths
               if (pattern, path) not in found]
    if missing:
        raise InferenceSetupError(f"policy {policy.source}: packed {missing[0][1]!r} names no linear inside "
                                  f"{missing[0][0]}")


def _split_query_gates(layer: nn.Module, prefix: str, heads: HeadLayout, attention: nn.Module, query: nn.Module,
                       rows: tuple[str, ...]) -> None:
    """Any other linear of the attention that writes the query's width (a per-head output gate), split with the
    query's heads: DeepSpeed would cut such a gate in 64-row blocks, not by this rank's heads (AFMoE at tp 4: "The
    size of tensor a (32) must match the size of tensor b (64)"). `prefix`: the attention's path in the layer."""
    for name, child in list(attention.named_children()):
        path = f"{prefix}.{name}" if prefix else name
        if (isinstance(child, nn.Linear) and child.weight.shape[0] == query.weight.shape[0]
                and child.weight.shape[1] == query.weight.shape[1] and not any(names_module(r, path) for r in rows)):
            _replace(layer, path, split_heads(child, heads.q_heads(), heads.query_heads)[0])


def layer_heads(layer: nn.Module, spec: AttentionSpec, heads: HeadLayout) -> tuple[HeadLayout, int]:
    """This layer's head layout and head dim: the configured one, or, where the layer's key projection holds
    another number of the attention's own `head_dim`-wide heads, one with the layer's own key/value head count
    (`own`, split here rather than by DeepSpeed, which reads the config's). MiMo-V2-Flash's sliding layers have
    twice the configured KV heads: split and sized by the config's count, the sharded forward failed ("The size of
    tensor a (2) must match the size of tensor b (4)" at tp 2, 2026-12-06)."""
    key = layer.get_submodule(spec.key).weight.shape[0]
    attention = layer.get_submodule(spec.key.rpartition(".")[0]) if "." in spec.key else layer
    own = getattr(attention, "head_dim", None)
    if not isinstance(own, int) or own <= 0 or key % own or key // own == heads.kv_heads:
        return heads, key // heads.kv_heads
    return HeadLayout(heads.query_heads, key // own, heads.tp_size, heads.tp_rank, own=True), own


def _attention_kept_whole(policy: Policy, layer: nn.Module, spec: AttentionSpec) -> bool:
    """Whether the attention the table names is, in this layer, inside a module the policy keeps whole: a vision or
    audio tower's attention with head counts of its own (Gemma 3's SigLIP layers, Voxtral's encoder), kept whole
    by the derivation, was split by the text model's table all the same ("SiglipAttention has no attribute
    'num_key_value_groups'", `policy sweep`, 2026-12-06)."""
    path = (spec.fused_qkv or spec.key).rpartition(".")[0]
    entries = [e for pattern, paths in policy.replicated.items() if fnmatch.fnmatchcase(type(layer).__name__, pattern)
               for e in paths]
    return bool(path) and _has(layer, path) and any(under_replicated(e, layer, path) for e in entries)


def _rows_of(policy: Policy, layer: nn.Module) -> tuple[str, ...]:
    return tuple(r for pattern, rows in policy.layers.items() if fnmatch.fnmatchcase(type(layer).__name__, pattern)
                 for r in rows)


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
        return True
    except AttributeError:
        return False


def _set_local_attributes(attention: nn.Module, policy: Policy, heads: HeadLayout, head_dim: int) -> None:
    """`[attention.local]`: each attribute (of the attention, of a module inside it, or of its config) set to this
    rank's value; a list of values is a tuple attribute's (OLMo's `fused_dims`)."""
    values = heads.local_values(head_dim)
    config_copied = False
    for attr, value_name in policy.attention.local:
        owner = attention
        if attr.startswith("config."):
            attr = attr.removeprefix("config.")
            if not config_copied:  # the model's config is shared by every layer and by generate: never change it
                attention.config = copy.copy(attention.config)
                config_copied = True
            owner = attention.config
        elif "." in attr:  # a module inside the attention (ChatGLM's `core_attention`)
            inner, _, attr = attr.rpartition(".")
            if not _has(attention, inner):
                raise InferenceSetupError(f"policy {policy.source}: {type(attention).__name__} has no module {inner!r} "
                                          f"([attention.local])")
            owner = attention.get_submodule(inner)
        if not hasattr(owner, attr):
            raise InferenceSetupError(f"policy {policy.source}: {type(owner).__name__} has no attribute {attr!r} "
                                      f"([attention.local])")
        value = tuple(values[v] for v in value_name) if isinstance(value_name, tuple) else values[value_name]
        setattr(owner, attr, type(getattr(owner, attr))(value) if isinstance(value, tuple) else value)


def split_per_head_parameters(attention: nn.Module, heads: HeadLayout) -> None:
    """A parameter of the attention itself with one value per query head (GPT-OSS's attention `sinks`): this
    rank's heads of it, the ones its query rows hold (DeepSpeed gives each rank a contiguous run of heads), recorded
    for shard-aware loading (`load/slices.py`)."""
    mine = heads.q_heads()
    for name, p in list(attention._parameters.items()):
        if isinstance(p, torch.Tensor) and p.ndim == 1 and p.shape[0] == heads.query_heads and heads.tp_size > 1:
            with torch.no_grad():
                part = nn.Parameter(p[mine.start:mine.stop].clone(), requires_grad=False)
            record(part, 0, ((mine.start, mine.stop),), p.shape)
            attention._parameters[name] = part


def _split_per_head_parameters_deepspeed_left(model: nn.Module, policy: Policy, done: set[int],
                                              topology: Topology) -> None:
    """The per-head parameters (`split_per_head_parameters`) of the modules DeepSpeed split by heads on its own, no
    table naming them (a multi-head latent attention: HY-V4's, with `sinks` of one value per query head), seen by
    their head count, which DeepSpeed set to this rank's: DeepSpeed leaves such a parameter whole, and HY-V4's
    sharded forward failed ("Expected size 2 but got size 4", `policy sweep`, 2026-12-06). DeepSpeed splits the
    heads evenly (`tp_grain_size`) in runs by rank."""
    counts = head_values(model.config)
    if counts is None or counts[0] % topology.tp_size:
        return
    heads = HeadLayout(counts[0], counts[0], topology.tp_size, topology.tp_rank)
    for layer in _layers(model, policy):
        for module in layer.modules():
            if id(module) not in done and heads.local_q in {getattr(module, a, None) for a in ("num_heads",
                                                                                            "num_attention_heads")}:
                split_per_head_parameters(module, heads)


def _unchecked(policy: Policy | None, model: nn.Module) -> str | None:
    """How to name `policy` if nobody has checked it on this architecture, else None: shipped files are checked
    by the project's architecture matrix; a derived policy, DeepSpeed's automatic mode and a user's file are not."""
    from ..policy.schema import POLICY_DIR

    model_type = getattr(model.config, "model_type", "?")
    if policy is None:
        return f"DeepSpeed's automatic policy (autotp) for model_type {model_type!r}"
    if is_derived(policy):
        return f"the policy derived for model_type {model_type!r} ({derived_summary(policy)})"
    if policy.source.resolve().parent != POLICY_DIR.resolve():
        return f"policy {policy.source}"
    return None


def _layer_patterns(policy: Policy | None, model: nn.Module) -> list[str]:
    if isinstance(policy, Policy):
        return list(policy.layers)
    try:
        return list(derive_policy(model).layers)  # what AutoTP will treat as layers
    except InferenceSetupError:
        return ["*Layer", "*Block"]


# The whole step ------------------------------------------------------------------------------------

@collector_paused()  # DeepSpeed builds a module per split linear: no full collection among them
@reading_configured_values  # a heterogeneous config's counts, as DeepSpeed and the policy read them
def shard_model(
    model: nn.Module,
    args: DeepSpeedInferenceArguments,
    topology: Topology,
    groups: ProcessGroups,
    policy: Policy | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    verify: bool = True,
    pending: PendingLoad | None = None,
) -> tuple[nn.Module, ShardReport]:
    """Shard `model` in place over this rank's TP group; returns the (same) model and a report.

    A skeleton from `load.loaders.load_model` (parameters on `meta`) is filled here from `pending`, its
    `PendingLoad` (`pending_load(skeleton)`: where loading ends and sharding begins), with only this rank's part of
    each split tensor read from the checkpoint; the pending load is then taken off the model. A
    policy nobody has checked (derived, `autotp`, or a file outside the shipped `policies/`) is checked numerically
    here first (`policy/verify.py`), unless `verify` is False (`policy check` compares the whole model itself)."""
    import deepspeed

    from ..policy.verify import reference_copies, verify_sharded_layers

    if policy is not None and not isinstance(policy, Policy):  # "derive", "auto", a path: resolved before, once
        raise TypeError(f"shard_model takes a Policy, or None for DeepSpeed's AutoTP, not {policy!r}: resolve it with "
                        "policy.derive.policy_for_model first (setup_inference does)")
    if pending is None and is_skeleton(model):
        raise TypeError("shard_model got a skeleton (weights not read yet) without its pending load: pass "
                        "pending=pending_load(model) (setup_inference does)")
    loader = pending.open(topology.tp_size, topology.tp_rank, policy_id(policy), dtype, groups.tp) if pending else None
    device = torch.device(device)
    full_bytes = _param_bytes(model) * torch.finfo(dtype).bits // torch.finfo(next(model.parameters()).dtype).bits
    kwargs: dict = {"dtype": dtype, "replace_with_kernel_inject": args.replace_with_kernel_inject}
    heads, attentions, copies, unchecked, apart = None, [], {}, None, []
    if topology.tp_size > 1:
        kwargs["tensor_parallel"] = {"tp_size": topology.tp_size, "mpu": ModelParallelUnit(groups), "tp_group": groups.tp,
                                     "tp_grain_size": even_grain(model, topology.tp_size)}
        unchecked = _unchecked(policy, model) if not args.replace_with_kernel_inject else None
        share_patterns = _layer_patterns(policy, model)
        before = full_sizes(model, share_patterns)
        if verify and unchecked and not isinstance(loader, PreShardedLoader):  # pre-sharded: checked when sharded
            copy_start = time.perf_counter()
            copies = reference_copies(model, share_patterns, loader)
            copy_seconds = time.perf_counter() - copy_start
        if isinstance(policy, Policy) and not args.replace_with_kernel_inject:
            layers = _layers(model, policy)
            for layer in layers:
                conv1d_to_linear(layer)
                plain_subclass(layer)
            kept_ids: set[int] = set()
            if policy.replicated:
                replicate_modules(layers, policy, apart, kept_ids)
            apart += [m for m in _embeddings_not_per_head(layers, model.config) if all(m is not a for a in apart)]
            for layer in layers:
                for pattern, paths in policy.experts.items():
                    if fnmatch.fnmatchcase(type(layer).__name__, pattern):
                        for experts in experts_modules(layer, paths):
                            split_experts(experts, topology.tp_size, topology.tp_rank, groups.tp)
                for pattern, paths in policy.mixers.items():
                    if fnmatch.fnmatchcase(type(layer).__name__, pattern):
                        for mixer in ssm_mixers(layer, paths, skip=kept_ids):
                            split_ssm_mixer(mixer, topology.tp_size, topology.tp_rank, groups.tp)
            _split_packed(layers, policy, topology)
            if policy.head_biases or policy.head_inputs:
                heads_of = head_values(model.config)
                if heads_of is None:
                    raise InferenceSetupError(f"policy {policy.source}: head_biases and head_inputs cut a bias to a "
                                              "rank's heads, but no attribute of the model's config gives its head "
                                              "count (num_attention_heads, n_head, ...)")
                per_head = HeadLayout(heads_of[0], heads_of[0], topology.tp_size, topology.tp_rank)
                slice_head_biases(model, policy.head_biases, per_head, policy.source)
                cut_head_inputs(layers, policy.head_inputs, per_head, policy.source)
            if policy.attention is not None:
                heads = _head_layout(policy, model.config, topology)
                attentions = [a for layer in layers for spec in policy.attention.variants()
                              if not _attention_kept_whole(policy, layer, spec)
                              and (a := split_attention(layer, spec, heads, _rows_of(policy, layer)))]
            kwargs["injection_policy"] = build_injection_policy(policy, model)
    if loader is not None:
        loader.fill_replicated(model, device)
        kwargs["keep_module_on_host"] = True  # DeepSpeed would `.to()` the still-meta linears
    kept = buffers_kept_apart(model, dtype)
    dtypes = parameter_dtypes(model)
    with kv_heads_seen_by_deepspeed(model.config, heads), yuan_named_apart(model), modules_kept_apart(model, apart), \
            shared_modules_split_once(model), modules_printed_once(), lm_head_tied_as_the_model_ties(model), \
            lm_head_not_copied(isinstance(loader, PreShardedLoader)), autotp_replacements() as seen:
        try:
            engine = deepspeed.init_inference(model, **kwargs)
        except Exception as e:
            if not sharding_failure(e):
                raise
            where = f" while splitting {seen['last']}" if seen.get("last") else ""
            raise InferenceSetupError(
                f"DeepSpeed could not shard model_type {getattr(model.config, 'model_type', '?')!r}{where}: "
                f"{type(e).__name__}: {first_line(e)}; a policy can keep that module whole (`replicated`): "
                "`ds-inference policy suggest MODEL_DIR > my.toml`") from e
    restore_buffers(engine.module, kept)
    restore_parameter_dtypes(engine.module, dtypes, dtype)
    if topology.tp_size > 1 and dtype in (torch.float16, torch.bfloat16):
        half = str(dtype).removeprefix("torch.")
        if args.reduce_dtype == "fp32":
            reduce_in_fp32(engine.module)
        logger.warning("deepspeed_inference: %s at tp %d, row-parallel sums in %s: outputs can part from one device "
                       "where the model's top choices are within rounding, as they part between batch sizes on one "
                       "device (fp32: identical token ids); `ds-inference policy check MODEL_DIR --tp-size %d` checks "
                       "this model in %s and tells rounding from a wrong split", half, topology.tp_size,
                       "fp32" if args.reduce_dtype == "fp32" else half, topology.tp_size, half)
    lm_head_reads_any_rank(engine.module)
    if topology.tp_size > 1:
        statistics_across_ranks(engine.module, groups.tp)
    for attention, head_dim, own_heads in attentions:
        _set_local_attributes(attention, policy, own_heads, head_dim)
        split_per_head_parameters(attention, own_heads)
    if isinstance(policy, Policy) and topology.tp_size > 1 and not args.replace_with_kernel_inject:
        _split_per_head_parameters_deepspeed_left(engine.module, policy, {id(a) for a, *_ in attentions}, topology)
    sharded = engine.module
    loading = ""
    if loader is not None:
        loader.fill_sharded(sharded, topology.tp_rank, device)
        sharded.to(device)
        loaded(model)
        loader.ready_seconds = time.perf_counter() - pending.start
        loading = loader.summary()
    share = None
    if topology.tp_size > 1 and not args.replace_with_kernel_inject:
        share = measure(sharded, share_patterns, before, topology.tp_size, policy if isinstance(policy, Policy) else None)
        if share.over_target():
            logger.warning("deepspeed_inference: %s", share.warning(topology.tp_size))
    if copies:
        summary = verify_sharded_layers(sharded, copies, unchecked, dtype, groups.tp)
        logger.warning("deepspeed_inference: %s (+ %.2f s to copy the reference layers)", summary, copy_seconds)
    report = ShardReport(
        policy=str(policy.source) if isinstance(policy, Policy) else (
            "kernel injection" if args.replace_with_kernel_inject else "autotp"),
        param_bytes=_param_bytes(sharded),
        full_param_bytes=full_bytes,
        replicated_kv=bool(heads and heads.replicated),
        policy_object=policy if isinstance(policy, Policy) else None,
        loading=loading,
        weight_share=share,
    )
    return sharded, report
