"""Before a run uses a policy nobody has checked (derived from the model, DeepSpeed's `autotp`, or a file
of the user's), check it numerically: the sharded model against the same layers unsharded.

Before sharding, one full copy is kept of the first layer of each distinct kind (each layer class in
each list of layers, and each make-up of it: a T5 gets its first encoder and first decoder block, a DeepSeek-V3
its first dense and its first expert layer). After sharding, one short
probe input (8 tokens) runs through the sharded model; hooks record each chosen layer's input and
output, and the unsharded copy runs on the same input. A wrong split that still has the right shapes
(heads cut in the wrong layout, a projection that should have been row-parallel) shows up as a layer
whose output differs from its copy's, and the run stops with one line naming it.

Tolerance: max |sharded - unsharded| <= RTOL[dtype] x max |unsharded output - layer input|, the size of
what the layer adds to its input (the residual stream would hide a wrong attention block otherwise).
The largest ratio is agreed over the TP group, so every rank reports the same layer.

Cost at start-up: the weights of one layer per type (read whole from the checkpoint under shard-aware
loading), one forward of 8 tokens through the sharded model, and one layer forward per type
(README, "Policies").
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import time

import torch
from torch import nn

from ..errors import InferenceSetupError, first_line, sharding_failure
from .configs import text_config

logger = logging.getLogger(__name__)

RTOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
PROBE_TOKENS = 8


def first_layers(model: nn.Module, patterns) -> dict[str, nn.Module]:
    """Path -> module of the first layer of each kind (`policy.layer_kind`: a dense-first MoE's dense and expert
    layers, a hybrid's attention and mixer layers) of each class matching `patterns`, in each ModuleList."""
    from .layers import layer_kind

    chosen: dict[str, nn.Module] = {}
    seen = set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for index, child in enumerate(module):
            name = type(child).__name__
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            kind = (path, name, layer_kind(child))
            if kind not in seen:
                seen.add(kind)
                chosen[f"{path}.{index}" if path else str(index)] = child
    return chosen


def reference_copies(model: nn.Module, patterns, loader=None) -> dict[str, nn.Module]:
    """Unsharded copies of `first_layers`, taken before anything is split. A skeleton's layers (parameters on
    meta) get their weights read whole from the checkpoint through `loader`."""
    copies = {}
    for path, layer in first_layers(model, patterns).items():
        ref = copy.deepcopy(layer)
        if loader is not None:
            for name, p in list(ref.named_parameters()):
                if p.is_meta:
                    full = f"{path}.{name}"
                    if full not in loader.key_of:
                        break  # a tensor the checkpoint lacks: this layer type cannot be checked from the file
                    owner, _, attr = name.rpartition(".")
                    module = ref.get_submodule(owner) if owner else ref
                    module._parameters[attr] = nn.Parameter(loader._read_whole([full], p).clone(), requires_grad=False)
            if any(p.is_meta for p in ref.parameters()):
                logger.warning("deepspeed_inference: layer %s cannot be checked numerically (not all of its weights "
                               "are in the checkpoint)", path)
                continue
        copies[path] = ref.eval()
    return copies


def _first_tensor(value):
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


SPEECH_INPUTS = ("input_features", "input_values")


def main_input_name(model: nn.Module) -> str:
    """What the model's forward reads first: its `main_input_name`, or, for a SpeechEncoderDecoderModel (whose
    own is the generic "inputs"), its encoder's (`input_values` for wav2vec2, `input_features` for Whisper)."""
    name = getattr(model, "main_input_name", "input_ids")
    if name == "inputs" and hasattr(model, "get_encoder"):
        name = getattr(model.get_encoder(), "main_input_name", name)
    return name


AUDIO_TOKEN = ("audio_token_id", "audio_token_index")  # the token a model's audio is placed at among its ids


def audio_driven_input(model: nn.Module) -> str | None:
    """The audio input a model cannot generate without, or None where token ids are its input: its main input (a
    speech encoder's), or one its token ids do not stand in for although they are its main input: audio its
    generation encodes step by step (Kyutai's speech-to-text: `input_values` in `prepare_inputs_for_generation`),
    or audio its forward reads with no placeholder token to place it among the ids (Pop2Piano's features in place
    of the encoder's token embeddings, Voxtral-realtime's added to the tokens' position by position). A model that
    places audio at its audio tokens (Qwen2-Audio, Voxtral, Gemma 4) generates from text alone. The three were
    "unsharded model fails" in `policy sweep` (2026-12-07): given text alone, their own forward or generate refused."""
    import inspect

    name = main_input_name(model)
    if name in SPEECH_INPUTS:
        return name
    stepwise = inspect.signature(model.prepare_inputs_for_generation).parameters
    read = inspect.signature(model.forward).parameters
    found = [n for n in SPEECH_INPUTS if n in stepwise] or [n for n in SPEECH_INPUTS if n in read]
    if not found:
        return None
    if found[0] in stepwise:
        return found[0]
    # an audio token declared by the config, set or not (Voxtral's default config leaves it None, a checkpoint sets it)
    configs = [model.config, *(getattr(model.config, n, None) for n in (getattr(model.config, "sub_configs", None) or {}))]
    placed = any(hasattr(c, n) for c in configs if c is not None for n in AUDIO_TOKEN)
    return None if placed else found[0]


def random_speech_inputs(config, name: str, batch: int, generator: torch.Generator, new_tokens: int = 8,
                         prompt: int = 0) -> dict:
    """Random audio inputs of the shape a model with `config` and main input `name` reads, for a probe forward:
    Whisper-style log-mel frames ([batch, mel bins, 2 x max_source_positions]), Speech2Text-style frames
    ([batch, frames, features per frame]) or raw samples (`input_values`, a wav2vec2-style encoder); audio that
    goes with the tokens (a codec's frames, one a token: Kyutai's; mel frames `audio_length_per_tok` a token:
    Voxtral-realtime's) long enough for `prompt` tokens and `new_tokens` more. One `InferenceSetupError` for any
    other."""
    # a SpeechEncoderDecoderModel's encoder config; Canary's and Cohere ASR's Parakeet encoder (`encoder_config`)
    encoder = next((c for c in (getattr(config, a, None) for a in ("encoder", "encoder_config", "audio_config"))
                    if c is not None and hasattr(c, "to_dict")), config)
    codec = getattr(config, "codec_config", None)
    if name == "input_values" and codec is not None and isinstance(getattr(config, "frame_size", None), int):
        # [batch, channels, samples]: one codec frame per generated token, and one more (Kyutai's generate stops
        # at the audio's frames)
        return {name: torch.randn((batch, getattr(codec, "audio_channels", 1), config.frame_size * (new_tokens + 1)),
                                  generator=generator)}
    if name == "input_values":
        return {name: torch.randn((batch, 4000), generator=generator)}  # 0.25 s at 16 kHz
    per_token = getattr(config, "audio_length_per_tok", None)
    if name == "input_features" and isinstance(per_token, int) and hasattr(encoder, "num_mel_bins"):
        frames = per_token * (prompt + new_tokens)
        return {name: torch.randn((batch, encoder.num_mel_bins, frames), generator=generator)}
    if name == "input_features" and hasattr(encoder, "num_mel_bins") and hasattr(encoder, "max_source_positions"):
        return {name: torch.randn((batch, encoder.num_mel_bins, 2 * encoder.max_source_positions), generator=generator)}
    if name == "input_features" and hasattr(encoder, "input_feat_per_channel"):
        width = encoder.input_feat_per_channel * getattr(encoder, "input_channels", 1)
        frames = min(64, 4 * getattr(encoder, "max_source_positions", 16))  # its convolutions subsample by 4
        return {name: torch.randn((batch, frames, width), generator=generator)}
    # frames of features, time first: a conformer's mel bins (Parakeet: [batch, frames, num_mel_bins], subsampled
    # by 8) or stacked ones (SeamlessM4T: 2 x 80 per frame, `feature_projection_input_dim`); these three types
    # were refused in one line with no probe (`policy sweep`, 2026-12-06)
    width = getattr(encoder, "feature_projection_input_dim", None) or getattr(encoder, "num_mel_bins", None)
    if name == "input_features" and isinstance(width, int):
        return {name: torch.randn((batch, 64, width), generator=generator)}
    # features of the model's own width, in place of its token embeddings (Pop2Piano's encoder: a T5's)
    width = getattr(config, "d_model", None)
    if name == "input_features" and isinstance(width, int):
        return {name: torch.randn((batch, 16, width), generator=generator)}
    raise InferenceSetupError(f"{config.model_type}: no probe input is known for its {name!r}; known: token ids, "
                              "Whisper- and Speech2Text-style log-mel features, frames of mel bins, raw samples")


def _probe_inputs(model: nn.Module, device) -> dict:
    config = model.config
    g = torch.Generator().manual_seed(0)
    start = config.decoder_start_token_id if getattr(config, "decoder_start_token_id", None) is not None else 0
    name = main_input_name(model)
    if name in SPEECH_INPUTS:
        inputs = {k: v.to(device) for k, v in random_speech_inputs(config, name, 1, g).items()}
        return {**inputs, "decoder_input_ids": torch.full((1, 4), start, device=device), "use_cache": False}
    vocab = getattr(text_config(config), "vocab_size", None) or 32
    ids = torch.randint(min(3, vocab - 1), vocab, (1, PROBE_TOKENS), generator=g).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.cat([torch.full((1, 1), start, device=device), ids[:, :3]], dim=1)
    return inputs


def with_aligned_tokens(model: nn.Module, audio: dict, ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """`audio` (for `audio_driven_input`), with the token ids `ids` where the model adds its audio to its tokens
    position by position (Voxtral-realtime, `audio_length_per_tok` frames a token: its forward reads both)."""
    if not isinstance(getattr(model.config, "audio_length_per_tok", None), int):
        return audio
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask, **audio}


def _probe_pass(model: nn.Module, device) -> bool:
    """The probe: a forward on `_probe_inputs`, or, where the model's audio goes with its token ids as it generates
    (`audio_driven_input` of a model whose main input is token ids: its forward takes the audio in a form its
    generate makes, Kyutai's codec codes), two steps of its generate. Whether it was generate."""
    name = audio_driven_input(model)
    if name is None or main_input_name(model) in SPEECH_INPUTS:
        model(**_probe_inputs(model, device))
        return False
    audio = random_speech_inputs(model.config, name, 1, torch.Generator().manual_seed(0), new_tokens=1,
                                 prompt=PROBE_TOKENS)
    ids = _probe_inputs(model, torch.device("cpu"))["input_ids"]
    inputs = {k: v.to(device) for k, v in with_aligned_tokens(model, audio, ids).items()}
    # two steps: Kyutai encodes its audio for the second (its codec's layers reached); each layer is compared on its
    # first call (`verify_sharded_layers`)
    model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, num_beams=1)
    return True


class track_modules:
    """While active, which modules of `model` a forward is inside (a global forward pre/post hook): where an
    exception from a sharded forward came from, named by the innermost module's path."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.failed_in: str | None = None
        self.handles = []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            if id(module) in self.names:
                self.stack.append(self.names[id(module)])

        def post(module, args, output):
            if id(module) in self.names and self.stack:
                self.stack.pop()

        self.handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, kind, error, tb):
        if error is not None and self.stack:
            self.failed_in = self.stack[-1]
        for h in self.handles:
            h.remove()
        return False

    def where(self) -> str:
        return self.failed_in or "the model"


def _is_cache(value) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


def _with_heads_gathered(args: tuple, kwargs: dict, group) -> list[tuple[tuple, dict]]:
    """The layer's inputs with each per-head tensor made by a split part gathered over the TP group along its head
    axis, for its unsharded copy: T5's `position_bias`, [batch, this rank's heads, queries, keys], made by the first
    block's relative bias, split with the heads, and passed to every later block (the copy of the second block could
    not add it, and the check refused a derived policy the sharded model computed right: T5, Pop2Piano, 2026-12-07);
    MPT's ALiBi bias, [heads, queries, keys]; LongT5's local-attention bias, [batch, blocks, heads, block, 3 x block].
    A tensor of those shapes is per-head where the ranks hold different values of it: a mask, the same on each, is
    not. (Read from a failure of the copy before, a rank's one head at tp 4 broadcast over the copy's four without
    one: the check refused MPT, LongT5 and Pop2Piano at tp 4, `policy matrix` with the check on, 2026-12-07.)
    Returns the inputs so gathered, then, where there is one, a second form for a copy that fails on the first: one
    the same on every rank with more than one value on its head axis taken for per-head too (T5's cross-attention
    bias: zeros and the mask, per head). Every rank of the group gets here alike, with the same tensors' shapes;
    where those shapes differ between ranks (heads split unevenly), the tensor is left as it is."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return [(args, kwargs)]
    axis = {4: 1, 3: 0, 5: 2}
    ranks = dist.get_world_size(group)

    def gathered(v) -> tuple:  # (the first form's, the second's)
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim in axis):
            return v, v
        shape = torch.tensor([*v.shape, 0][:6], dtype=torch.int64)
        shapes = [torch.empty_like(shape) for _ in range(ranks)]
        dist.all_gather(shapes, shape, group=group)
        if any(not torch.equal(t, shape) for t in shapes):
            return v, v
        parts = [torch.empty_like(v) for _ in range(ranks)]
        dist.all_gather(parts, v.contiguous(), group=group)
        whole = torch.cat(parts, dim=axis[v.ndim])
        # element by element: a bias with a mask folded in holds finfo.min beside values of a few units, and a
        # tolerance of the largest magnitude's took LongT5's per-head local bias, one head per rank at tp 4, for
        # the same on every rank
        first = torch.nan_to_num(parts[0].float(), posinf=1e30, neginf=-1e30)
        if not all(torch.allclose(torch.nan_to_num(p.float(), posinf=1e30, neginf=-1e30), first, rtol=1e-4,
                                  atol=1e-6) for p in parts[1:]):
            return whole, whole
        return v, (whole if v.shape[axis[v.ndim]] > 1 else v)  # the same on every rank: per-head only if need be

    pairs = [gathered(v) for v in args[1:]]
    named = {k: gathered(v) for k, v in kwargs.items()}
    forms = [((args[0], *(p[i] for p in pairs)) if args else args, {k: p[i] for k, p in named.items()})
             for i in (0, 1)]
    changed = any(a is not b for a, b in (*pairs, *named.values()))
    return forms if changed else forms[:1]


def verify_sharded_layers(sharded: nn.Module, copies: dict[str, nn.Module], what: str, dtype: torch.dtype,
                          group=None) -> str:
    """Compare each copied layer with its sharded self on a probe input; raise one `InferenceSetupError` naming
    the first layer beyond tolerance (the same on every rank of `group`). Returns a one-line summary."""
    import torch.distributed as dist

    start = time.perf_counter()
    device = next(sharded.parameters()).device
    seen: dict[str, tuple] = {}
    hooks = []
    for path in copies:
        layer = sharded.get_submodule(path)

        # the layer's first call only: a probe through `generate` calls it again, with a cache of this rank's heads
        def pre(module, args, kwargs, path=path):
            if path not in seen:
                seen[path] = (copy.copy(args), dict(kwargs))

        def post(module, args, kwargs, output, path=path):
            if len(seen[path]) == 2:
                seen[path] = (*seen[path], _first_tensor(output).detach().clone())

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                  layer.register_forward_hook(post, with_kwargs=True)]
    error = None
    inside = track_modules(sharded)
    generated = False
    try:
        with torch.no_grad(), inside:
            generated = _probe_pass(sharded, device)
    except Exception as e:  # any type: ProphetNet's mask check raised ValueError, HunYuan's RuntimeError
        if not sharding_failure(e):
            raise
        error = f"the sharded forward fails in {inside.where()}: {type(e).__name__}: {first_line(e)}"
    finally:
        for h in hooks:
            h.remove()
    ratios, details, unreached = [], [], []
    rtol = RTOL.get(dtype, 1e-3)
    for path, ref in copies.items():
        if error is not None or len(seen.get(path, ())) != 3:
            ratios.append(0.0)
            details.append("")
            if error is None:
                # the probe does not run it: the model's own generate does not (Kyutai's codec decoder: audio out,
                # for speech-to-speech), or it reads what a text probe does not give (Gemma 3's SigLIP tower, Granite
                # Speech's conformer: their runs were refused, "not reached by the probe"); said, not checked
                unreached.append(path)
            continue
        args, kwargs, got = seen[path]
        kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}  # its first call's: empty, or none
        mode = getattr(sharded.get_submodule(path), "attention_type", None)
        if isinstance(mode, str) and getattr(ref, "attention_type", mode) != mode and hasattr(ref, "set_attention_type"):
            # the model switched its layers' attention while it ran (BigBird: full attention for an input shorter
            # than its sparse blocks); the copy, left block-sparse, refused the probe's 8 tokens
            ref.set_attention_type(mode)
        want = None
        # every rank tries the same forms: the copy's failure is one of shapes, the same on each
        for ref_args, ref_kwargs in _with_heads_gathered(args, kwargs, group):
            try:
                with torch.no_grad():
                    want = _first_tensor(ref.to(device)(*ref_args, **ref_kwargs))
                break
            except Exception as e:  # inputs made outside the layer by a split part (CPM-Ant's per-head position bias)
                if not sharding_failure(e):
                    raise
                failure = e
        if want is None:
            ratios.append(float("inf"))
            details.append(f"the unsharded layer fails on the inputs the sharded model gives it "
                           f"({type(failure).__name__}: {first_line(failure)})")
            continue
        x = _first_tensor(args) if args else _first_tensor(next(iter(kwargs.values()), None))
        delta = want - x if isinstance(x, torch.Tensor) and x.shape == want.shape else want
        scale = max(delta.float().abs().max().item(), 1e-6)
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("inf")
        ratios.append(diff / (rtol * scale))
        details.append(f"max |diff| {diff:.2e}, tolerance {rtol * scale:.2e} ({rtol:g} x {scale:.2e}, what the "
                       f"layer adds to its input, in {str(dtype).removeprefix('torch.')})")
    flags = torch.tensor([*ratios, 1.0 if error else 0.0], dtype=torch.float64)
    if group is not None and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    fix = ("write a policy with `ds-inference policy suggest MODEL_DIR > my.toml`, check it with `ds-inference "
           "policy check MODEL_DIR --tp-size N --policy my.toml`, and pass --injection_policy my.toml")
    if flags[-1] > 0:
        raise InferenceSetupError(f"{what}: {error or 'the sharded forward fails on another rank'}; {fix}")
    for (path, ref), ratio, detail in zip(copies.items(), flags[:-1].tolist(), details):
        if ratio > 1:
            raise InferenceSetupError(
                f"{what} gives wrong results: layer {path} ({type(ref).__name__}) differs from the unsharded layer "
                f"on a probe input, {detail or 'on another rank'}; {fix}")
    worst = max(flags[:-1].tolist(), default=0.0)
    by = " (the model's generate)" if generated else ""
    unrun = f"; not run by the probe{by}, so not checked: {', '.join(unreached)}" if unreached else ""
    return (f"{what} checked numerically: {len(copies) - len(unreached)} layer type(s) within tolerance (worst "
            f"{worst:.2g} of it) in {time.perf_counter() - start:.2f} s{unrun}")
