"""Configuration of a small fairseq / Marian style translation transformer with its own code."""

from transformers.configuration_utils import PretrainedConfig


class TranslatorConfig(PretrainedConfig):
    model_type = "translator"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_attention_heads": "attention_heads", "hidden_size": "d_model"}

    def __init__(
        self,
        vocab_size=32000,
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        attention_heads=8,
        ffn_dim=2048,
        max_position_embeddings=512,
        dropout=0.1,
        activation_function="relu",
        scale_embedding=True,
        init_std=0.02,
        use_cache=True,
        is_encoder_decoder=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.encoder_layers = encoder_layers
        self.decoder_layers = decoder_layers
        self.attention_heads = attention_heads
        self.ffn_dim = ffn_dim
        self.max_position_embeddings = max_position_embeddings
        self.dropout = dropout
        self.activation_function = activation_function
        self.scale_embedding = scale_embedding
        self.init_std = init_std
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=decoder_start_token_id,
            is_encoder_decoder=is_encoder_decoder,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
