"""A decoder in the style of MosaicML's MPT remote code (`configuration_mpt.py`, `modeling_mpt.py` of mpt-7b): ALiBi
made by the model's own code as a bias tensor (`attn_bias`, no module holds it) and handed to every block, `Wqkv`
read with `.chunk(3, dim=2)`, an MLP `up_proj` / `down_proj`, LayerNorms without bias (test fixture)."""

from transformers import PretrainedConfig


class MPTConfig(PretrainedConfig):
    model_type = "mpt_ref"
    attribute_map = {"num_attention_heads": "n_heads", "hidden_size": "d_model", "num_hidden_layers": "n_layers"}

    def __init__(self, d_model=128, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=96,
                 alibi_bias_max=8, no_bias=True, layer_norm_epsilon=1e-5, initializer_range=0.2, pad_token_id=0,
                 bos_token_id=1, eos_token_id=1, tie_word_embeddings=True, **kwargs):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.expansion_ratio = expansion_ratio
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.alibi_bias_max = alibi_bias_max
        self.no_bias = no_bias
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
