"""What the pinned DeepSpeed (0.19) gets wrong or does not do with transformers 5, each named with the
DeepSpeed behaviour and the evidence, so that a DeepSpeed upgrade is the review of this file:

* kernel injection does not run with transformers 5 (`kernel_injection_problem`: refused up front);
* its CPU all-reduce busy-waits with no timeout, reads LOCAL_SIZE, ignores process groups, and leaks /dev/shm
  (`cpu_all_reduce`: gloo unless asked for, `init_deepspeed_comm`, `unlink_shm_segment`);
* it special-cases the class GPT2Block (`plain_subclass`);
* it casts every floating buffer to the inference dtype (`buffers_kept_apart`, `restore_buffers`);
* its head-aware split reads the KV-head count for the query side too (`kv_heads_seen_by_deepspeed`);
* it splits CodeGen's fused qkv_proj in 4 blocks per rank (`head_grain`: refused up front, not by its assert);
* it splits MLPs in blocks of 64 rows, unevenly where the width is not a multiple of 64 x tp (`even_grain`);
* its AutoTP parser refuses some models by class name before parsing them, and parses only the first layer of
  each class (`autotp_row_parallel`);
* it routes any module whose printed name holds "Yuan" (HunYuan) to Yuan-specific code (`yuan_named_apart`);
* it prints whole layers again for every linear it replaces (`modules_printed_once`);
* it splits every subclass of nn.Linear, a router with its own forward too (`modules_kept_apart`);
* it splits a module shared by several layers once in each (`shared_modules_split_once`);
* an exception inside its sharding names no module (`autotp_replacements`: the last linear it was replacing);
* its `deepspeed` command dies alone on SIGTERM, leaving every rank running (`end_ranks_with_the_runner`).

Elsewhere, because it is the substance of a module rather than a patch: `shard/attention.py` splits the
projections DeepSpeed 0.19.8 splits wrongly (fused QKV, fewer KV heads than ranks). Not worked around:
DeepSpeed treats any linear named `down_proj` as row-parallel whatever a policy says, which every shipped
policy agrees with (the policy checker would show a disagreement).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as metadata
import os
import sys

import torch
from torch import nn

from .errors import InferenceSetupError
from .policy.configs import text_config
from .topology import Topology, threads_per_rank

# DeepSpeed's fused inference kernels (`replace_with_kernel_inject`) run with none of the architectures they
# list under transformers 5: on an H200 (2026-11-30, deepspeed 0.19.8, transformers 5.24.0, torch 2.11 cu130;
# `launch/gpu_check.py --sections kernel_inject`, its per-architecture matrix) the kernels built and then
# every tiny model failed in its first forward: gpt2 ('DynamicCache' object has no attribute 'dtype'),
# llama and gptj ('tuple' object has no attribute 'size'), opt (asks to merge checkpoints), bloom (refused
# by DeepSpeed itself after transformers 4.43.4), gpt_neox ('GPTNeoXAttention' has no 'hidden_size').
KERNELS_LAST_BROKEN = (0, 19)  # the newest DeepSpeed minor seen failing; a newer one is let through


def _major_minor(package: str) -> tuple[int, int]:
    try:
        parts = metadata.version(package).split(".")
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (metadata.PackageNotFoundError, ValueError, IndexError):
        return (0, 0)


def kernel_injection_problem() -> str | None:
    """Why `--replace_with_kernel_inject` cannot work with the installed versions, or None."""
    ds, tr = _major_minor("deepspeed"), _major_minor("transformers")
    if ds <= KERNELS_LAST_BROKEN and tr >= (5, 0):
        return (f"DeepSpeed {metadata.version('deepspeed')}'s inference kernels do not run with transformers "
                f"{metadata.version('transformers')} (every architecture they list fails in its first forward; "
                "checked on an H200): drop the flag, tensor-parallel sharding works without it")
    return None


# Communication ----------------------------------------------------------------------------------------------

# Which all-reduce CPU ranks use: torch.distributed's gloo (the default), or DeepSpeed's shared-memory op.
CPU_ALL_REDUCE_ENV = "DS_INFERENCE_CPU_ALL_REDUCE"
CPU_ALL_REDUCES = ("gloo", "shm")


def cpu_all_reduce(topology: Topology, environ=os.environ) -> str:
    """`gloo` unless DS_INFERENCE_CPU_ALL_REDUCE=shm asks for DeepSpeed's shared-memory all-reduce (and it can
    serve this world). Why gloo by default: DeepSpeed's op (`shm.cpp`, `wait_buffer_state_until_2`) busy-waits
    with no timeout and no yield, so ranks that share their cores with anything else collapse (more ranks than
    free cores ran up to 125x slower than with gloo on this 2-core machine, 2026-12-01), and only our watchdog
    bounds a wait for a stopped peer; gloo honours the process-group timeout. It also costs a ~25 s JIT build per venv and a
    66 MB /dev/shm buffer per rank that DeepSpeed never removes. On tiny CPU models gloo is no slower:
    the whole test suite took 517 s with gloo and 537 s with shm (`pytest tests -n 2`, same tree). The op
    ignores process groups and reads LOCAL_SIZE, so it can serve only one TP group spanning the whole
    single-node world; otherwise gloo is used whatever the variable says."""
    wanted = environ.get(CPU_ALL_REDUCE_ENV, "gloo")
    if wanted not in CPU_ALL_REDUCES:
        raise InferenceSetupError(f"{CPU_ALL_REDUCE_ENV}={wanted!r} is invalid; valid: {', '.join(CPU_ALL_REDUCES)}")
    spans_node = (topology.world_size > 1 and topology.tp_size == topology.world_size
                  and environ.get("LOCAL_SIZE") == str(topology.world_size))
    return "shm" if wanted == "shm" and spans_node else "gloo"


def unpin_world_group() -> None:
    """DeepSpeed's `TorchBackend.barrier` and `monitored_barrier` default their `group` to
    `torch.distributed.GroupMember.WORLD`, evaluated when `deepspeed.comm.torch` is first imported: imported after
    the default process group exists (a Trainer's arguments create it before the model is sharded), the world group
    stays pinned in those defaults for the life of the process, and its gloo threads with it, after
    `destroy_process_group` too (the one group left at a user's script's exit, 2026-12-06). Their bodies read None
    as the world group, so None is put back where a group was pinned; for the teardown at exit."""
    backend = getattr(sys.modules.get("deepspeed.comm.torch"), "TorchBackend", None)
    if backend is None:
        return
    from torch.distributed import ProcessGroup

    for function in vars(backend).values():
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(isinstance(d, ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d for d in defaults)


def init_deepspeed_comm(topology: Topology) -> str:
    """Wrap the already-initialised torch process group in deepspeed.comm (on CPU with the all-reduce chosen
    by `cpu_all_reduce`; on GPU DeepSpeed's own choice, NCCL). Returns the all-reduce used, for the log."""
    import deepspeed

    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]  # torchrun's name for it
    local_size = os.environ.get("LOCAL_SIZE")
    on_gpu = torch.cuda.is_available()
    if not on_gpu and "OMP_NUM_THREADS" not in os.environ and local_size:
        # The deepspeed launcher leaves every CPU rank all cores: oversubscribed ranks stall in all-reduce.
        torch.set_num_threads(threads_per_rank(int(local_size)))
    shm_ok = not on_gpu and cpu_all_reduce(topology) == "shm"
    if not shm_ok:  # do not even build (JIT-compile, ~25 s) the shared-memory op that would go unused
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=None)
    comm = importlib.import_module("deepspeed.comm.comm")
    if comm.cdb is not None and not shm_ok and getattr(comm.cdb, "shm_vector_kernel_level", 0):
        comm.cdb.shm_vector_kernel_level = 0
    if comm.cdb is not None and getattr(comm.cdb, "shm_comm_op", None) is not None:
        unlink_shm_segment(topology.rank)
    return "nccl" if on_gpu else "DeepSpeed shared memory" if shm_ok else "gloo"


def unlink_shm_segment(rank: int) -> None:
    """Remove this rank's name of DeepSpeed's CPU all-reduce buffer (/dev/shm, 66 MB a rank).

    DeepSpeed never removes it (only a clean `shared_close`, which nothing calls, would), so every run
    left 66 MB per rank in /dev/shm: 21 GB after a day of test runs on a 24 GB machine. Every rank
    maps every peer's buffer inside `init_distributed`; after a barrier the names are no longer
    needed, and the memory goes back to the system when the last rank exits, however it exits.
    """
    import torch.distributed as dist

    dist.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


# The model, around init_inference -----------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}


def plain_subclass(layer: nn.Module) -> None:
    """DeepSpeed special-cases the class GPT2Block itself (Conv1D-only sharding); a same-named subclass
    takes the ordinary nn.Linear path."""
    cls = type(layer)
    if cls.__name__ == "GPT2Block" and cls.__module__.startswith("transformers."):
        _SUBCLASSES.setdefault(cls, type(cls.__name__, (cls,), {"__module__": __name__}))
        layer.__class__ = _SUBCLASSES[cls]


def buffers_kept_apart(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating buffers the model keeps in another dtype than its weights (RoPE's `inv_freq` is fp32 under
    `from_pretrained(dtype=bf16)`). DeepSpeed's `init_inference` casts every floating buffer to the inference
    dtype: in bf16 that rounds the rotary frequencies, and the next-token logits of a Llama moved by one bf16
    step from the one-device model's (seen on an H200: greedy tokens of a random 0.9B Llama differed).
    Kept here, put back after."""
    return {name: b.detach().clone() for name, b in model.named_buffers()
            if b.is_floating_point() and b.dtype != dtype and not b.is_meta}


def parameter_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Each parameter's dtype before DeepSpeed shards, to put back after where DeepSpeed lost it
    (`restore_parameter_dtypes`). DeepSpeed 0.19.8's `AutoTP._slice_embedding` builds the split embedding as
    `nn.Embedding(rows, columns)`, in the default dtype, and copies the bf16 weight into it: LongT5's and
    SwitchTransformers' `relative_attention_bias` became fp32 in a bf16 model, and their sharded forward failed
    ("expected scalar type Float but found BFloat16", `ds-inference policy matrix --dtype bf16`, 2026-12-04)."""
    return {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}


def restore_parameter_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype], dtype: torch.dtype) -> list[str]:
    """Cast back to `dtype` (the inference dtype) every parameter that was in it before DeepSpeed sharded and is not
    now; returns their names. A parameter in another dtype before (a model's fp32 weights, which DeepSpeed casts to
    the inference dtype on purpose) is left as DeepSpeed made it."""
    changed = []
    for name, p in model.named_parameters(remove_duplicate=False):
        want = dtypes.get(name)
        if want == dtype and p.dtype != want and p.is_floating_point():
            p.data = p.data.to(want)
            changed.append(name)
    return changed


def restore_buffers(model: nn.Module, kept: dict[str, torch.Tensor]) -> None:
    for name, value in kept.items():
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:  # kernel injection replaced the module that held it
            continue
        if attr in module._buffers and module._buffers[attr] is not None:
            module._buffers[attr] = value.to(module._buffers[attr].device)


@contextlib.contextmanager
def kv_heads_seen_by_deepspeed(config: object, heads):
    """While DeepSpeed splits, report at least tp KV heads, so its head-aware split gives every rank
    tp-th of the query side (the KV side, if any, was split by us)."""
    from deepspeed.module_inject.tp_shard import _ATTN_HEAD_ATTRS, _KV_HEAD_ATTRS  # what DeepSpeed reads, in order

    # DeepSpeed reads the counts from the model's config, or its `text_config` (tp_shard.AutoTPMeta); T5Gemma's
    # are in its encoder and decoder configs only (`get_text_config()`), so DeepSpeed found none and split each
    # projection in 64-row blocks: a 2-KV-head k_proj of 32 rows all on rank 0 ("size of tensor a (4) must
    # match the size of tensor b (2)", 2026-12-03). They are lent to the top config while DeepSpeed splits.
    seen = getattr(config, "text_config", None) or config
    lent = []
    if hasattr(config, "get_text_config") and not any(getattr(seen, n, None) is not None for n in _KV_HEAD_ATTRS):
        text = text_config(config)
        for n in dict.fromkeys((*_KV_HEAD_ATTRS, *_ATTN_HEAD_ATTRS)):
            if getattr(text, n, None) is not None and n not in seen.__dict__:
                setattr(seen, n, getattr(text, n))
                lent.append(n)
    name = next((n for n in _KV_HEAD_ATTRS if getattr(seen, n, None) is not None), None)
    raised = heads is not None and name is not None and heads.replicated
    old = getattr(seen, name) if raised else None
    if raised:
        setattr(seen, name, heads.tp_size)
    try:
        yield
    finally:
        if raised:
            setattr(seen, name, old)
        for n in lent:
            seen.__dict__.pop(n, None)


def autotp_keeps_whole(path: str) -> bool:
    """Whether DeepSpeed 0.19's AutoTP leaves the linear at `path` (inside its layer) unsplit on purpose: its
    `_replace` returns these unchanged, "For TP layer skip, e.g., MoE gate, deepseek low rank layer skip"
    (`mlp.gate`, `block_sparse_moe.gate`, any `q_a_proj` or `kv_a_proj_with_mqa`; Qwen2-MoE's
    `mlp.shared_expert_gate`)."""
    return (path in ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")
            or "q_a_proj" in path or "kv_a_proj_with_mqa" in path)


@contextlib.contextmanager
def modules_kept_apart(model: nn.Module, modules: list[nn.Module]):
    """While DeepSpeed splits, these modules are out of the model (an nn.Identity in each place), then back: its
    AutoTP splits every nn.Linear and every subclass of one (`isinstance`, auto_tp.py `_replace_module`), and a
    router that subclasses nn.Linear with a forward of its own (Llama 4's, returning scores and logits) can
    neither be split nor be swapped for our ColumnShard."""
    wanted = {id(m) for m in modules}
    with _identity_at(model, [name for name, m in model.named_modules() if id(m) in wanted]):
        yield


@contextlib.contextmanager
def _identity_at(model: nn.Module, names: list[str]):
    """While it runs, an nn.Identity at each of these places of the model; then each place's own module again."""
    originals = [(name, model.get_submodule(name)) for name in names]
    for name in names:
        model.set_submodule(name, nn.Identity())
    try:
        yield
    finally:
        for name, module in originals:
            model.set_submodule(name, module)


# DeepSpeed 0.19's `set_lm_head` (replace_module.py) ties an output head still on meta to "the" input embedding:
# the last parameter whose name holds "word_embeddings.", "embed_tokens." or "wte.", whether or not the model ties
# them. Fuyu's `vision_embed_tokens` (a linear) came last: its bias, [128], became the head's weight and DeepSpeed's
# split of it raised IndexError (Fuyu and Inkling, shard-aware at tp 2, `policy sweep`, 2026-12-06).
EMBEDDING_NAMES = ("word_embeddings.", "embed_tokens.", "wte.")


@contextlib.contextmanager
def lm_head_tied_as_the_model_ties(model: nn.Module):
    """While DeepSpeed shards, every module holding a parameter its `set_lm_head` would take for the input embedding
    is kept apart (`modules_kept_apart`), but the model's own input embedding: DeepSpeed ties a head on meta to that
    one, then splits the head (a plain nn.Linear), and the loaders read a head the model does not tie again after
    the split, by its own name."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        head = embedding = None
    if embedding is not None and not isinstance(getattr(embedding, "weight", None), torch.Tensor):
        # a module of the model's own around its table (Kyutai's speech-to-text: text and codec codes in one
        # embedding, summed): the table is what DeepSpeed finds by its name (before: AttributeError, every rank)
        embedding = next((m for m in embedding.modules() if isinstance(m, nn.Embedding)), None)
    if head is None or embedding is None:
        yield
        return
    owners: dict[str, nn.Module] = {}
    for name, _ in model.named_parameters():
        if any(k in name for k in EMBEDDING_NAMES):
            owner = name.rpartition(".")[0]
            module = model.get_submodule(owner)
            if module is not head and module is not embedding:
                owners.setdefault(owner, module)
    # a head on meta the model does not tie, left unsplit by DeepSpeed (Ergo's, a linear class with a forward of its
    # own): `set_lm_head` tied it to the input embedding for good, and loaded pre-sharded its logits were the
    # embedding's (`policy sweep`, 2026-12-06); it gets its meta weight back, for the loader to read by its name
    untied_meta = getattr(head, "weight", None) is not None and head.weight.is_meta \
        and head.weight is not embedding.weight
    if untied_meta and tuple(head.weight.shape) != tuple(getattr(embedding, "weight", head.weight).shape):
        # nor to the model's own embedding where the shapes differ: Moshi's head [96, 128] became its embedding [97,
        # 128], split to [97, 64], which no loader can fill from the head's [96, 128] ("cannot tell which part of
        # lm_head.weight ... this rank holds", `policy sweep`, 2026-12-06). It gets a placeholder of its own shape
        # (not on meta: `set_lm_head` ties only a head on meta), which DeepSpeed splits and the loader fills after,
        # as it fills a head DeepSpeed tied. (Hiding the embedding instead left a linear on meta first in the model,
        # whose `device` DeepSpeed's engine then read as meta: `to_empty` gave every parameter new memory, without
        # DeepSpeed's record of each split.)
        head.weight = nn.Parameter(torch.zeros(head.weight.shape, dtype=head.weight.dtype,
                                               device=embedding.weight.device), requires_grad=False)
    with modules_kept_apart(model, list(owners.values())):
        yield
    now = model.get_output_embeddings() if untied_meta else None
    if now is not None and getattr(now, "weight", None) is embedding.weight:
        now._parameters["weight"] = nn.Parameter(torch.empty_like(embedding.weight, device="meta"),
                                                 requires_grad=False)


@contextlib.contextmanager
def shared_modules_split_once(model: nn.Module):
    """While DeepSpeed splits, a module that appears in several places of the model, as one object or as modules of
    one class whose parameters are all the same tensors (Zamba's `shared_transf`, one attention-and-MLP block tied
    into every hybrid layer), is in its first place only (an nn.Identity in the others); afterwards each other place
    has its own module back, holding the first place's split linears (its weights stay tied, its other state its
    own). AutoTP walks every place and split the tied weights again at each (a [256, 256] q_proj left [64, 256] at
    tp 2, logits 10 off, 2026-12-06)."""
    first: dict[tuple, str] = {}
    later: list[tuple[str, str]] = []  # (place, the first place of the same module or weights)
    for name, m in model.named_modules(remove_duplicate=False):
        if not name or any(name.startswith(f"{n}.") for n, _ in later):
            continue
        if isinstance(m, nn.Linear) or not any(isinstance(c, nn.Linear) for c in m.modules()):
            continue  # a linear tied to an embedding (an lm_head) is DeepSpeed's own business; nothing to split
        key = (type(m), *(id(p) for p in m.parameters(recurse=True)))  # of one class: T5Gemma's lm_head module
        # holds the weight its embeddings hold
        if key in first and not name.startswith(f"{first[key]}."):
            later.append((name, first[key]))
        else:
            first.setdefault(key, name)

    originals = [(name, model.get_submodule(name)) for name, _ in later]
    with _identity_at(model, [name for name, _ in later]):
        yield
    for (name, source), (_, module) in zip(later, originals):
        split = model.get_submodule(source)
        if split is module:
            continue  # one object in several places: split once, already everywhere
        for path, child in list(module.named_modules()):
            if path and isinstance(child, nn.Linear):
                module.set_submodule(path, split.get_submodule(path))


@contextlib.contextmanager
def autotp_replacements():
    """While DeepSpeed shards, record the last linear its AutoTP was replacing ({"last": "LayerClass.path"}): an
    exception from inside init_inference names no module of the user's model (HunYuan-MoE's RuntimeError said
    only "shape '[...]' is invalid for input of size ..."), and the one-line error should."""
    from unittest import mock

    from deepspeed.module_inject.auto_tp import AutoTP

    seen: dict[str, str] = {}
    original = AutoTP._replace

    def replace(self, child, name, conv_linear_layer):
        seen["last"] = f"{type(self.module).__name__}.{name.strip('.')}"
        return original(self, child, name, conv_linear_layer)

    with mock.patch.object(AutoTP, "_replace", replace):
        yield seen


# DeepSpeed 0.19's LmHeadLinearAllreduce cuts its input's features as `input[:, :, a:b]` (module_inject/layers.py),
# so it reads a 3-D [batch, sequence, hidden] input only. ProphetNet calls its lm_head on [batch, ngram, sequence,
# hidden]: each rank cut the sequence instead, their partial logits had different shapes, and the all-reduce waited
# until gloo's 120 s timeout (tiny ProphetNet at tp 2, 2026-12-04). Any other rank is given the 3-D view it reads.
def lm_head_reads_any_rank(model: nn.Module) -> int:
    """Let every DeepSpeed-split lm_head take inputs of any rank (3-D views of them); returns how many."""
    from deepspeed.module_inject.layers import LmHeadLinearAllreduce

    found = 0
    for module in model.modules():
        if isinstance(module, LmHeadLinearAllreduce):
            module.forward = _any_rank(module.forward)
            found += 1
    return found


def _any_rank(forward):
    def read(input: torch.Tensor) -> torch.Tensor:
        if input.dim() == 3:
            return forward(input)
        out = forward(input.reshape(-1, 1, input.shape[-1]))
        return out.reshape(*input.shape[:-1], out.shape[-1])

    return read


# DeepSpeed 0.19's LmHeadLinearAllreduce clones the whole output head before it cuts this rank's columns out of
# the copy (`module.weight.clone()`, layers.py), to untie it from a tied input embedding; and `set_lm_head`
# (replace_module.py) ties a head still on `meta` back to the embedding first, so a placeholder does not avoid the
# copy. Where the loader reads the head's own shard after the split anyway (a pre-sharded rank file stores it),
# the copy is thrown away: for a 32-layer Llama with a tied 8192 x 2048 fp32 embedding at tp 2 it was 0.045 of a
# pre-sharded rank's 0.2 s to a ready model (timers, 2026-12-04). While DeepSpeed shards, a head it replaces is
# given a `meta` weight of the same shape instead of the copy; DeepSpeed's cut of it (its record of the split) is
# then meta too, and the loader fills it. DeepSpeed's last `set_lm_head` (after every layer is replaced) ties a head
# whose weight is on meta to the embedding again, the new head included when the policy pass replaced it first
# (ProphetNet: rank 1's head, cut to [96, 0], came back whole, [96, 64], and its forward failed); the placeholder
# is put back where that happened.
@contextlib.contextmanager
def lm_head_not_copied(read_after: bool):
    """While DeepSpeed shards: a split output head gets a meta weight, not a copy, when `read_after` (the loader
    fills every meta parameter after the split); otherwise nothing changes."""
    from deepspeed.module_inject.layers import LinearAllreduce, LmHeadLinearAllreduce

    if not read_after:
        yield
        return
    original = LmHeadLinearAllreduce.__init__
    placed: list[tuple[nn.Module, nn.Parameter]] = []

    def placeholder(self, module, mp_group, **kwargs):
        self.name = "lm_head"  # as DeepSpeed's own __init__ does, before the split
        module.weight = nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        LinearAllreduce.__init__(self, module, mp_group, **kwargs)
        placed.append((self, self.weight))

    LmHeadLinearAllreduce.__init__ = placeholder
    try:
        yield
    finally:
        LmHeadLinearAllreduce.__init__ = original
        for head, weight in placed:
            if head.weight is not weight:  # tied to the embedding again by set_lm_head
                head._parameters["weight"] = weight


# DeepSpeed 0.19 routes a layer to its Yuan-specific code by the text of the module: `'Yuan' in str(self.module)`
# (module_inject/auto_tp.py `_replace`: v_proj becomes a Yuan_LinearLayer, o_proj a Yuan_LinearAllreduce; also
# replace_module.py and auto_tp.py's attribute update). str() of a module holds its class names, so transformers'
# HunYuan-MoE and HunYuan-dense ("HunYuanMoEV1DecoderLayer") took that path: a tiny HunYuan-MoE at tp 2 ended in
# a RuntimeError inside init_inference (2026-12-03). While DeepSpeed shards a model that is not Yuan itself
# (model_type "yuan", remote code), its modules' printed names spell "Yuan" apart; the classes are untouched.
YUAN_MODEL_TYPES = ("yuan",)


@contextlib.contextmanager
def yuan_named_apart(model: nn.Module):
    """While DeepSpeed shards `model`, print every module whose class name holds "Yuan" as "Y_uan" (unless the
    model is Yuan's own), so DeepSpeed's `'Yuan' in str(module)` tests see no Yuan."""
    renamed = []
    if getattr(getattr(model, "config", None), "model_type", None) not in YUAN_MODEL_TYPES:
        for module in model.modules():
            name = type(module).__name__
            if "Yuan" in name:
                module.__dict__["_get_name"] = lambda shown=name.replace("Yuan", "Y_uan"): shown
                renamed.append(module)
    try:
        yield len(renamed)
    finally:
        for module in renamed:
            module.__dict__.pop("_get_name", None)


# DeepSpeed 0.19 prints modules to decide (`'Yuan' in str(self.module)` for every linear it replaces,
# `"Yuan" in str(child)` for every child whose attributes it updates, regexes over `str(model)`): each print walks
# the whole layer again, DeepSpeed's own layers' `extra_repr` included. For a 32-layer Llama at tp 2 that was 1,476
# prints and 0.17 of the 0.71 s `shard_model` took on a pre-sharded rank (cProfile, 2026-12-04). While it shards,
# each module is printed once: the text a test reads is fixed when first printed. What DeepSpeed decides from it
# does not change, because every test reads class names ("Yuan", "GLM", "Arctic", "...Model"), and the modules it
# puts in place hold none that the original did not (Yuan_LinearLayer only where "Yuan" was already there).
@contextlib.contextmanager
def modules_printed_once():
    original = nn.Module.__repr__
    printed: dict[int, tuple[nn.Module, str]] = {}

    def once(self: nn.Module) -> str:
        hit = printed.get(id(self))
        if hit is None or hit[0] is not self:  # the module is held, so its id is not reused while this runs
            hit = printed[id(self)] = (self, original(self))
        return hit[1]

    nn.Module.__repr__ = once
    try:
        yield
    finally:
        nn.Module.__repr__ = original


# DeepSpeed 0.19's AutoTP splits CodeGen's fused qkv_proj as CodeGen's own attention lays it out, in
# `codegen_mp_num` = 4 blocks (deepspeed/module_inject/fusedqkv_utils.py, `_codegen_type_transpose`), and asserts
# `num_kv_heads % (tp_size * 4) == 0` in the middle of sharding: a tiny CodeGen with 4 heads at tp 2 failed there
# with "codgen autoTP requires num_kv_heads % (mp_size*codegen_mp_num) == 0" (2026-12-02), one with 8 heads passed
# every `policy check`. The grain is checked with the head counts instead, before the model loads.
_HEAD_GRAIN = {"codegen": 4}


def head_grain(model_type: str) -> int:
    """How many heads each rank's share must be a multiple of, in DeepSpeed's split of this model type (1: any)."""
    return _HEAD_GRAIN.get(model_type, 1)


# DeepSpeed's inference config splits every linear it has no head count for (MLPs, experts' `gate_proj`/`down_proj`
# by name, lm_head) in blocks of `tensor_parallel.tp_grain_size` = 64 rows, for its GPU kernels' alignment, the
# blocks spread over the ranks first to last: a 128-wide shared expert at tp 4 lands 64/64/0/0 (MiniCPM5-MoE and
# Kimi-Linear: 29.4% / 24.2% and 41.9% / 36.8% of a layer per rank, 2026-12-06), a 1408-wide MLP 384/384/320/320, a
# 2880-wide one 768/704/704/704. `even_grain` gives the largest block (64 at most) that splits every such width evenly.
DEEPSPEED_GRAIN = 64


def even_grain(model: nn.Module, tp_size: int) -> int:
    """The largest `tp_grain_size` (a power of two, DeepSpeed's 64 at most) with which every width of the model's
    linears that `tp_size` divides is split into equal shares; a width no split makes equal is left out."""
    widths = {w for m in model.modules() if isinstance(m, nn.Linear) for w in m.weight.shape if w % tp_size == 0}
    grain = DEEPSPEED_GRAIN
    while grain > 1 and any(w % (grain * tp_size) for w in widths):
        grain //= 2
    return grain


def autotp_row_parallel(model: nn.Module) -> list[tuple[type, list[str]]]:
    """DeepSpeed AutoTP's parse of `model`: [(layer class, its row-parallel `parent.linear` keys)], [] if none.

    `AutoTP.tp_parser` first refuses any model whose class name is in `AutoTP.supported`'s list (deberta,
    flaubert, fsmt, gpt2, led, longformer, xlm, xlnet in 0.19), by name, before parsing. The parse itself is
    generic (the linear before each norm, and o_proj/out_proj/down_proj-style names), and a derived policy is
    checked numerically before it is used: on tiny LED and FSMT it found fc2 and the attention outputs, and
    `policy check` matched the unsharded model (2026-12-02). GPT-2's Conv1D layers are not nn.Linear to the
    parser, so it finds nothing there (GPT-2 ships a policy). The parse looks at the first layer of each class
    only (`AutoTP.in_module_list` compares class names); here it sees the first of each kind (`layer_kind`), and
    `update_policy_list` merges the kinds of one class: a dense-first MoE's expert layers were never parsed."""
    from unittest import mock

    from deepspeed.module_inject.auto_tp import AutoTP

    from .policy.layers import layer_kind

    kinds: dict[int, tuple] = {}  # each layer's kind, computed once for the whole parse

    def kind_of(module) -> tuple:
        if id(module) not in kinds:
            kinds[id(module)] = layer_kind(module)
        return kinds[id(module)]

    def same_kind(module, module_list):  # AutoTP parses the first layer of each class only (`in_module_list`)
        return any(type(m) is type(module) and kind_of(m) == kind_of(module) for m in module_list)

    def merge(policy_list, module, gems):  # `update_policy_list` makes the first merge a set, then adds a list to
        for i, (cls, known) in enumerate(policy_list):  # it: a third kind of one class (LongT5) raised TypeError
            if cls is type(module):
                policy_list[i] = (cls, sorted({*known, *gems}))
                return policy_list
        policy_list.append((type(module), list(gems)))
        return policy_list

    with mock.patch.object(AutoTP, "supported", staticmethod(lambda m: True)), \
            mock.patch.object(AutoTP, "in_module_list", staticmethod(same_kind)), \
            mock.patch.object(AutoTP, "update_policy_list", staticmethod(merge)):
        try:
            return [(cls, list(names)) for cls, names in AutoTP.tp_parser(model) if names]
        except (AssertionError, ValueError, AttributeError):
            return []


# The launcher ------------------------------------------------------------------------------------------------

# DeepSpeed 0.19's `deepspeed` command (launcher/runner.py) starts `python -m deepspeed.launcher.launch`, which
# starts the ranks, and installs a SIGTERM/SIGINT handler only for multi-node pdsh runs: `kill PID` of the command
# (what a user or a scheduler's first signal sends) ended the command at once with exit 143 while launch.py and
# every rank ran on, with nobody left to wait for them (2026-12-02, tp 2 predict). launch.py itself forwards
# SIGTERM to the ranks' process trees. So each rank started by launch.py watches launch.py's parent: once it is
# no longer the command that started it (the command died, launch.py was re-parented), the rank with local rank
# 0 sends launch.py the SIGTERM the command did not pass on, and launch.py ends the ranks as on any SIGTERM.
RUNNER_POLL_SECONDS = 1.0
_runner_watch: dict = {}


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def end_ranks_with_the_runner() -> bool:
    """Start the watch (once per process) when this rank's parent is DeepSpeed's launch.py; returns whether it
    watches. Cost: two reads of /proc a second."""
    if _runner_watch or os.environ.get("LOCAL_RANK") != "0" or not os.path.isdir("/proc"):
        return bool(_runner_watch)
    launch = os.getppid()
    runner = _parent_of(launch)
    if "deepspeed.launcher.launch" not in _cmdline(launch) or runner in (None, 1):
        return False
    import signal
    import sys
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(RUNNER_POLL_SECONDS)
            now = _parent_of(launch)
            if now is None:
                return  # launch.py is gone: it ended the ranks itself, or this rank is on its way out too
            if now != runner:
                sys.stderr.write(f"\nerror: the deepspeed command (pid {runner}) has ended (SIGTERM or killed) but "
                                 "DeepSpeed 0.19 does not pass that on to the ranks: ending them [rank "
                                 f"{os.environ.get('RANK', '0')}]\n")
                sys.stderr.flush()
                os.kill(launch, signal.SIGTERM)
                return

    _runner_watch.update(launch=launch, runner=runner)
    threading.Thread(target=watch, daemon=True, name="ds-inference-runner-watch").start()
    return True
