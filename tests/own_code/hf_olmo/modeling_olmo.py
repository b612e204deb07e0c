"""OLMo-1 (the `hf_olmo` remote code), written for tests: model.

`OLMoForCausalLM.model` is an `OLMo` module whose `transformer` ModuleDict holds `wte`, `emb_drop`, `ln_f` and the
`blocks`. Each `OLMoSequentialBlock` keeps its linears on itself: `att_proj` fused [q | k | v] split by the block's
`fused_dims` tuple, `attn_out`, `ff_proj` packing [x | gate] for the SwiGLU `act`, and `ff_out`. With `weight_tying`
there is no output projection: the logits are `F.linear(x, wte.weight)`, then soft-capped by `final_logit_softcapping`
(an addition to OLMo).
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_olmo import OLMoConfig


def _attention_bias(
    attention_mask: torch.Tensor | None, batch_size: int, query_length: int, past_length: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive [batch, 1, query, key] bias: causal, plus the padding of a 2-D mask over past and current tokens."""
    key_length = past_length + query_length
    query_pos = torch.arange(past_length, key_length, device=device)[:, None]
    key_pos = torch.arange(key_length, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None].expand(batch_size, 1, query_length, key_length)
    if attention_mask is not None:
        if attention_mask.dim() == 4:  # already prepared: boolean (True = attend) or additive
            if attention_mask.dtype == torch.bool:
                allowed = allowed & attention_mask
            else:
                return attention_mask.to(dtype)
        else:
            mask = attention_mask.to(device=device, dtype=torch.bool)
            if mask.shape[-1] < key_length:
                mask = torch.cat([mask.new_ones(batch_size, key_length - mask.shape[-1]), mask], dim=-1)
            allowed = allowed & mask[:, None, None, -key_length:]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


class LayerNormBase(nn.Module):
    """Base of OLMo's layer norms; `build` picks the kind from `config.layer_norm_type`."""

    def __init__(self, config: OLMoConfig, *, size: int | None = None, elementwise_affine: bool | None = True,
                 eps: float = 1e-05) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.normalized_shape = (size or config.d_model,)
        if elementwise_affine or (elementwise_affine is None and config.layer_norm_with_affine):
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            use_bias = config.bias_for_layer_norm
            if use_bias is None:
                use_bias = config.include_bias
            if use_bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("bias", None)
            self.register_parameter("weight", None)

    @classmethod
    def build(cls, config: OLMoConfig, size: int | None = None, **kwargs) -> "LayerNormBase":
        if config.layer_norm_type in ("default", "low_precision"):
            return LayerNorm(config, size=size, **kwargs)
        raise NotImplementedError(f"Unknown LayerNorm type: '{config.layer_norm_type}'")


class LayerNorm(LayerNormBase):
    """Plain layer norm; with `layer_norm_with_affine` false it has no parameters at all."""

    def __init__(self, config: OLMoConfig, size: int | None = None, elementwise_affine: bool | None = None,
                 eps: float = 1e-05) -> None:
        super().__init__(config, size=size, elementwise_affine=elementwise_affine, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=self.bias, eps=self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the whole head ([first half | second half] rotation), at explicit positions."""

    def __init__(self, config: OLMoConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.d_model // config.n_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin: torch.Tensor, pos_cos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [batch, heads, seq, head_dim]; position_ids: [batch or 1, seq]."""
        freqs = position_ids.to(torch.float)[..., None] * self.inv_freq.to(q.device)[None, None, :]
        positions = torch.cat((freqs, freqs), dim=-1)[:, None, :, :]
        pos_sin, pos_cos = positions.sin(), positions.cos()
        q_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, q.float())
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k.float())
        return q_.type_as(q), k_.type_as(k)


class Activation(nn.Module):
    """Base of the MLP activations; `output_multiplier` is the width of its output relative to its input."""

    def __init__(self, config: OLMoConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def output_multiplier(self) -> float:
        raise NotImplementedError

    @classmethod
    def build(cls, config: OLMoConfig) -> "Activation":
        if config.activation_type == "gelu":
            return GELU(config)
        if config.activation_type == "relu":
            return ReLU(config)
        if config.activation_type == "swiglu":
            return SwiGLU(config)
        raise NotImplementedError(f"Unknown activation: '{config.activation_type}'")


class GELU(Activation):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="none")

    @property
    def output_multiplier(self) -> float:
        return 1.0


class ReLU(Activation):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)

    @property
    def output_multiplier(self) -> float:
        return 1.0


class SwiGLU(Activation):
    """The packed [x | gate] halves: silu(gate) * x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x

    @property
    def output_multiplier(self) -> float:
        return 0.5


class OLMoBlock(nn.Module):
    """Shared parts of an OLMo block: attention output, MLP output, activation, rotary embedding, the attention."""

    def __init__(self, layer_id: int, config: OLMoConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.hidden_size = (
            config.mlp_hidden_size if config.mlp_hidden_size is not None else config.mlp_ratio * config.d_model
        )
        assert config.d_model % config.n_heads == 0

        self.dropout = nn.Dropout(config.residual_dropout)

        self.k_norm: LayerNormBase | None = None
        self.q_norm: LayerNormBase | None = None
        if config.attention_layer_norm:
            self.k_norm = LayerNormBase.build(
                config,
                size=(config.d_model // config.n_heads) * config.effective_n_kv_heads,
                elementwise_affine=config.attention_layer_norm_with_affine,
            )
            self.q_norm = LayerNormBase.build(config, elementwise_affine=config.attention_layer_norm_with_affine)

        if config.clip_qkv is not None:
            assert config.clip_qkv > 0

        self.act = Activation.build(config)
        assert (self.act.output_multiplier * self.hidden_size) % 1 == 0

        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_out = nn.Linear(int(self.act.output_multiplier * self.hidden_size), config.d_model, bias=config.include_bias)
        self.ff_out._is_residual = True

        if self.config.rope:
            self.rotary_emb = RotaryEmbedding(config)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0):
        num_kv_heads, num_q_heads = k.size(1), q.size(1)
        if num_kv_heads != num_q_heads:
            k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
            v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
        scores = (torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))).float()
        if attn_mask is not None:  # fp32 additive bias, added and normalised in fp32
            scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0.0)
        return torch.matmul(weights, v)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        layer_past: Cache | None = None,
        use_cache: bool = False,
        position_ids: torch.LongTensor | None = None,
    ) -> tuple[torch.Tensor, Cache | None]:
        B, T, C = q.size()  # batch size, sequence length, d_model
        dtype = k.dtype

        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q).to(dtype=dtype)
            k = self.k_norm(k).to(dtype=dtype)

        # Move head forward to be next to the batch dim: [B, nh, T, hs]
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)

        if self.config.rope:
            q, k = self.rotary_emb(q, k, position_ids)

        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_id)
        present = layer_past if use_cache else None

        att = self._scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias, dropout_p=0.0 if not self.training else self.config.attention_dropout
        )

        # Re-assemble all head outputs side-by-side.
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att), present


class OLMoSequentialBlock(OLMoBlock):
    """x + attn(attn_norm(x)), then + ff(ff_norm(x)); the linears sit on the block itself."""

    def __init__(self, layer_id: int, config: OLMoConfig) -> None:
        super().__init__(layer_id, config)
        self.attn_norm = LayerNorm.build(config)
        self.ff_norm = LayerNorm.build(config)
        head_dim = config.d_model // config.n_heads
        self.fused_dims = (
            config.d_model,
            config.effective_n_kv_heads * head_dim,
            config.effective_n_kv_heads * head_dim,
        )
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, self.hidden_size, bias=config.include_bias)

    def forward(
        self,
        x: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        layer_past: Cache | None = None,
        use_cache: bool = False,
        position_ids: torch.LongTensor | None = None,
    ) -> tuple[torch.Tensor, Cache | None]:
        qkv = self.att_proj(self.attn_norm(x))
        if self.config.clip_qkv is not None:
            qkv.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)

        att, cache = self.attention(
            q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache, position_ids=position_ids
        )
        x = x + self.dropout(att)

        og_x = x
        x = self.ff_norm(x)
        x = self.ff_proj(x)
        x = self.act(x)
        x = self.ff_out(x)
        x = self.dropout(x)
        x = og_x + x
        return x, cache

    @classmethod
    def build(cls, layer_id: int, config: OLMoConfig) -> "OLMoBlock":
        if config.block_type == "sequential":
            return OLMoSequentialBlock(layer_id, config)
        raise NotImplementedError(f"Unknown block type: '{config.block_type}'")


class OLMoOutput(NamedTuple):
    logits: torch.FloatTensor
    attn_key_values: Cache | None
    hidden_states: tuple[torch.Tensor, ...] | None


class OLMo(nn.Module):
    """The OLMo network: `transformer` = ModuleDict(wte, emb_drop, ln_f, blocks[, wpe][, ff_out])."""

    def __init__(self, config: OLMoConfig, init_params: bool = True) -> None:
        super().__init__()
        self.config = config
        if config.alibi:
            raise NotImplementedError("ALiBi is not part of this test model (rope or learned positions only)")

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.embedding_size or config.vocab_size, config.d_model),
                emb_drop=nn.Dropout(config.embedding_dropout),
                ln_f=LayerNorm.build(config),
            )
        )
        blocks = [OLMoSequentialBlock.build(i, config) for i in range(config.n_layers)]
        self.transformer.update({"blocks": nn.ModuleList(blocks)})
        if not (self.config.alibi or self.config.rope):
            self.transformer.update({"wpe": nn.Embedding(config.max_sequence_length, config.d_model)})
        if not config.weight_tying:
            self.transformer.update(
                {"ff_out": nn.Linear(config.d_model, config.embedding_size or config.vocab_size, bias=config.include_bias)}
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None,
        input_embeddings: torch.FloatTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        last_logits_only: bool = False,
        output_hidden_states: bool | None = None,
        position_ids: torch.LongTensor | None = None,
    ) -> OLMoOutput:
        x = self.transformer.wte(input_ids) if input_embeddings is None else input_embeddings  # [B, T, d_model]
        batch_size, seq_len = x.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0

        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                full = attention_mask.long().cumsum(-1) - 1
                position_ids = full.masked_fill(attention_mask == 0, 0)[:, -seq_len:]
            else:
                position_ids = torch.arange(past_length, past_length + seq_len, device=x.device)[None]

        if not (self.config.alibi or self.config.rope):
            x = x + self.transformer.wpe(position_ids)

        x = self.transformer.emb_drop(x)

        bias = _attention_bias(attention_mask, batch_size, seq_len, past_length, torch.float32, x.device)
        if attention_bias is not None:  # an extra additive bias over the full sequence, as OLMo takes it
            key_len = past_length + seq_len
            bias = bias + attention_bias[:, :, key_len - seq_len : key_len, :key_len].to(bias.dtype)
            bias = bias.clamp(min=torch.finfo(bias.dtype).min)

        all_hidden_states = []
        for block in self.transformer.blocks:
            if output_hidden_states:
                all_hidden_states.append(x)
            x, _ = block(x, attention_bias=bias, layer_past=past_key_values, use_cache=use_cache, position_ids=position_ids)

        if last_logits_only:
            x = x[:, -1, :].unsqueeze(1)

        x = self.transformer.ln_f(x)
        if output_hidden_states:
            all_hidden_states.append(x)

        if self.config.weight_tying:
            logits = F.linear(x, self.transformer.wte.weight, None)
        else:
            logits = self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits.mul_(1 / math.sqrt(self.config.d_model))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap

        return OLMoOutput(
            logits=logits,
            attn_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
        )


class OLMoForCausalLM(PreTrainedModel, GenerationMixin):
    """Extremely barebones HF model wrapper around the OLMo network."""

    config_class = OLMoConfig
    base_model_prefix = "model"
    _no_split_modules = ["OLMoBlock", "OLMoSequentialBlock"]

    def __init__(self, config: OLMoConfig, model: OLMo | None = None, init_params: bool = False) -> None:
        super().__init__(config)
        self.model = model if model is not None else OLMo(config, init_params=init_params)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, LayerNormBase):
            if module.weight is not None:
                module.weight.data.fill_(1.0)
            if module.bias is not None:
                module.bias.data.zero_()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        # transformers >= 5 hands the cache over as `cache`; older callers as `past_key_values`
        past_key_values = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache
        if output_attentions:
            raise ValueError("output_attentions is not yet supported in OLMo")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()

        outputs = self.model.forward(
            input_ids=input_ids,
            input_embeddings=inputs_embeds,
            attention_mask=attention_mask,
            attention_bias=attention_bias,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            position_ids=position_ids,
        )

        logits = outputs.logits
        hidden_states = outputs.hidden_states

        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
            loss = F.cross_entropy(
                shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100
            )

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.attn_key_values,
            hidden_states=hidden_states,
        )

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        if self.config.weight_tying:
            return self.model.transformer.wte
        return self.model.transformer.ff_out

    def set_output_embeddings(self, value: nn.Module) -> None:
        if self.config.weight_tying:
            self.model.transformer.wte = value
        else:
            self.model.transformer.ff_out = value

    def tie_weights(self, *args, **kwargs) -> None:
        """No-op: with `weight_tying` there is no output projection to tie, the logits use `wte`'s weight directly."""
        pass
