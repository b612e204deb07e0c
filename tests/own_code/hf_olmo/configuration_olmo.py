"""OLMo-1 (the `hf_olmo` remote code), written for tests: configuration.

The published class wraps OLMo's own `ModelConfig` dataclass; here its fields are plain keyword arguments with the same
names and defaults. `final_logit_softcapping` is an addition (not OLMo's): the head soft-caps its logits.
"""

from transformers import PretrainedConfig


class OLMoConfig(PretrainedConfig):
    """OLMo configuration (`d_model`, `n_heads`, `n_layers`, ... as in OLMo's ModelConfig)."""

    model_type = "hf_olmo"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        d_model: int = 768,
        n_heads: int = 12,
        n_layers: int = 12,
        mlp_ratio: int = 4,
        mlp_hidden_size: int | None = None,
        activation_type: str = "swiglu",
        block_type: str = "sequential",
        alibi: bool = False,
        alibi_bias_max: float = 8.0,
        rope: bool = True,
        rope_theta: float = 10000.0,
        flash_attention: bool = False,
        attention_dropout: float = 0.0,
        multi_query_attention: bool = False,
        attention_layer_norm: bool = False,
        residual_dropout: float = 0.0,
        embedding_dropout: float = 0.0,
        layer_norm_type: str = "default",
        layer_norm_with_affine: bool = False,
        attention_layer_norm_with_affine: bool = False,
        include_bias: bool = False,
        bias_for_layer_norm: bool | None = None,
        scale_logits: bool = False,
        max_sequence_length: int = 2048,
        vocab_size: int = 50280,
        embedding_size: int | None = 50304,
        weight_tying: bool = True,
        init_device: str | None = None,
        init_fn: str = "normal",
        init_std: float = 0.02,
        clip_qkv: float | None = None,
        final_logit_softcapping: float | None = None,
        use_cache: bool = False,
        pad_token_id: int | None = 1,
        bos_token_id: int | None = None,
        eos_token_id: int | None = 50279,
        **kwargs,
    ) -> None:
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size
        self.activation_type = activation_type
        self.block_type = block_type
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.rope = rope
        self.rope_theta = rope_theta
        self.flash_attention = flash_attention
        self.attention_dropout = attention_dropout
        self.multi_query_attention = multi_query_attention
        self.attention_layer_norm = attention_layer_norm
        self.residual_dropout = residual_dropout
        self.embedding_dropout = embedding_dropout
        self.layer_norm_type = layer_norm_type
        self.layer_norm_with_affine = layer_norm_with_affine
        self.attention_layer_norm_with_affine = attention_layer_norm_with_affine
        self.include_bias = include_bias
        self.bias_for_layer_norm = bias_for_layer_norm
        self.scale_logits = scale_logits
        self.max_sequence_length = max_sequence_length
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.weight_tying = weight_tying
        self.init_device = init_device
        self.init_fn = init_fn
        self.init_std = init_std
        self.clip_qkv = clip_qkv
        self.final_logit_softcapping = final_logit_softcapping
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["OLMoForCausalLM"])
        # OLMo ties through `weight_tying`: with it there is no output projection at all (logits use wte's weight)
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=weight_tying,
            **kwargs,
        )

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def effective_n_kv_heads(self) -> int:
        return 1 if self.multi_query_attention else self.n_heads
