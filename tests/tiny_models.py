"""Tiny random models of every architecture with a policy, built from configs and saved locally."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tr

VOCAB = 96
# hidden 128 with 4 heads; MLP widths are multiples of 64 x 4 so DeepSpeed's 64-grain MLP split is even at tp 4.
DECODERS = {
    "gpt2": lambda: tr.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2),
    "gpt_bigcode_mqa": lambda: tr.GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=4, n_positions=64, multi_query=True,
                                                   initializer_range=0.2),
    "gpt_bigcode_mha": lambda: tr.GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                                   multi_query=False, initializer_range=0.2),
    "llama_kv4": lambda: tr.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, initializer_range=0.2),
    "llama_kv2": lambda: tr.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2),
    "llama_kv1": lambda: tr.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, initializer_range=0.2),
    "mistral": lambda: tr.MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2),
    "opt": lambda: tr.OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                                word_embed_proj_dim=128, max_position_embeddings=64, init_std=0.2),
    "bloom": lambda: tr.BloomConfig(hidden_size=128, n_layer=2, n_head=4, initializer_range=0.2),
    "gpt_neox": lambda: tr.GPTNeoXConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2),
    "falcon": lambda: tr.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      multi_query=True, new_decoder_architecture=False, initializer_range=0.2),
    # Falcon-40B-style: grouped KV heads in the fused projection; 2 KV heads are split at tp 2, replicated at tp 4
    "falcon_new": lambda: tr.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2,
                                          new_decoder_architecture=True, initializer_range=0.2),
}


def save_decoder(name: str, root: Path) -> Path:
    torch.manual_seed(0)
    config = DECODERS[name]()
    config.vocab_size = VOCAB
    config.pad_token_id = 0
    config.bos_token_id = config.eos_token_id = 1
    model = tr.AutoModelForCausalLM.from_config(config)
    path = Path(root) / name
    # one family saved as a sharded checkpoint with an index, so every loading check covers that layout too
    model.save_pretrained(path, **({"max_shard_size": "300KB"} if name == "llama_kv2" else {}))
    return path


# Encoder-decoders and decoders whose attention is kept whole on every rank (`replicated` in the policy):
# FSMT, LED and Pegasus-X by a shipped file, OLMo-2 by the derived policy. Widths as the other seq2seq models.
_S2S = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=0, init_std=0.5,
            forced_eos_token_id=None)
KEPT_WHOLE = {
    "fsmt": lambda: tr.FSMTConfig(**{k: v for k, v in _S2S.items() if k != "vocab_size"}, langs=["en", "ro"],
                                  src_vocab_size=VOCAB, tgt_vocab_size=VOCAB),
    "led": lambda: tr.LEDConfig(**_S2S, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                                attention_window=8),
    "pegasus_x": lambda: tr.PegasusXConfig(**_S2S, block_size=8, num_global_tokens=4),
    "olmo2": lambda: tr.Olmo2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=1, initializer_range=0.2),
}


def save_kept_whole(name: str, root: Path) -> Path:
    torch.manual_seed(0)
    config = KEPT_WHOLE[name]()
    cls = tr.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tr.AutoModelForCausalLM
    model = cls.from_config(config)
    if config.is_encoder_decoder:
        model.generation_config.max_length = 12
    path = Path(root) / name
    model.save_pretrained(path)
    return path
