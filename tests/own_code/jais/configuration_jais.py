"""JAIS (GPT-2 layout with SwiGLU, ALiBi and muP scaling), written for tests: configuration."""

from transformers import PretrainedConfig


class JAISConfig(PretrainedConfig):
    """JAIS configuration: GPT-2 names (`n_embd`, `n_layer`, ...) plus the ALiBi and muP settings."""

    model_type = "jais"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    def __init__(
        self,
        vocab_size: int = 84992,
        n_positions: int = 2048,
        n_embd: int = 5120,
        n_layer: int = 40,
        n_head: int = 40,
        n_inner: int | None = 13653,
        activation_function: str = "swiglu",
        resid_pdrop: float = 0.0,
        embd_pdrop: float = 0.0,
        attn_pdrop: float = 0.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        scale_attn_weights: bool = True,
        use_cache: bool = True,
        bos_token_id: int | None = 0,
        eos_token_id: int | None = 0,
        pad_token_id: int | None = 0,
        scale_attn_by_inverse_layer_idx: bool = False,
        reorder_and_upcast_attn: bool = False,
        position_embedding_type: str = "alibi",
        mup_width_scale: float = 1.0,
        mup_embeddings_scale: float = 1.0,
        mup_output_alpha: float = 1.0,
        mup_scale_qk_dot_by_d: bool = False,
        alibi_scaling: dict | None = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_inner = n_inner
        self.activation_function = activation_function
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attn_pdrop = attn_pdrop
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.scale_attn_weights = scale_attn_weights
        self.use_cache = use_cache
        self.scale_attn_by_inverse_layer_idx = scale_attn_by_inverse_layer_idx
        self.reorder_and_upcast_attn = reorder_and_upcast_attn
        self.position_embedding_type = position_embedding_type
        self.mup_width_scale = mup_width_scale
        self.mup_embeddings_scale = mup_embeddings_scale
        self.mup_output_alpha = mup_output_alpha
        self.mup_scale_qk_dot_by_d = mup_scale_qk_dot_by_d
        self.alibi_scaling = alibi_scaling
        self._alibi_scaling_validation()

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _alibi_scaling_validation(self) -> None:
        """`alibi_scaling`: None, {"type": "linear", "factor": f > 1} or {"type": "linear", "train_seq_len": n > 1}."""
        if self.alibi_scaling is None:
            return
        if not isinstance(self.alibi_scaling, dict) or len(self.alibi_scaling) != 2:
            raise ValueError(
                "`alibi_scaling` must be a dictionary with two fields, `type` and `factor` or `type` and "
                f"`train_seq_len`, got {self.alibi_scaling}"
            )
        scaling_type = self.alibi_scaling.get("type", None)
        factor = self.alibi_scaling.get("factor", None)
        train_seq_len = self.alibi_scaling.get("train_seq_len", None)
        if scaling_type != "linear":
            raise ValueError(f"`alibi_scaling`'s `type` field must be 'linear', got {scaling_type}")
        if factor is not None and (not isinstance(factor, float) or factor <= 1.0):
            raise ValueError(f"`alibi_scaling`'s factor field must be a float > 1.0, got {factor}")
        if train_seq_len is not None and (not isinstance(train_seq_len, int) or train_seq_len <= 1):
            raise ValueError(f"`alibi_scaling`'s `train_seq_len` field must be an integer > 1, got {train_seq_len}")
