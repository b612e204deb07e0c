"""A decoder in the style of Meta's reference LLaMA code (`model.py`) packaged as a model with its own code: the
reference's names (`attention.wq/wk/wv/wo`, `feed_forward.w1/w2/w3`, `tok_embeddings`, `output`), its rotary
embedding as complex numbers (`freqs_cis`), grouped key/value heads repeated with `repeat_kv` (test fixture)."""

from transformers import PretrainedConfig


class LlamaRefConfig(PretrainedConfig):
    model_type = "llama_ref"

    def __init__(self, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=64,
                 ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, initializer_range=0.2,
                 pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False, **kwargs):
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.vocab_size = vocab_size
        self.multiple_of = multiple_of
        self.ffn_dim_multiplier = ffn_dim_multiplier
        self.norm_eps = norm_eps
        self.rope_theta = rope_theta
        self.max_seq_len = max_seq_len
        self.initializer_range = initializer_range
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def num_hidden_layers(self) -> int:  # what transformers' DynamicCache reads
        return self.n_layers
