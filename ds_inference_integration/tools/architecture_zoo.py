"""`ds-inference policy matrix`: tiny random models of every architecture the project checks, built from configs
(no download), checked by `policy check` at each tp size in one launch per size, and the architecture
table of docs/policies.md written from those reports (`--readme docs/policies.md` rewrites the block between its
two markers).

The models: every family with a shipped policy file, the families whose policy is derived, more encoder-decoders,
mixture-of-experts decoders (dense-first ones, packed experts in both orientations, experts held as modules), and
the hybrids and state-space models whose mixers are kept whole (issue #27). Widths are small (hidden 128, 2
layers; encoder-decoders d_model 64) and the initialisation large, so that greedy tokens depend on the input.
Head counts are chosen so that tp 2 and tp 4 are possible (CodeGen's 4-block fused projection needs 8 heads per 2
ranks).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .small_config import VOCAB

TABLE_START = "<!-- architecture-table: written by `ds-inference policy matrix --readme docs/policies.md` -->"
TABLE_END = "<!-- end of architecture-table -->"
NOT_IN_ZOO: dict[str, str] = {}  # tried, and why each is not in the table yet (Zamba2 until 2026-12-07)


def _decoder(cls_name: str, **kw):
    import transformers as tr

    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, initializer_range=0.2)
    settings = {**base, "vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, **kw}
    return getattr(tr, cls_name)(**{k: v for k, v in settings.items() if v is not None})  # None: leave it out


def _seq2seq(cls_name: str, **kw):
    import transformers as tr

    base = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                init_std=0.5, forced_eos_token_id=None)
    settings = {**base, **kw, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "decoder_start_token_id": 0}
    return getattr(tr, cls_name)(**{k: v for k, v in settings.items() if v is not None})  # None: leave it out


def _swept(model_type: str, **settings):
    """The sweep's small config of `model_type` (`sweep.shrink`: its default config, widths 128, 2 layers, 4 heads),
    with `settings` set on it."""
    from transformers import AutoConfig

    from .small_config import shrink

    config = shrink(AutoConfig.for_model(model_type))
    for name, value in settings.items():
        setattr(config, name, value)
    return config


def _t5gemma():
    """T5Gemma: an encoder and a decoder config of its own, grouped-query self and cross attention."""
    import transformers as tr

    sub = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.5)
    return tr.T5GemmaConfig(encoder=tr.T5GemmaModuleConfig(**sub), decoder=tr.T5GemmaModuleConfig(**sub, is_decoder=True),
                            vocab_size=VOCAB, pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=0)


def _moonshine():
    """Moonshine: raw audio in, its encoder's and decoder's head counts under names of their own. As many KV heads
    as query heads: transformers' MoonshineAttention views the query by `config.num_key_value_heads`, so with
    fewer KV heads the unsharded model fails (transformers 5.24)."""
    import transformers as tr

    return tr.MoonshineConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, encoder_num_hidden_layers=2,
                              decoder_num_hidden_layers=2, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                              encoder_num_key_value_heads=4, decoder_num_key_value_heads=4, max_position_embeddings=64,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=0,
                              initializer_range=0.5)


def _prophetnet():
    """ProphetNet: its own names for the sizes, two predicted streams (ngram 2), relative position buckets."""
    import transformers as tr

    return tr.ProphetNetConfig(vocab_size=VOCAB, hidden_size=64, encoder_ffn_dim=256, decoder_ffn_dim=256,
                               num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                               num_decoder_attention_heads=4, max_position_embeddings=64, num_buckets=8,
                               relative_max_distance=16, init_std=0.5, pad_token_id=0, bos_token_id=2, eos_token_id=1,
                               decoder_start_token_id=0)


def _t5(cls_name: str, **kw):
    import transformers as tr

    base = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                initializer_factor=5.0)
    return getattr(tr, cls_name)(**{**base, **kw, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0})


GQA = dict(num_key_value_heads=2)
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
# DeepSeek-V2/V3, GLM-4-MoE, dots1: the first `first_k_dense_replace` layers dense, the rest experts; the inner
# sizes 128 and 256 (shared), as DeepSpeed splits an MLP in blocks of 64 (a 64 left one of two ranks all of it: 55% / 45%)
MOE_DENSE_FIRST = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=2, moe_intermediate_size=128, n_group=1, topk_group=1)
ZOO = {
    # shipped policy files
    "gpt2": lambda: _decoder("GPT2Config", n_embd=128, n_layer=2, n_head=4, n_positions=64),
    "gpt_bigcode_mqa": lambda: _decoder("GPTBigCodeConfig", n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                        multi_query=True),
    "gpt_bigcode_mha": lambda: _decoder("GPTBigCodeConfig", n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                        multi_query=False),
    "llama": lambda: _decoder("LlamaConfig", **GQA),
    "llama_kv1": lambda: _decoder("LlamaConfig", num_key_value_heads=1),
    "mistral": lambda: _decoder("MistralConfig", **GQA),
    "qwen2": lambda: _decoder("Qwen2Config", **GQA),
    "opt": lambda: _decoder("OPTConfig", ffn_dim=256, word_embed_proj_dim=128, init_std=0.2),
    "bloom": lambda: _decoder("BloomConfig", n_layer=2, n_head=4),
    "gpt_neox": lambda: _decoder("GPTNeoXConfig"),
    "falcon": lambda: _decoder("FalconConfig", multi_query=True, new_decoder_architecture=False),
    "falcon_new": lambda: _decoder("FalconConfig", num_attention_heads=8, num_kv_heads=2,
                                   new_decoder_architecture=True),
    "t5": lambda: _t5("T5Config"),
    "mt5": lambda: _t5("MT5Config"),
    "bart": lambda: _seq2seq("BartConfig"),
    "mbart": lambda: _seq2seq("MBartConfig"),
    "marian": lambda: _seq2seq("MarianConfig"),
    "fsmt": lambda: _seq2seq("FSMTConfig", vocab_size=None, langs=["en", "ro"], src_vocab_size=VOCAB,
                             tgt_vocab_size=VOCAB),
    "led": lambda: _seq2seq("LEDConfig", max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                            attention_window=8),
    "pegasus_x": lambda: _seq2seq("PegasusXConfig", block_size=8, num_global_tokens=4),
    # attentions and feed-forwards in lists of their own, each a layer (policies/xlm.toml)
    "xlm": lambda: _decoder("XLMConfig", emb_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64,
                            hidden_size=None, intermediate_size=None, num_hidden_layers=None,
                            num_attention_heads=None),
    # derived policies: decoders
    "phi3": lambda: _decoder("Phi3Config", **GQA),
    "phi": lambda: _decoder("PhiConfig"),
    "persimmon": lambda: _decoder("PersimmonConfig", qk_layernorm=True),
    "gemma": lambda: _decoder("GemmaConfig", num_key_value_heads=1, head_dim=32),
    "gemma2": lambda: _decoder("Gemma2Config", **GQA, head_dim=32),
    "gemma3_text": lambda: _decoder("Gemma3TextConfig", **GQA, head_dim=32),
    "qwen3": lambda: _decoder("Qwen3Config", **GQA, head_dim=32),
    "stablelm": lambda: _decoder("StableLmConfig", **GQA),
    "starcoder2": lambda: _decoder("Starcoder2Config", **GQA),
    "olmo": lambda: _decoder("OlmoConfig", **GQA),
    "olmo2": lambda: _decoder("Olmo2Config", **GQA),
    "cohere": lambda: _decoder("CohereConfig", **GQA),
    "granite": lambda: _decoder("GraniteConfig", **GQA),
    "helium": lambda: _decoder("HeliumConfig", **GQA, head_dim=32),
    "glm": lambda: _decoder("GlmConfig", **GQA, head_dim=32),
    "nemotron": lambda: _decoder("NemotronConfig", **GQA),
    "smollm3": lambda: _decoder("SmolLM3Config", **GQA),
    "seed_oss": lambda: _decoder("SeedOssConfig", **GQA, head_dim=32),
    "ernie4_5": lambda: _decoder("Ernie4_5Config", **GQA, head_dim=32),
    "arcee": lambda: _decoder("ArceeConfig", **GQA),
    "biogpt": lambda: _decoder("BioGptConfig"),
    "gptj": lambda: _decoder("GPTJConfig", n_embd=128, n_layer=2, n_head=4, n_positions=64, rotary_dim=16),
    "gpt_neo": lambda: _decoder("GPTNeoConfig", num_layers=2, num_heads=4, window_size=16,
                                attention_types=[[["global", "local"], 1]]),
    # no pad_token_id, as CodeGen's own configs: the checker pads as generate does
    "codegen": lambda: _decoder("CodeGenConfig", num_attention_heads=16, n_positions=64, rotary_dim=4,
                                pad_token_id=None),
    "xglm": lambda: _decoder("XGLMConfig", d_model=128, ffn_dim=256, num_layers=2, attention_heads=4, init_std=0.2),
    "mpt": lambda: _decoder("MptConfig", d_model=128, n_layers=2, n_heads=4, max_seq_len=64),
    # derived policies: mixture of experts (packed experts split per rank)
    "mixtral": lambda: _decoder("MixtralConfig", **GQA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: _decoder("Qwen2MoeConfig", **GQA, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=128, shared_expert_intermediate_size=256),
    "qwen3_moe": lambda: _decoder("Qwen3MoeConfig", **GQA, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=128, head_dim=32),
    "olmoe": lambda: _decoder("OlmoeConfig", **GQA, num_experts=4, num_experts_per_tok=2),
    # derived policies: mixture of experts whose first layers are dense (each layer kind derived on its own)
    "deepseek_v2": lambda: _decoder("DeepseekV2Config", **MOE_DENSE_FIRST, kv_lora_rank=32, q_lora_rank=32,
                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, topk_method="greedy",
                                    num_key_value_heads=4),
    "deepseek_v3": lambda: _decoder("DeepseekV3Config", **MOE_DENSE_FIRST, kv_lora_rank=32, q_lora_rank=32,
                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=4),
    "glm4_moe": lambda: _decoder("Glm4MoeConfig", **MOE_DENSE_FIRST, **GQA, head_dim=32),
    "dots1": lambda: _decoder("Dots1Config", **MOE_DENSE_FIRST, **GQA, head_dim=32),
    # derived policies: more 2026 decoders (dense and MoE)
    "hunyuan_v1_dense": lambda: _decoder("HunYuanDenseV1Config", **GQA, head_dim=32),
    # transposed experts ([experts, hidden, 2 x inner]): GPT-OSS interleaved with biases, Llama 4 in halves
    "gpt_oss": lambda: _decoder("GptOssConfig", **GQA, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                                sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": lambda: _decoder("Llama4TextConfig", **GQA, num_local_experts=4, num_experts_per_tok=1,
                                    head_dim=32, intermediate_size_mlp=256),
    "granitemoe": lambda: _decoder("GraniteMoeConfig", **GQA, num_local_experts=4, num_experts_per_tok=2),
    "hunyuan_v1_moe": lambda: _decoder("HunYuanMoEV1Config", **GQA, num_experts=4, moe_topk=2, head_dim=32),
    "ernie4_5_moe": lambda: _decoder("Ernie4_5_MoeConfig", **GQA, moe_num_experts=4, moe_k=2, moe_num_shared_experts=2,
                                     moe_intermediate_size=128, head_dim=32),
    "minimax_m2": lambda: _decoder("MiniMaxM2Config", **GQA, num_local_experts=4, num_experts_per_tok=2, head_dim=32),
    "flex_olmo": lambda: _decoder("FlexOlmoConfig", **GQA, num_experts=4, num_experts_per_tok=2),
    "exaone4": lambda: _decoder("Exaone4Config", **GQA, head_dim=32),
    "olmo3": lambda: _decoder("Olmo3Config", **GQA),
    # tried on 2026-12-04, beyond issue #27's list: decoders, MoEs (LongCat-Flash's router scores zero-computation
    # experts too), sparse attention whose indexer is kept whole (DeepSeek-V3.2, GLM-5), hybrids
    "apertus": lambda: _decoder("ApertusConfig", **GQA),
    "jais2": lambda: _decoder("Jais2Config", **GQA),
    "ministral3": lambda: _decoder("Ministral3Config", **GQA, head_dim=32),
    "cohere2_moe": lambda: _decoder("Cohere2MoeConfig", **GQA, **SMALL_MOE),
    "exaone_moe": lambda: _decoder("ExaoneMoeConfig", **GQA, **{**SMALL_MOE, "moe_intermediate_size": 256}, head_dim=32),
    "glm4_moe_lite": lambda: _decoder("Glm4MoeLiteConfig", **MOE_DENSE_FIRST),
    "granitemoeshared": lambda: _decoder("GraniteMoeSharedConfig", **GQA, num_local_experts=4, num_experts_per_tok=2,
                                         shared_intermediate_size=128),
    "minimax_m3_vl_text": lambda: _decoder("MiniMaxM3VLTextConfig", **GQA, num_local_experts=4, num_experts_per_tok=2,
                                           head_dim=32),
    "longcat_flash": lambda: _decoder("LongcatFlashConfig", num_layers=2, n_routed_experts=4, moe_topk=2,
                                      zero_expert_num=2, expert_ffn_hidden_size=128, ffn_hidden_size=256, kv_lora_rank=32,
                                      q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, head_dim=16),
    "deepseek_v32": lambda: _decoder("DeepseekV32Config", **MOE_DENSE_FIRST, index_n_heads=4, index_head_dim=96,
                                     index_topk=8),
    "glm_moe_dsa": lambda: _decoder("GlmMoeDsaConfig", **MOE_DENSE_FIRST, index_n_heads=4, index_head_dim=96,
                                    index_topk=8),
    "qwen3_5_moe_text": lambda: _decoder("Qwen3_5MoeTextConfig", **GQA, **SMALL_MOE, shared_expert_intermediate_size=256,
                                         head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
                                         linear_key_head_dim=16, linear_value_head_dim=16,
                                         layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": lambda: _decoder("Lfm2MoeConfig", **GQA, **SMALL_MOE, num_dense_layers=1,
                                 layer_types=["conv", "full_attention"]),
    "falcon_mamba": lambda: _decoder("FalconMambaConfig", state_size=16, expand=2),
    # a per-head output gate in its attention, split with the query heads where the table splits them (tp 4)
    "afmoe": lambda: _decoder("AfmoeConfig", **GQA, **SMALL_MOE, num_dense_layers=1, head_dim=32),
    # tried on 2026-12-06 (issue #44): a router that is an MLP of its own, kept whole (Zaya); a query projection
    # packing a per-head gate under another name (MiniCPM5-MoE's `q_gate_proj`); value heads narrower than the
    # query's and sliding layers with twice the KV heads (MiMo-V2-Flash); per-layer inputs and per-layer head sizes
    # and KV counts in a heterogeneous config (Gemma 4, and Gemma 3n with its AltUp); checkpoints transformers
    # converts at load (Kimi-Linear, OLMo-Hybrid: read full, said in the loading check); 128-wide shared experts,
    # split evenly at tp 4 (`deepspeed_compat.even_grain`); gated and sliding attention MoEs (Beam, A.X K2)
    "zaya": lambda: _decoder("ZayaConfig", **GQA, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=128,
                             head_dim=32, router_hidden_size=32),
    "minicpm5_moe": lambda: _decoder("MiniCPM5MoeConfig", **GQA, n_routed_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=128, n_shared_experts=1, head_dim=32),
    "mimo_v2_flash": lambda: _decoder("MiMoV2FlashConfig", num_key_value_heads=2, n_routed_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=128, head_dim=48, v_head_dim=32,
                                      sliding_window=16),
    "gemma4_text": lambda: _decoder("Gemma4TextConfig", **GQA, head_dim=32, global_head_dim=64,
                                    hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
                                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "gemma4_text_kv": lambda: _decoder("Gemma4TextConfig", num_key_value_heads=4, head_dim=32, global_head_dim=64,
                                       hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
                                       attention_k_eq_v=True, num_global_key_value_heads=2, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"]),
    # as published: an activation sparsity in its first layers (the MLP's mean and std of its split inner features
    # taken across the ranks), its last layers reading earlier layers' keys and values (a query and no key: split
    # by heads where KV heads are copied, at tp 4)
    "gemma3n_text": lambda: _decoder("Gemma3nTextConfig", **GQA, head_dim=32, hidden_size_per_layer_input=16,
                                     vocab_size_per_layer_input=96, num_hidden_layers=4,
                                     layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
                                     num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
                                     intermediate_size=[256] * 4, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0]),
    "kimi_linear": lambda: _decoder("KimiLinearConfig", num_key_value_heads=4, num_local_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=128, kv_lora_rank=32,
                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, linear_head_dim=32,
                                    linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                                    mlp_layer_types=["dense", "sparse"]),
    "olmo_hybrid": lambda: _decoder("OlmoHybridConfig", **GQA, layer_types=["linear_attention", "full_attention"]),
    # a Mamba-1 hybrid whose attention-and-MLP block is tied into every hybrid layer (split once, shared again)
    "zamba": lambda: _decoder("ZambaConfig", num_key_value_heads=4, attn_layer_period=3, attn_layer_offset=2,
                              n_mamba_heads=2, mamba_d_state=16, num_hidden_layers=6),
    "beam": lambda: _decoder("BeamConfig", **GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                             head_dim=32, sliding_window=16, n_group=1, topk_group=1),
    "axk2": lambda: _decoder("AXK2Config", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                             kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                             head_dim=32, index_topk=8, index_head_dim=32, index_n_heads=4, num_key_value_heads=4,
                             n_group=1, topk_group=1, gated_norm_rank=8),
    # derived policies: hybrids (state-space, convolution and linear-attention mixers kept whole) and pure SSMs
    "falcon_h1": lambda: _decoder("FalconH1Config", **GQA, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32,
                                  mamba_d_state=16, mamba_n_groups=1, head_dim=32),
    "bamba": lambda: _decoder("BambaConfig", **GQA, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16,
                              mamba_n_groups=1, attn_layer_indices=[1]),
    "granitemoehybrid": lambda: _decoder("GraniteMoeHybridConfig", **GQA, num_local_experts=4, num_experts_per_tok=2,
                                         shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=64,
                                         mamba_d_state=16, mamba_n_groups=1, layer_types=["mamba", "attention"]),
    "nemotron_h": lambda: _decoder("NemotronHConfig", **GQA, hybrid_override_pattern="M*", mamba_num_heads=4,
                                   mamba_head_dim=32, ssm_state_size=16, n_groups=1),
    "jamba": lambda: _decoder("JambaConfig", **GQA, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16),
    "lfm2": lambda: _decoder("Lfm2Config", **GQA, layer_types=["conv", "full_attention"]),
    "qwen3_next": lambda: _decoder("Qwen3NextConfig", **GQA, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=128, shared_expert_intermediate_size=256, head_dim=32,
                                   linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                   linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": lambda: _decoder("Qwen3_5TextConfig", **GQA, head_dim=32, linear_num_value_heads=4,
                                     linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                     layer_types=["linear_attention", "full_attention"]),
    "minimax": lambda: _decoder("MiniMaxConfig", **GQA, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                                layer_types=["linear_attention", "full_attention"]),
    "mamba": lambda: _decoder("MambaConfig", state_size=16, expand=2),
    # an attention inside a module beside the layer's norms (`norm_attn_norm.attn`), its fused Wqkv; experts packed
    # as 2-D [experts x inner, hidden] parameters (w1, v1, w2)
    "dbrx": lambda: _decoder("DbrxConfig", d_model=128, n_heads=4, n_layers=2, max_seq_len=64, hidden_size=None,
                             intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                             max_position_embeddings=None, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0,
                                                                        "clip_qkv": 8.0},
                             ffn_config={"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2}),
    # an encoder generating as a decoder: its MLP across two modules (`intermediate.dense`, `output.dense`)
    "bert": lambda: _decoder("BertConfig", is_decoder=True),
    # from the sweep (`tools/sweep.py`: the type's default config made small), each a mechanism of its own: a
    # differential attention pairing its value heads (kept whole), a norm over the MLP's split width (kept whole),
    # an attention of bare parameters (kept whole), Conv1D layers derived as linears, an indexer reading the
    # layer's input through a square row-parallel-looking linear (kept whole)
    "diffllama": lambda: _swept("diffllama"),
    "bitnet": lambda: _swept("bitnet"),
    "xlnet": lambda: _swept("xlnet"),
    "openai-gpt": lambda: _swept("openai-gpt"),
    "dots3_note_text": lambda: _swept("dots3_note_text"),
    # beside its input embedding, a module DeepSpeed's `set_lm_head` takes for one (`vision_embed_tokens`)
    "fuyu": lambda: _swept("fuyu"),
    # a vision tower whose attention has head counts of its own (kept whole) beside the text model's (checked on
    # text only: the checker gives no images)
    "gemma3": lambda: _swept("gemma3"),
    # an attention reshaping its output to its input's width, read from the input (kept whole); per-head sinks in an
    # attention DeepSpeed would split alone (split with the table's heads)
    "trocr": lambda: _swept("trocr"),
    "granitemoe_swa": lambda: _swept("granitemoe_swa"),
    # multi-head latent attention, a hybrid of linear and full attention, experts routed in groups
    "bailing_hybrid": lambda: _swept("bailing_hybrid"),
    # a row-parallel linear inside the attention writing one value per head (Doge's `dt_proj`), a per-head bias made
    # outside the layers (CPM-Ant's position bias): each attention kept whole
    "doge": lambda: _swept("doge"),
    "cpmant": lambda: _swept("cpmant"),
    # a multi-head latent attention DeepSpeed splits by itself, with attention sinks (one per query head) split here
    "hy_v4": lambda: _swept("hy_v4"),
    # an attention built again from the config while the model runs (BigBird's block-sparse attention, switched to
    # full for a short input): kept whole
    "big_bird": lambda: _swept("big_bird"),
    # a recurrent model (HRM: its layers run 2 x 3 cycles) whose own fp32 rounding is beyond the fixed tolerance:
    # judged against the unsharded model's distance from fp64
    "hrm_text": lambda: _swept("hrm_text"),
    # an embedding (a relative-position table) inside an attention kept whole: hidden from DeepSpeed's split
    "granite_speech": lambda: _swept("granite_speech"),
    # a latent attention DeepSpeed would split alone with no row-parallel output (DeepSeek-V4's grouped `o_a_proj` and
    # `o_b_proj`): kept whole
    "deepseek_v4": lambda: _swept("deepseek_v4"),
    # an output head of a linear class of its own that DeepSpeed leaves unsplit, on meta when pre-sharded: untied
    # again after DeepSpeed's `set_lm_head` tied it to the input embedding
    "ergo": lambda: _swept("ergo"),
    # a speech encoder reading frames of mel bins ([batch, frames, bins]) whose relative-position attention holds a
    # bias row per head and views by the config's head count: kept whole
    "canary": lambda: _swept("canary"),
    # an MLP across two modules of a module (Reformer's `feed_forward.dense` and `feed_forward.output`), gathered by
    # the second: split, not kept whole beside a split row-parallel linear
    "reformer": lambda: _swept("reformer"),
    # a language adapter (an MLP of its own) inside the module that ends the layer's MLP, after its row-parallel
    # linear: the adapter kept whole, the module split (X-MOD, its language set as a saved checkpoint holds it)
    "xmod": lambda: _swept("xmod"),
    # an untied output head of another shape than the input embedding (Moshi's [96, 128] beside [97, 128]): split as
    # itself, never tied to the embedding by DeepSpeed's `set_lm_head`
    "moshi": lambda: _swept("moshi"),
    # a decoder behind an audio encoder, named by transformers' seq2seq mapping only (checked on text)
    "qwen2_audio": lambda: _swept("qwen2_audio"),
    # models that generate only from audio, whose main input is token ids: audio their generate encodes step by step
    # (Kyutai's speech-to-text: raw samples through its Mimi codec; a packed [gate | up] MLP read as a [2, -1] view;
    # its input embedding a module of its own around the table), audio added to the tokens position by position
    # (Voxtral-realtime), audio features in place of the encoder's token embeddings (Pop2Piano)
    "kyutai_speech_to_text": lambda: _swept("kyutai_speech_to_text"),
    "voxtral_realtime": lambda: _swept("voxtral_realtime"),
    "pop2piano": lambda: _swept("pop2piano"),
    # audio tokenizers whose first stage reads as many channels as the decoder has heads (not a per-head table)
    "vibevoice_asr": lambda: _swept("vibevoice_asr"),
    # experts packed without a gate (up_proj and down_proj, 3-D: NemotronH's MoE, Nemotron 3's), beside Mamba2
    # mixers, attention and a dense MLP: split by each expert's inner rows
    "nemotron_h_moe": lambda: _swept("nemotron_h"),
    # Nemotron-3.5-Transcribe: that decoder behind an audio encoder, a diarization head and a word-timestamp head
    "nemo_speechlm": lambda: _swept("nemo_speechlm"),
    # Dory (nGPT-style): per-feature scales of its attention's query and gate and of its MLP's gate and up, L2 norms
    # over their whole widths: both kept whole, said; its own forward fails on left-padded prompts, so the checker
    # uses prompts of one length, said
    "dory": lambda: _swept("dory"),
    # JetMoE: its MLP's experts held by two modules of their own (`input_linear`, `output_linear`) split; its
    # mixture of attention heads kept whole
    "jetmoe": lambda: _swept("jetmoe"),
    # Zamba2: a shared attention-and-MLP block in two hybrid layers, each place with low-rank adapters of its own added
    # to the block's `gate_up_proj` (that MLP kept whole with them), saved pre-sharded though its places share memory
    "zamba2": lambda: _swept("zamba2", layers_block_type=["hybrid", "linear_attention", "hybrid"],
                             hybrid_layer_ids=[0, 2], num_hidden_layers=3),
    # a type whose causal-LM class is its text model alone, whose checkpoints are of its image-and-text class (built by
    # AutoModelForImageTextToText from `architectures`; checked on text: a vision tower and cross-attention layers)
    "mllama": lambda: _swept("mllama", architectures=["MllamaForConditionalGeneration"]),
    # a multimodal type whose checkpoint is a text model: built from its `architectures` (the text-to-text class)
    "seamless_m4t_text": lambda: _swept("seamless_m4t", architectures=["SeamlessM4TForTextToText"]),
    # recurrent models whose unsharded `generate` cannot beam search: that check is skipped and said
    "rwkv": lambda: _decoder("RwkvConfig", attention_hidden_size=128, num_hidden_layers=2),
    "xlstm": lambda: _decoder("xLSTMConfig", num_heads=4, num_blocks=2, embedding_dim=128),
    "mamba2": lambda: _decoder("Mamba2Config", num_heads=4, head_dim=64, state_size=16, n_groups=1, expand=2),
    # the SSM mixers' two group layouts: B and C in as many groups as ranks (each rank its own), and Falcon-H1's
    # gated norm (it counts groups; norm before the gate) over groups that span ranks at tp 4
    "mamba2_groups4": lambda: _decoder("Mamba2Config", num_heads=8, head_dim=32, state_size=16, n_groups=4, expand=2),
    "falcon_h1_norm": lambda: _decoder("FalconH1Config", **GQA, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32,
                                       mamba_d_state=16, mamba_n_groups=2, head_dim=32, mamba_rms_norm=True,
                                       mamba_norm_before_gate=True),
    # derived policies: encoder-decoders
    "pegasus": lambda: _seq2seq("PegasusConfig"),
    "m2m_100": lambda: _seq2seq("M2M100Config"),
    "blenderbot": lambda: _seq2seq("BlenderbotConfig"),
    "blenderbot_small": lambda: _seq2seq("BlenderbotSmallConfig"),
    "plbart": lambda: _seq2seq("PLBartConfig"),
    "mvp": lambda: _seq2seq("MvpConfig"),
    "bigbird_pegasus": lambda: _seq2seq("BigBirdPegasusConfig", attention_type="original_full"),
    "umt5": lambda: _t5("UMT5Config"),
    "longt5": lambda: _t5("LongT5Config", local_radius=4),
    # grouped-query self and cross attention (one table for both: `also`), head counts in sub-configs
    "t5gemma": _t5gemma,
    # experts held as modules (expert_0 ...), a router of its own, every other layer sparse
    "nllb_moe": lambda: _seq2seq("NllbMoeConfig", num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2,
                                 expert_capacity=64),
    # d_ff 256: DeepSpeed splits an MLP in blocks of 64, so 128 gave two of four ranks nothing (35% / 15%)
    "prophetnet": _prophetnet,  # shipped policy: its attentions kept whole (policies/prophetnet.toml says why)
    "switch_transformers": lambda: _t5("SwitchTransformersConfig", num_experts=4, d_ff=256),
    # speech (raw audio in: Moonshine; log-mel features in: Whisper), tokens out; the convolutional front ends
    # are outside the layers, so whole
    "moonshine": _moonshine,
    "whisper": lambda: _seq2seq("WhisperConfig", num_mel_bins=16, max_source_positions=32, max_target_positions=64,
                                suppress_tokens=None, begin_suppress_tokens=None),
}


def save_zoo(root: Path, names: list[str] | None = None, dtype: str = "fp32") -> dict[str, Path]:
    """Build and save the tiny models (all, or `names`), in `dtype` (fp32, fp16, bf16: the checkpoint's own, as
    `policy check` reads it); returns name -> directory."""
    dirs = {}
    for name in names or list(ZOO):
        model = tiny_model(ZOO[name]())
        if dtype != "fp32":
            from .rounding import DTYPES

            model = model.to(DTYPES[dtype])
        dirs[name] = Path(root) / name
        model.save_pretrained(dirs[name])
    return dirs


def tiny_model(config):
    """The random model of `config` a tiny checkpoint holds (the zoo's, the sweep's): seeded, of the class that
    generates with it, an encoder-decoder's generation ending at 12 tokens."""
    import torch

    from ..load.skeleton import model_class_for
    from .small_config import GENERATION

    torch.manual_seed(0)
    model = model_class_for(config).from_config(config)
    if config.is_encoder_decoder:
        model.generation_config.max_length = 12
    for name, value in GENERATION.get(config.model_type, {}).items():  # (`update` sets only attributes it has)
        setattr(model.generation_config, name, value)
        model.generation_config._from_model_config = False  # else made again from the config when loaded
    return model


def fits(name: str, tp: int) -> str | None:
    """Why the tiny `name` cannot run at `tp` (its head counts), or None."""
    from ..errors import InferenceSetupError
    from ..policy.schema import check_head_counts, resolve_policy

    config = ZOO[name]()
    try:
        check_head_counts(resolve_policy("auto", config), config, tp)
    except InferenceSetupError as e:
        return str(e)
    return None


def table(reports: dict[int, dict], zoo: list[str] | None = None, added: list[str] = ()) -> str:
    """The README's architecture table from `policy check --json` reports, one per tp size: a row for each of
    `zoo` (default: every name of the zoo), then for each model directory `added`."""
    rows: dict[str, dict] = {}
    for tp, report in sorted(reports.items()):
        for c in report["checks"]:
            row = rows.setdefault(c["model"], {"tp": {}, "policy": "?", "model_type": "?"})
            row["tp"].setdefault(tp, []).append(c["passed"] or c.get("skipped", False))
            if c.get("skipped"):
                row.setdefault("skipped", {}).setdefault(tp, []).append(c["check"])
            if c["check"] == "weights_per_rank":
                row["policy"] = c["data"].get("policy", "?")
                row["model_type"] = c["data"].get("model_type", "?")
                row.setdefault("share", {})[tp] = max(c["data"]["shares"])
    sizes = sorted(reports)
    lines = ["| model | model_type | policy | " + " | ".join(f"tp {tp}" for tp in sizes) + " |",
             "|---|---|---|" + "---|" * len(sizes)]
    for name in [*(ZOO if zoo is None else zoo), *added]:
        row = rows.get(name)
        if row is None and name in added:
            lines.append(f"| {name} | | | " + " | ".join("not run" for _ in sizes) + " |")
            continue
        if row is None:
            cells = []
            for tp in sizes:
                reason = fits(name, tp)
                cells.append("not run" if reason is None else "heads do not divide")
            lines.append(f"| {name} | | | " + " | ".join(cells) + " |")
            continue
        cells = []
        for tp in sizes:
            results = row["tp"].get(tp)
            if not results:
                cells.append("heads do not divide" if name in ZOO and fits(name, tp) else "not run")
            elif all(results) and len(results) == 8:
                skipped = row.get("skipped", {}).get(tp)
                said = f"; {', '.join(skipped)} skipped: the unsharded model cannot" if skipped else ""
                cells.append(f"pass ({row['share'][tp]:.0%} per rank{said})")
            else:
                cells.append(f"FAIL ({sum(results)}/{len(results)} checks)")
        lines.append(f"| {name} | {row['model_type']} | {row['policy']} | " + " | ".join(cells) + " |")
    if NOT_IN_ZOO:
        lines += ["", "Tried and not in the table: " + "; ".join(f"{k}: {v}" for k, v in NOT_IN_ZOO.items()) + "."]
    return "\n".join(lines) + "\n"


def write_readme(readme: Path, text: str) -> None:
    from ..run.files import write_text_atomic

    content = readme.read_text(encoding="utf-8")
    if TABLE_START not in content or TABLE_END not in content:
        raise SystemExit(f"error: {readme} has no architecture-table markers; add the two lines {TABLE_START!r} "
                         f"and {TABLE_END!r} where the table goes")
    head, rest = content.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    write_text_atomic(readme, f"{head}{TABLE_START}\n{text}{TABLE_END}{tail}")


def run_matrix(tp_sizes: list[int], out_dir: str | None, readme: str | None, names: list[str] | None,
               timeout: float, dtype: str = "fp32", added: list[str] = (), trust_remote_code: bool = False) -> int:
    """The zoo's tiny models (or `names` of them), and the model directories `added` (a user's, or models with their
    own code, `trust_remote_code`), checked at each tp size; the table of their verdicts."""
    from ..load.own_code import check_trust
    from .policy_check import run_check

    for d in added:
        if not (Path(d) / "config.json").is_file():
            print(f"error: --add {d!r} is not a model directory (no config.json)", file=sys.stderr)
            return 2
        check_trust(d, trust_remote_code)

    unknown = [n for n in names or [] if n not in ZOO]
    if unknown:
        print(f"error: --only {unknown[0]!r} is not in the zoo; valid: {', '.join(ZOO)}", file=sys.stderr)
        return 2
    if readme and dtype != "fp32":
        print(f"error: --readme with --dtype {dtype}: the architecture table is the fp32 one; leave out --readme",
              file=sys.stderr)
        return 2
    reports: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ds_inference_zoo_") as tmp:
        dirs = save_zoo(Path(tmp), names, dtype) if names or not added else {}
        out = Path(out_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for tp in tp_sizes:
            runnable = [str(d) for n, d in dirs.items() if fits(n, tp) is None] + [str(d) for d in added]
            path = out / f"matrix_tp{tp}.json"
            run_check(runnable, tp, "auto", timeout=timeout, json_path=str(path), trust_remote_code=trust_remote_code)
            reports[tp] = json.loads(path.read_text())
    text = table(reports, [n for n in ZOO if n in dirs], [Path(d).name for d in added])
    print(text, end="")
    if readme:
        write_readme(Path(readme), text)
    return 0 if all(r["ok"] for r in reports.values()) else 1
