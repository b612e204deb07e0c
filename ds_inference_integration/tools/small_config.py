"""A model type's default config made small (`shrink`): what `policy sweep` builds a tiny random model of, and what
the architecture zoo's entries taken from the sweep are (`architecture_zoo._swept`)."""

from __future__ import annotations

import contextlib

VOCAB = 96

# (`hidden_size_global`: BLT's local encoder and decoder read the width of its global transformer under that name)
WIDTH = {"hidden_size": 128, "d_model": 128, "n_embd": 128, "embed_dim": 128, "dim": 128, "emb_dim": 128,
         "hidden_size_global": 128}
INNER = {"intermediate_size": 256, "ffn_dim": 256, "d_ff": 256, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256,
         "n_inner": 256, "ffn_hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
         "expert_intermediate_size": 128}
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
          "n_layers", "num_encoder_layers", "num_blocks")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_top_k", "top_k")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def _small_values(config) -> dict:
    """{attribute: small value} for the config's own size attributes (not its sub-configs')."""
    def ints(names):
        return [n for n in names if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool)]

    values: dict = {}
    for names in (WIDTH, INNER):
        values.update({n: min(getattr(config, n), names[n]) for n in ints(names)})
    values.update({n: min(getattr(config, n), 2) for n in ints(LAYERS)})  # (per-layer lists: more, below)
    values.update({n: 4 for n in ints(HEADS)})
    query = next((getattr(config, n) for n in ints(HEADS)), None)
    values.update({n: 4 if query is not None and getattr(config, n) >= query else 2 for n in ints(KV_HEADS)})
    if isinstance(getattr(config, "head_dim", None), int) or (query is not None and "head_dim" in vars(config)):
        values["head_dim"] = 32  # also where the default leaves it None and the model reads it (Ministral)
    values.update({n: min(getattr(config, n), 4) for n in ints(EXPERTS)})
    values.update({n: min(getattr(config, n), 2) for n in ints(TOP_K)})
    if isinstance(getattr(config, "vocab_size", None), int):
        values["vocab_size"] = VOCAB
    # other vocabularies: Gemma 4's per-layer embeddings (262144 rows), BLT's hashed byte groups (3M rows)
    values.update({n: VOCAB for n in ints(vars(config)) if "vocab" in n and n != "vocab_size" and getattr(config, n) > VOCAB})
    for n in TOKEN_IDS:
        value = getattr(config, n, None)
        if isinstance(value, int) and value >= VOCAB:
            values[n] = {"pad_token_id": 0, "decoder_start_token_id": 0}.get(n, 1)
        elif isinstance(value, list):
            values[n] = [v if v < VOCAB else 1 for v in value]
    if isinstance(getattr(config, "initializer_range", None), float):
        values["initializer_range"] = 0.2
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # multi-head latent attention's own sizes
        if getattr(config, "head_dim", None) == config.qk_rope_head_dim:
            values["head_dim"] = 16
        values.update(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, kv_lora_rank=32)
        if getattr(config, "q_lora_rank", None) is not None:
            values["q_lora_rank"] = 32
        if isinstance(getattr(config, "qk_head_dim", None), int):
            values["qk_head_dim"] = 32
    for n in ("n_group", "topk_group", "num_expert_group", "topk_expert_group"):  # experts routed in groups: one
        if isinstance(getattr(config, n, None), int):
            values[n] = 1
    values.update(_per_layer_lists(config))
    own = OWN.get(getattr(config, "model_type", None), {})
    values.update({n: v for n, v in own.items() if "." not in n})  # (a sub-config's: set after its own shrink)
    return values


# sizes under names of their own, or that the default config leaves unset though the model needs them: {model_type:
# {attribute: value}}; "sub_config.attribute" sets a sub-config's after its shrink
OWN = {
    # its sparse attention's indexer: all five or none, the default none, which the model's indexer cannot build
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
                           indexer_compress_ratio=4),
    # its rotary parameters by layer type (the default's are not, and its rotary embedding reads them so)
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # the decoder's key/value heads, which its attention reads and its config class does not declare
    "moonshine_streaming": dict(num_key_value_heads=4),
    # its indexer's heads, at most the query heads one key head serves (12 by default; 4 / 2 here)
    "kolibri1_1": dict(index_num_heads=2),
    # its adaptor's inner width is a quarter of the text model's hidden size
    "fun_asr_nano": {"adaptor_config.intermediate_size": WIDTH["hidden_size"] // 4},
    # the language its adapters run for an input without language ids (the default none: the model refuses it), as a
    # checkpoint saved after `set_default_language` holds
    "xmod": dict(default_language="en_XX"),
    # the map of its image tokens a checkpoint holds (the default none, which its image-and-text class cannot build
    # from); id 2, below the checker's random token ids
    "emu3": dict(vocabulary_map={"<image>": 2, "<|extra_200|>": 2}),
    # its image tokenizer's channels (256 x up to 4, convolutions of 1024 x 1024 x 3 x 3)
    "emu3_vqgan": dict(base_channels=32, codebook_size=VOCAB),
    # VibeVoice-ASR's two audio tokenizers' encoders: channels that double at each of 7 stages from 32 (2048 at the
    # last, 343M parameters each), 3 to 8 blocks a stage
    "vibevoice_acoustic_tokenizer_encoder": dict(num_filters=4, depths=[1] * 7),
    # Kyutai's speech-to-text: an embedding of text and every codebook's codes (its codec's codes and a start code
    # each), the audio pad token its last row; its codec (Mimi) as many codebooks of as many codes, and upsampling
    # groups that divide its width
    # (8 codebooks: Moshi's default, which its config refuses above its Mimi's quantizers)
    "kyutai_speech_to_text": dict(codebook_vocab_size=33, num_codebooks=8, audio_bos_token_id=32,
                                  audio_pad_token_id=VOCAB + 8 * 33),
    "mimi": dict(codebook_size=32, num_quantizers=8, codebook_dim=32, vector_quantization_hidden_dimension=32,
                 upsample_groups=WIDTH["hidden_size"]),
    # Nemotron-3.5-Transcribe's diarization head reads its audio encoder's width, which its validator checks, and its
    # word-timestamp head's blank token is the last of its vocabulary
    "nemotron3_diarization": {"head_config.audio_hidden_size": WIDTH["hidden_size"]},
    "nemotron3_5_transcribe_word_timestamp": dict(blank_token_id=VOCAB - 1),
    # Gemma 3n's vision tower, timm's MobileNetV5 (300M parameters, its output 2048 channels wide): its channels
    # scaled to the small width
    "gemma3n_vision": dict(model_args={"channel_multiplier": WIDTH["hidden_size"] / 2048}),
    # axial position embeddings whose widths sum to the hidden size, and heads of 32 (4 x 32 = 128)
    "reformer": dict(axial_pos_embds_dim=[64, 64], attention_head_size=32, feed_forward_size=256),
}


# generation settings a published checkpoint's generation_config.json holds and its generate needs: {model_type:
# {attribute: value}}, set on the built model's generation config
GENERATION = {
    # Pop2Piano's composers, one per row of its conditioner's embedding (21 by default), each a token its generate
    # puts before the audio's features ("`composer_to_feature_token` was not found!" without)
    "pop2piano": dict(composer_to_feature_token={f"composer{i + 1}": 2052 + i for i in range(21)}),
}

PER_LAYER = ("layer_types", "mlp_layer_types", "block_types")


def _per_layer_lists(config) -> dict:
    """The per-layer lists (`layer_types` and its kin) cut to one layer of each kind they hold (two to four layers,
    in the model's order), and the layer counts to match: a hybrid keeps a layer of each of its mixers (two layers
    of the default's first kinds were often both linear attention, which the model's own cache refuses). Any other
    list of one value per layer is cut to the same layers (Gemma 3n's inner sizes and activation sparsities: left
    35 long beside 2 layers, its config refused them). Where the last layers reuse earlier layers' key/value cache
    (`num_kv_shared_layers`), a consumer of each kind is kept after its producers, and the count set to them."""
    lists = {a: list(v) for a in PER_LAYER if isinstance(v := getattr(config, a, None), (list, tuple)) and v}
    if not lists:
        return {}
    count = next((getattr(config, n) for n in LAYERS if isinstance(getattr(config, n, None), int)), None)
    shared = getattr(config, "num_kv_shared_layers", None)
    shared = shared if isinstance(shared, int) and count and 0 < shared < count else 0
    picked: list[int] = []
    for values in lists.values():
        producers = values[:len(values) - shared] if shared and len(values) == count else values
        for kind in dict.fromkeys(producers):
            if producers.index(kind) not in picked and len(picked) < 4:
                picked.append(producers.index(kind))
    picked = sorted(picked)
    while len(picked) < 2:
        picked.append(picked[-1] + 1)
    if shared:  # the first layer of each picked kind among the consumers
        kinds = lists.get("layer_types") or next(iter(lists.values()))
        consumers = {kinds[i]: i for i in range(count - 1, count - shared - 1, -1) if i < len(kinds)}
        consumers = sorted(i for kind, i in consumers.items() if kind in {kinds[p] for p in picked})
        picked += consumers
    if count:  # other lists of one value per layer: inner sizes, floats, strings; not lists of ints otherwise,
        # which were lists of layer indices as often (Llama 4's `moe_layers`, Kolibri's `index_layers`: their lengths
        # the layer count where every layer is one)
        lists.update({a: list(v) for a, v in vars(config).items() if a not in lists and isinstance(v, (list, tuple))
                      and len(v) == count > 2 and (all(isinstance(x, (float, str)) for x in v)
                                                   or (a in INNER and all(isinstance(x, int) for x in v)))})
    found = {a: [v[i % len(v)] for i in picked] for a, v in lists.items()}
    for name, size in INNER.items():  # per-layer inner sizes made small as a single one is
        if name in found and all(isinstance(x, int) for x in found[name]):
            found[name] = [min(x, size) for x in found[name]]
    layers = [n for n in LAYERS if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool)]
    found.update({n: len(picked) for n in layers})
    if shared:
        found["num_kv_shared_layers"] = sum(i >= count - shared for i in picked)
    # lists of layer indices the default derived from its layer types (Zamba2's `hybrid_layer_ids`, [6, 12, ...]:
    # left as they were, its shared block's adapters were looked up for layer 1 in a map of layers 6 to 51,
    # "KeyError: 1" in the unsharded model): the picked layers' new indices
    for name, ids in vars(config).items():
        if name.endswith("_layer_ids") and isinstance(ids, (list, tuple)) and all(isinstance(i, int) for i in ids):
            found[name] = [k for k, i in enumerate(picked) if i in set(ids)]
    return found


def _set_by_parent(config, top: bool) -> dict:
    """A sub-config's settings that differ from its class's defaults: what its parent set (Cohere ASR's encoder reads
    128 mel bins, its class says 80), kept where it is built again; none for the top config (a default one)."""
    if top:
        return {}
    try:
        default = type(config)().to_dict()
    except Exception:  # noqa: BLE001 (a class with no default of its own: nothing is known to differ)
        return {}
    return {k: v for k, v in config.to_dict().items()
            if k not in ("model_type", "transformers_version") and not isinstance(v, dict) and v != default.get(k)}


def shrink(config, rebuild: bool = True, top: bool = True):
    """A small config of the same type: widths 128, inner sizes 256 (experts' 128), 2 layers, 4 query heads and 2
    or 4 key/value heads, head_dim 32, 4 experts of which 2 per token, a vocabulary of 96, a large initialisation
    (greedy tokens depend on the input). The top config is built again from those values where it can be (its
    own checks then derive what depends on them: `layer_types`), else changed in place with the first two kinds of
    its `layer_types`; sub-configs likewise (in place where the top one was)."""
    from transformers import AutoConfig, PretrainedConfig

    from ..policy.schema import configured_values

    with configured_values(config):
        values = _small_values(config)
    given = config
    if rebuild:
        try:
            config = AutoConfig.for_model(config.model_type, **{**_set_by_parent(config, top), **values})
        except Exception:  # noqa: BLE001 (a config that refuses them together: changed in place below)
            rebuild = False
    if not rebuild:
        for n, v in values.items():
            with contextlib.suppress(AttributeError):  # a read-only property, derived from the others set here:
                setattr(config, n, v)  # RecurrentGemma's layer types (its block types), Nemotron's audio width
    for name in list(getattr(config, "sub_configs", {}) or {}):
        # a sub-config's own sub-configs as its parent set them (T5Gemma2's sets `dropout_rate` on its encoder's text
        # config, which a text config built again from defaults lacks); the top config's as built again
        sub = getattr(config if top else given, name, None)
        if isinstance(sub, PretrainedConfig):
            # built again too where it can be: changed in place, a sub-config's lists derived from its layer count
            # stayed the default's (Gemma 4's `per_layer_config` keys, 5 to 29 of 2 layers; Dots3's sliding heads)
            small = shrink(sub, rebuild=rebuild, top=False)
            if small is not getattr(config, name, None):
                with contextlib.suppress(AttributeError):
                    setattr(config, name, small)
    own = OWN.get(getattr(config, "model_type", None), {})
    for path, value in own.items():
        if "." in path:
            sub, _, attribute = path.partition(".")
            setattr(getattr(config, sub), attribute, value)
    if hasattr(config, "is_decoder") and not config.is_encoder_decoder:
        config.is_decoder = True  # BERT-style encoders generate as decoders (their LM-head class asks for it)
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        # a composite encoder-decoder's default config has no start token, which a saved model of it sets (as
        # transformers' docs for EncoderDecoderModel say): without it the unsharded model could not generate
        decoder = getattr(config, "decoder", None)
        start = next((v for v in (getattr(decoder, "bos_token_id", None), getattr(decoder, "pad_token_id", None))
                      if isinstance(v, int)), 0)
        config.decoder_start_token_id = start
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = start
    return _as_loaded(config) if top else config


def _as_loaded(config):
    """The config as a checkpoint of it loads back: what the top config's own `__init__` derives from its sub-configs,
    which changing them after it ran left as the default's (BLT's `encoder_cross_output_size`, a projection of the
    local encoder's width to the global transformer's: absent in the model built, its weight "MISSING" and drawn again
    at each load). A config that does not load back (its validator refuses the saved one) is kept as it is."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        try:
            config.save_pretrained(d)
            loaded = AutoConfig.from_pretrained(d)
        except Exception:  # noqa: BLE001 (the config as built, which the sweep's save then tries and says)
            return config
    loaded._name_or_path = config._name_or_path
    return loaded
