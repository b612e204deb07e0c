"""A small fairseq / Marian style translation transformer with its own code (written for these tests): post-norm
encoder and decoder, sinusoidal positions, a fused per-head [q k v] self-attention projection and a cross-attention
whose key/value projection is packed [key | value]."""

import math

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import PreTrainedModel

from .configuration_translator import TranslatorConfig


def sinusoidal_positions(num_positions, embedding_dim):
    """fairseq's table: row p is [sin(p * w_0) ... sin(p * w_{h-1}) | cos(p * w_0) ... cos(p * w_{h-1})]."""
    half_dim = embedding_dim // 2
    scale = math.log(10000) / (half_dim - 1)
    freqs = torch.exp(torch.arange(half_dim, dtype=torch.float32) * -scale)
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if embedding_dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    return table


def _padding_mask(mask, dtype):
    """[bsz, len] 1/0 -> additive [bsz, 1, 1, len]."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask[:, None, None, :].bool(), zero, torch.finfo(dtype).min)


def _causal_mask(batch_size, q_len, past_len, decoder_mask, dtype, device):
    kv_len = past_len + q_len
    allowed = torch.arange(kv_len, device=device)[None, :] <= torch.arange(past_len, kv_len, device=device)[:, None]
    allowed = allowed[None, None, :, :].expand(batch_size, 1, q_len, kv_len)
    if decoder_mask is not None:
        allowed = allowed & decoder_mask[:, None, None, -kv_len:].bool()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _attend(query, key, value, mask, dropout, training):
    scores = torch.matmul(query, key.transpose(-1, -2))
    if mask is not None:
        scores = scores + mask
    weights = nn.functional.softmax(scores.float(), dim=-1).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=training)
    return torch.matmul(weights, value), weights


class FusedSelfAttention(nn.Module):
    """Self-attention with one `qkv` projection laid out per head: output features [h0: q k v | h1: q k v | ...], read
    with `.view(bsz, len, heads, 3, head_dim).unbind(3)`."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, is_causal=False, layer_idx=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.scaling = self.head_dim**-0.5
        self.dropout = dropout
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None):
        bsz, seq_len, _ = hidden_states.size()
        qkv = self.qkv(hidden_states).view(bsz, seq_len, self.num_heads, 3, self.head_dim)
        query, key, value = qkv.unbind(dim=3)
        query = (query * self.scaling).transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        if past_key_values is not None:
            cache = past_key_values.self_attention_cache if isinstance(past_key_values, EncoderDecoderCache) else past_key_values
            key, value = cache.update(key, value, self.layer_idx)
        attn_output, attn_weights = _attend(query, key, value, attention_mask, self.dropout, self.training)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, seq_len, self.embed_dim)
        return self.out_proj(attn_output), attn_weights


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention: `q_proj` on the decoder states, `kv_proj` on the encoder states packed [key |
    value] (`.chunk(2, dim=-1)`). The keys and values are computed on the first decoding step and then read back from
    the cross-attention half of the `EncoderDecoderCache`."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, layer_idx=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = dropout
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.kv_proj = nn.Linear(embed_dim, 2 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None, past_key_values=None):
        bsz, tgt_len, _ = hidden_states.size()
        query = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, self.num_heads, self.head_dim)
        query = query.transpose(1, 2)

        is_updated = False
        if isinstance(past_key_values, EncoderDecoderCache):
            is_updated = past_key_values.is_updated.get(self.layer_idx, False)
        if is_updated:
            layer = past_key_values.cross_attention_cache.layers[self.layer_idx]
            key, value = layer.keys, layer.values
        else:
            src_len = encoder_hidden_states.shape[1]
            key, value = self.kv_proj(encoder_hidden_states).chunk(2, dim=-1)
            key = key.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
            value = value.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
            if isinstance(past_key_values, EncoderDecoderCache):
                key, value = past_key_values.cross_attention_cache.update(key, value, self.layer_idx)
                past_key_values.is_updated[self.layer_idx] = True

        attn_output, attn_weights = _attend(query, key, value, attention_mask, self.dropout, self.training)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), attn_weights


class TranslatorEncoderLayer(nn.Module):
    def __init__(self, config: TranslatorConfig):
        super().__init__()
        self.embed_dim = config.d_model
        self.dropout = config.dropout
        self.self_attn = FusedSelfAttention(self.embed_dim, config.attention_heads, dropout=config.dropout)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.activation_fn = ACT2FN[config.activation_function]
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, attn_weights = self.self_attn(hidden_states, attention_mask=attention_mask)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)

        residual = hidden_states
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states, attn_weights


class TranslatorDecoderLayer(nn.Module):
    def __init__(self, config: TranslatorConfig, layer_idx=None):
        super().__init__()
        self.embed_dim = config.d_model
        self.dropout = config.dropout
        self.self_attn = FusedSelfAttention(
            self.embed_dim, config.attention_heads, dropout=config.dropout, is_causal=True, layer_idx=layer_idx
        )
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.encoder_attn = CrossAttention(self.embed_dim, config.attention_heads, dropout=config.dropout, layer_idx=layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.activation_fn = ACT2FN[config.activation_function]
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(
        self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None
    ):
        residual = hidden_states
        hidden_states, self_attn_weights = self.self_attn(
            hidden_states, attention_mask=attention_mask, past_key_values=past_key_values
        )
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)

        residual = hidden_states
        hidden_states, cross_attn_weights = self.encoder_attn(
            hidden_states,
            encoder_hidden_states,
            attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
        )
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.encoder_attn_layer_norm(residual + hidden_states)

        residual = hidden_states
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states, self_attn_weights, cross_attn_weights


class TranslatorPreTrainedModel(PreTrainedModel):
    config_class = TranslatorConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TranslatorEncoderLayer", "TranslatorDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, (TranslatorEncoder, TranslatorDecoder)):
            # the sinusoidal table is not in the checkpoint: fill it again when the model is built on `meta`
            module.embed_positions.copy_(sinusoidal_positions(*module.embed_positions.shape))


class TranslatorEncoder(TranslatorPreTrainedModel):
    def __init__(self, config: TranslatorConfig, embed_tokens=None):
        super().__init__(config)
        self.dropout = config.dropout
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        if embed_tokens is None:
            embed_tokens = nn.Embedding(config.vocab_size, config.d_model, self.padding_idx)
        self.embed_tokens = embed_tokens
        self.register_buffer(
            "embed_positions", sinusoidal_positions(config.max_position_embeddings, config.d_model), persistent=False
        )
        self.layers = nn.ModuleList([TranslatorEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        seq_len = inputs_embeds.shape[1]
        hidden_states = inputs_embeds + self.embed_positions[:seq_len].to(inputs_embeds.dtype)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        mask = _padding_mask(attention_mask, hidden_states.dtype) if attention_mask is not None else None

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, attn_weights = layer(hidden_states, attention_mask=mask)
            if output_attentions:
                all_attentions += (attn_weights,)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if not return_dict:
            return tuple(v for v in [hidden_states, all_hidden_states, all_attentions] if v is not None)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions)


class TranslatorDecoder(TranslatorPreTrainedModel):
    def __init__(self, config: TranslatorConfig, embed_tokens=None):
        super().__init__(config)
        self.dropout = config.dropout
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        if embed_tokens is None:
            embed_tokens = nn.Embedding(config.vocab_size, config.d_model, self.padding_idx)
        self.embed_tokens = embed_tokens
        self.register_buffer(
            "embed_positions", sinusoidal_positions(config.max_position_embeddings, config.d_model), persistent=False
        )
        self.layers = nn.ModuleList([TranslatorDecoderLayer(config, layer_idx=i) for i in range(config.decoder_layers)])
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        batch_size, seq_len = inputs_embeds.shape[:2]

        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if not use_cache:
            past_key_values = None
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0

        positions = self.embed_positions[past_len : past_len + seq_len].to(inputs_embeds.dtype)
        hidden_states = nn.functional.dropout(inputs_embeds + positions, p=self.dropout, training=self.training)

        self_mask = _causal_mask(batch_size, seq_len, past_len, attention_mask, hidden_states.dtype, hidden_states.device)
        cross_mask = (
            _padding_mask(encoder_attention_mask, hidden_states.dtype) if encoder_attention_mask is not None else None
        )

        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        all_cross_attns = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, self_attn, cross_attn = layer(
                hidden_states,
                attention_mask=self_mask,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                past_key_values=past_key_values,
            )
            if output_attentions:
                all_self_attns += (self_attn,)
                all_cross_attns += (cross_attn,)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if not return_dict:
            return tuple(
                v
                for v in [hidden_states, past_key_values, all_hidden_states, all_self_attns, all_cross_attns]
                if v is not None
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values,
            hidden_states=all_hidden_states,
            attentions=all_self_attns,
            cross_attentions=all_cross_attns,
        )


class TranslatorModel(TranslatorPreTrainedModel):
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: TranslatorConfig):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.encoder = TranslatorEncoder(config, self.shared)
        self.decoder = TranslatorDecoder(config, self.shared)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = value
        self.encoder.embed_tokens = self.shared
        self.decoder.embed_tokens = self.shared

    def get_encoder(self, modality=None):
        return self.encoder

    def get_decoder(self):
        return self.decoder

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        past_key_values=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )

        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        if not return_dict:
            return decoder_outputs.to_tuple() + encoder_outputs.to_tuple()
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class TranslatorForConditionalGeneration(TranslatorPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}

    def __init__(self, config: TranslatorConfig):
        super().__init__(config)
        self.model = TranslatorModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # generation defaults live in the generation config (saved as generation_config.json), not in config.json
        self.generation_config = GenerationConfig(
            decoder_start_token_id=config.decoder_start_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.model.shared

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_encoder(self, modality=None):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        past_key_values=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state)

        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.config.vocab_size), labels.view(-1))

        if not return_dict:
            output = (logits,) + outputs.to_tuple()[1:]
            return (loss,) + output if loss is not None else output
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )
