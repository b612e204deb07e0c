"""A decoder with its own code in the style of the 2025-26 remote-code families: per-head RMS norms on the query and
key (Qwen3-style), one fused projection [Q | K | V] with grouped key/value heads, a packed [gate | up] MLP, and its
head counts under the config names its authors chose (`n_q_heads`, `n_kv_heads`), which no rule of the derivation
knows (test fixture)."""

from transformers import PretrainedConfig


class QKNormConfig(PretrainedConfig):
    model_type = "qknorm_lm"

    def __init__(self, vocab_size=96, hidden_size=128, n_layers=2, n_q_heads=4, n_kv_heads=2, ffn_size=256,
                 rms_eps=1e-6, rope_base=10000.0, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                 bos_token_id=1, eos_token_id=1, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.n_layers = n_layers
        self.n_q_heads = n_q_heads
        self.n_kv_heads = n_kv_heads
        self.ffn_size = ffn_size
        self.rms_eps = rms_eps
        self.rope_base = rope_base
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def num_hidden_layers(self) -> int:  # what transformers' DynamicCache reads
        return self.n_layers
