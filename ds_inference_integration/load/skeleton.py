"""The skeleton: a model built on `meta` (no memory, no random initialisation) with real buffers, and the
bookkeeping the loaders fill it by: which names each parameter has, which modules own it, which parameters wait
for DeepSpeed's split (`not_deferred`), and `replace_meta`, the one place a meta parameter becomes a real tensor.
Also which Auto class builds a config's model (`model_class_for`, `check_model_kind`, `check_generates_text`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import InferenceSetupError

DEFERRED_TYPES = ("Linear", "Conv1D", "ColumnShard")  # modules whose parameters wait for the split


def names_by_param(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def owners_of(model: nn.Module) -> dict[int, list[nn.Module]]:
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    return owners


def replace_meta(model: nn.Module, make, only=None, also: set[str] = frozenset()) -> int:
    """Give every meta parameter (for which `only(param, owners)` holds), and every parameter named in `also`,
    a real tensor `make(names, module, param)`; parameters shared between modules stay shared.
    Returns the number of tensors made."""
    names = names_by_param(model)
    owners = owners_of(model)
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


def not_deferred(param, owners) -> bool:
    return not all(isinstance(m, nn.Linear) or type(m).__name__ in DEFERRED_TYPES for m in owners)


def build_skeleton(model_cls, config, dtype: torch.dtype, model_dir: Path) -> nn.Module:
    """The model with parameters on `meta` (no memory, no initialisation) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights

    # `no_init_weights` (what from_pretrained builds under with ZeRO-3): without it `from_config` ran every
    # `_init_weights` on the meta parameters, which torch computes through its reference decompositions: 0.25 of the
    # 0.37 s this function took for a 32-layer Llama (cProfile, 2026-12-04), for tensors that are read, not drawn.
    with init_empty_weights(include_buffers=False), no_init_weights():
        if hasattr(model_cls, "_model_mapping"):  # an Auto class
            model = model_cls.from_config(config, dtype=dtype)
        else:  # the class itself: a model's own code (`own_code.own_model_class`)
            model = model_cls._from_config(config, dtype=dtype)
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


def model_class_for(config, trust: bool = False):
    """The Auto class that builds a model of this config for generation: speech-to-text (Whisper), other
    encoder-decoders, or decoder-only. A config of a model's own code, trusted (`trust`), by the Auto classes its
    `auto_map` names (ChatGLM's names AutoModelForSeq2SeqLM and AutoModelForCausalLM for one decoder-only class)."""
    import transformers as tr
    from transformers.models.auto import modeling_auto as auto

    own = _own_auto_classes(config) if trust else []
    if own:
        if "AutoModelForSpeechSeq2Seq" in own:
            return tr.AutoModelForSpeechSeq2Seq
        if "AutoModelForSeq2SeqLM" in own and (getattr(config, "is_encoder_decoder", False)
                                               or "AutoModelForCausalLM" not in own):
            return tr.AutoModelForSeq2SeqLM
        if "AutoModelForCausalLM" in own:
            return tr.AutoModelForCausalLM
    model_type = getattr(config, "model_type", None)
    kinds = ((tr.AutoModelForSpeechSeq2Seq, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
             (tr.AutoModelForSeq2SeqLM, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
             (tr.AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
             # the checkpoints of a type whose causal-LM class is its text model alone (Mllama, Emu3): their
             # image-and-text class, which generates from text alone too; the causal-LM class refused their config
             (tr.AutoModelForImageTextToText, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
    # the checkpoint's own class first: a text-to-text SeamlessM4T shares its model_type with the speech one, whose
    # class was built from it and refused for want of audio ("no probe input is known for its 'input_features'")
    for architecture in getattr(config, "architectures", None) or ():
        for auto_class, names in kinds:
            if names.get(model_type) == architecture:
                return auto_class
    if model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return tr.AutoModelForSpeechSeq2Seq
    # a decoder with an audio encoder before it (Qwen2-Audio, GLM-ASR, AudioFlamingo 3) is named by the seq2seq
    # mapping only (AutoModelForCausalLM refused its config: "Unrecognized configuration class"); an encoder-decoder
    # config by the causal one only (MusicGen's, whose decoder generates) is built by that one
    in_seq2seq = model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    in_causal = model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if in_seq2seq and (config.is_encoder_decoder or not in_causal):
        return tr.AutoModelForSeq2SeqLM
    if in_causal:
        return tr.AutoModelForCausalLM
    return tr.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tr.AutoModelForCausalLM


GENERATING_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq",
                           "AutoModelForImageTextToText")


def _own_auto_classes(config) -> list[str]:
    """The generating Auto classes a config's `auto_map` names (a model's own code)."""
    auto_map = getattr(config, "auto_map", None) or {}
    return [name for name in GENERATING_AUTO_CLASSES if isinstance(auto_map.get(name), str)]


def concrete_class(model_cls, config, trust: bool = False) -> type:
    """The class the Auto class `model_cls` builds for `config`: the model's own (its `auto_map`, trusted), else
    transformers' (`check_model_kind` first: this one raises transformers' own error for a config it does not map)."""
    from transformers.models.auto.auto_factory import _get_model_class

    from .own_code import own_model_class

    own = own_model_class(model_cls, config, trust)
    return own if own is not None else _get_model_class(config, model_cls._model_mapping)


def check_model_kind(config, model_cls, model_dir, trust: bool = False) -> None:
    """One `InferenceSetupError` before anything loads when the Auto class `model_cls` builds no model of this
    config's type (a decoder-only model given to a seq2seq script: an AttributeError on decoder_start_token_id, or
    transformers' ValueError listing every class, otherwise), or builds one that generates no text by itself
    (`check_generates_text`). A model's own code (trusted) is judged by its `auto_map`, as the Auto classes build it:
    matched by class name instead, its config was refused ("holds a 'chatglm' model, which AutoModelForSeq2SeqLM does
    not build" where upstream's script ran it) or given transformers' class of the same name (DeepSeek-V2's)."""
    from .own_code import own_model_class

    own = own_model_class(model_cls, config, trust)
    if own is not None:
        check_generates_text(config, own, model_dir)
        return
    named = _own_auto_classes(config) if trust else []
    if named:
        auto_map = config.auto_map
        raise InferenceSetupError(
            f"{model_dir} holds a {config.model_type!r} model of its own code, whose auto_map names "
            f"{', '.join(f'{auto_map[n]} for {n}' for n in named)}, and no class for {model_cls.__name__}; valid: "
            f"a script that builds it with {' or '.join(named)}")
    mapping = model_cls._model_mapping
    if type(config) in mapping:
        check_generates_text(config, mapping[type(config)], model_dir)
        return
    names = sorted(mapping._model_mapping)
    familiar = [n for n in ("t5", "bart", "mbart", "marian", "pegasus", "led", "whisper", "speech_to_text",
                            "speech-encoder-decoder", "llama", "gpt2") if n in names] or names[:8]
    raise InferenceSetupError(f"{model_dir} holds a {config.model_type!r} model, which {model_cls.__name__} does not "
                              f"build; valid: one of its {len(names)} types, such as {', '.join(familiar)}")


# forward inputs that are another model's states: a model whose forward reads them generates only beside that model
BORROWED_STATES = ("shared_kv_states",)
# classes whose generate makes audio (codec codes), not text, beyond transformers' text-to-waveform and
# text-to-spectrogram mappings: Dia's, which the speech-to-text mapping names; MusicGen's decoders alone
AUDIO_MAKERS = ("DiaForConditionalGeneration", "MusicgenForCausalLM", "MusicgenMelodyForCausalLM")


def check_generates_text(config, model_class, model_dir) -> None:
    """One `InferenceSetupError` before anything loads where `model_class` (what a checkpoint of `config` is built
    as) generates no text by itself:
    - a speculative-decoding assistant (Gemma 4's) reads its target's key/value states in its forward
      (`shared_kv_states`); transformers runs it only inside its target's `generate(assistant_model=...)`. Alone, its
      forward raised "inputs_embeds and shared_kv_states cannot be None" once the whole model had loaded;
    - a text-to-speech or text-to-music model (MusicGen, VibeVoice, Dia) generates audio codes: MusicGen's class
      failed on a config attribute it lacks, Dia's teacher-forced forward on the shape of its codes.
    Predict and the server decode text; neither has an audio output to give these."""
    import inspect

    from transformers.models.auto import modeling_auto as auto

    borrowed = [n for n in BORROWED_STATES if n in inspect.signature(model_class.forward).parameters]
    if borrowed:
        raise InferenceSetupError(
            f"{model_dir} holds a {config.model_type!r} model ({model_class.__name__}), a speculative-decoding "
            f"assistant: its forward reads its target model's states ({borrowed[0]}), so it generates only beside "
            "that model; valid: the target model's checkpoint")
    audio = set(AUDIO_MAKERS) | set(auto.MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES.values()) | set(
        auto.MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES.values())
    maker = next((c for c in [model_class.__name__, *(getattr(config, "architectures", None) or ())] if c in audio), None)
    if maker:
        raise InferenceSetupError(
            f"{model_dir} holds a {config.model_type!r} model ({maker}), whose generate makes audio codes, not text; "
            "ds-inference predicts and serves text; valid: a model that generates text (speech-to-text ones "
            "included)")
    _check_cache_builds(config, model_class, model_dir)


def _check_cache_builds(config, model_class, model_dir) -> None:
    """One `InferenceSetupError` where transformers' generate cannot build the key/value cache it builds before the
    first step: `DynamicCache(config=...)` of the config's decoder, as `_prepare_cache_for_generation` makes it for a
    model that takes one and makes no cache of its own. BLT's config (transformers 5.25) has no `num_hidden_layers`
    (its three stacks' counts are in its sub-configs), so its generate raised AttributeError unsharded too, once the
    whole model had loaded; predict and the server (which always steps with a cache) cannot run it."""
    from transformers import DynamicCache, GenerationMixin, PretrainedConfig

    from ..errors import first_line

    if not isinstance(config, PretrainedConfig) or not issubclass(model_class, GenerationMixin):
        return
    if (not model_class._supports_default_dynamic_cache()
            or model_class._prepare_cache_for_generation is not GenerationMixin._prepare_cache_for_generation):
        return  # a cache of its own (Mamba's, RWKV's) or one it prepares itself: nothing of transformers' to build
    try:
        DynamicCache(config=config.get_text_config(decoder=True))
    except Exception as e:  # noqa: BLE001 (whatever the cache's constructor raises: the model's one line)
        import transformers

        raise InferenceSetupError(
            f"{model_dir} holds a {config.model_type!r} model ({model_class.__name__}) whose key/value cache "
            f"transformers {transformers.__version__} cannot build from its config ({type(e).__name__}: "
            f"{first_line(e)[:120]}): its generate fails before the first token, unsharded too; valid: a "
            "transformers whose generate builds this model's cache") from None
