"""JAIS (GPT-2 layout with SwiGLU, ALiBi and muP scaling), written for tests: model.

GPT-2's `Conv1D` projections (weights stored [in, out]): a fused `c_attn` split into equal q | k | v thirds by
`self.split_size`, an MLP `c_proj(c_fc(x) * silu(c_fc2(x)))`, and ALiBi: one model-level module whose slopes are a
(frozen) parameter saved in the checkpoint, computing the bias once per forward for every block.
"""

import math

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.pytorch_utils import Conv1D

from .configuration_jais import JAISConfig


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


class SwiGLUActivation(nn.Module):
    """x1 * silu(x2)."""

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return x1 * nn.functional.silu(x2)


class AlibiPositionEmbeddingLayer(nn.Module):
    """ALiBi: a per-head linear penalty on the query-key distance. The slopes are a frozen parameter (checkpointed)."""

    def __init__(self, num_heads: int, alibi_scaling: dict | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.alibi_scaling = alibi_scaling
        slopes = torch.tensor(AlibiPositionEmbeddingLayer._get_alibi_slopes(num_heads)).unsqueeze(-1)
        self.slopes = nn.parameter.Parameter(slopes, requires_grad=False)

    def forward(self, seq_length: int, key_length: int, cached_qk_len: int) -> torch.Tensor:
        """Bias [heads, seq_length, cached_qk_len + key_length] for queries at cached_qk_len.. and all keys."""
        context_position = torch.arange(cached_qk_len, cached_qk_len + seq_length, device=self.slopes.device)[:, None]
        memory_position = torch.arange(key_length + cached_qk_len, device=self.slopes.device)[None, :]
        relative_position = memory_position - context_position
        relative_position = torch.abs(relative_position).unsqueeze(0).expand(self.num_heads, -1, -1)

        if self.alibi_scaling is None:
            scale = 1.0
        elif self.alibi_scaling.get("factor") is not None:
            scale = self.alibi_scaling["factor"]
        elif relative_position.shape[-1] > self.alibi_scaling["train_seq_len"]:
            scale = relative_position.shape[-1] / self.alibi_scaling["train_seq_len"]
        else:
            scale = 1.0

        return (self.slopes / -scale).unsqueeze(1) * relative_position

    @staticmethod
    def _get_alibi_slopes(n: int) -> list[float]:
        def get_slopes_power_of_2(n: int) -> list[float]:
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(n).is_integer():
            return get_slopes_power_of_2(n)
        closest_power_of_2 = 2 ** math.floor(math.log2(n))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + AlibiPositionEmbeddingLayer._get_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
        )


class JAISAttention(nn.Module):
    """GPT-2 attention: fused Conv1D c_attn (q | k | v), muP 1/d scaling, ALiBi bias added to the scores."""

    def __init__(self, config: JAISConfig, is_cross_attention: bool = False, layer_idx: int | None = None) -> None:
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError(f"`embed_dim` must be divisible by num_heads (got {self.embed_dim} and {self.num_heads}).")

        self.scale_attn_weights = config.scale_attn_weights
        self.is_cross_attention = is_cross_attention
        self.scale_attn_by_inverse_layer_idx = config.scale_attn_by_inverse_layer_idx
        self.layer_idx = layer_idx
        self.reorder_and_upcast_attn = config.reorder_and_upcast_attn

        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.attn_scale_power = 1.0 if config.mup_scale_qk_dot_by_d else 0.5

    def _attn(self, query, key, value, attention_mask=None, head_mask=None, position_bias=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype, device=attn_weights.device
            )
        if self.scale_attn_by_inverse_layer_idx:
            attn_weights = attn_weights / float(self.layer_idx + 1)
        attn_weights = attn_weights.to(torch.float32)  # biases added and normalised in fp32
        if attention_mask is not None:  # causal + padding, additive
            attn_weights = attn_weights + attention_mask
        if position_bias is not None:
            attn_weights = attn_weights + position_bias.type_as(attn_weights).unsqueeze(0)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def _split_heads(self, tensor: torch.Tensor, num_heads: int, attn_head_size: int) -> torch.Tensor:
        """[batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]."""
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        return tensor.permute(0, 2, 1, 3)

    def _merge_heads(self, tensor: torch.Tensor, num_heads: int, attn_head_size: int) -> torch.Tensor:
        """[batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]."""
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(
        self,
        hidden_states: torch.FloatTensor,
        layer_past: Cache | None = None,
        attention_mask: torch.FloatTensor | None = None,
        head_mask: torch.FloatTensor | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        position_bias: torch.FloatTensor | None = None,
    ) -> tuple:
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)

        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)

        attn_output, attn_weights = self._attn(query, key, value, attention_mask, head_mask, position_bias)

        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)

        outputs = (attn_output,)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs


class JAISMLP(nn.Module):
    """SwiGLU MLP: c_proj(c_fc(x) * silu(c_fc2(x)))."""

    def __init__(self, intermediate_size: int, config: JAISConfig) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        self.swiglu = config.activation_function == "swiglu"
        self.c_fc = Conv1D(intermediate_size, embed_dim)
        self.c_fc2 = Conv1D(intermediate_size, embed_dim) if self.swiglu else None
        self.c_proj = Conv1D(embed_dim, intermediate_size)
        self.act = SwiGLUActivation() if self.swiglu else ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:
        if self.swiglu:
            hidden_states2 = self.c_fc2(hidden_states)
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states, hidden_states2) if self.swiglu else self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        return self.dropout(hidden_states)


class JAISBlock(nn.Module):
    """Pre-LayerNorm GPT-2 block."""

    def __init__(self, config: JAISConfig, layer_idx: int | None = None) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size

        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = JAISAttention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = JAISMLP(inner_dim, config)

    def forward(
        self,
        hidden_states: torch.FloatTensor,
        layer_past: Cache | None = None,
        attention_mask: torch.FloatTensor | None = None,
        head_mask: torch.FloatTensor | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        position_bias: torch.FloatTensor | None = None,
    ) -> tuple:
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_outputs = self.attn(
            hidden_states,
            layer_past=layer_past,
            attention_mask=attention_mask,
            head_mask=head_mask,
            use_cache=use_cache,
            output_attentions=output_attentions,
            position_bias=position_bias,
        )
        attn_output = attn_outputs[0]
        outputs = attn_outputs[1:]
        hidden_states = attn_output + residual

        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states

        return (hidden_states,) + outputs


class JAISPreTrainedModel(PreTrainedModel):
    """muP-aware GPT-2 initialisation and the loading glue."""

    config_class = JAISConfig
    base_model_prefix = "transformer"
    is_parallelizable = True
    supports_gradient_checkpointing = False
    _no_split_modules = ["JAISBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        """Linears/Conv1D: normal(0, initializer_range * sqrt(mup_width_scale)); embeddings normal(0, initializer_range).
        The ALiBi slopes (a parameter of AlibiPositionEmbeddingLayer) are left as their `__init__` computed them."""
        mup_init_scale = math.sqrt(self.config.mup_width_scale)
        if isinstance(module, (nn.Linear, Conv1D)):
            module.weight.data.normal_(mean=0.0, std=(self.config.initializer_range * mup_init_scale))
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

        # Residual projections: scaled by 1 / sqrt(2 * n_layer) (GPT-2 scheme)
        for name, p in module.named_parameters():
            if name == "c_proj.weight":
                p.data.normal_(
                    mean=0.0,
                    std=(self.config.initializer_range * mup_init_scale / math.sqrt(2 * self.config.n_layer)),
                )


class JAISModel(JAISPreTrainedModel):
    """Embeddings (muP-scaled), the blocks with one shared ALiBi bias, and the final LayerNorm."""

    def __init__(self, config: JAISConfig) -> None:
        super().__init__(config)

        self.embed_dim = config.hidden_size

        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = (
            nn.Embedding(config.max_position_embeddings, self.embed_dim)
            if config.position_embedding_type == "learned"
            else None
        )
        self.embeddings_scale = config.mup_embeddings_scale

        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([JAISBlock(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

        self.relative_pe = (
            AlibiPositionEmbeddingLayer(config.num_attention_heads, config.alibi_scaling)
            if config.position_embedding_type == "alibi"
            else None
        )

        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.wte = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.FloatTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        head_mask: torch.FloatTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        # transformers >= 5 hands the cache over as `cache`; older callers as `past_key_values`
        past_key_values = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        batch_size, seq_length = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0

        hidden_states = inputs_embeds
        if self.wpe is not None:
            if position_ids is None:
                if attention_mask is not None and attention_mask.dim() == 2:
                    full = attention_mask.long().cumsum(-1) - 1
                    position_ids = full.masked_fill(attention_mask == 0, 0)[:, -seq_length:]
                else:
                    position_ids = torch.arange(past_length, past_length + seq_length, device=device)[None]
            hidden_states = hidden_states + self.wpe(position_ids)
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids)

        hidden_states = hidden_states * torch.tensor(
            float(self.embeddings_scale), dtype=hidden_states.dtype, device=device
        )
        hidden_states = self.drop(hidden_states)

        causal_bias = _attention_bias(attention_mask, batch_size, seq_length, past_length, torch.float32, device)
        position_bias = self.relative_pe(seq_length, seq_length, past_length) if self.relative_pe is not None else None

        all_self_attentions = () if output_attentions else None
        all_hidden_states = () if output_hidden_states else None
        for block in self.h:
            if output_hidden_states:
                all_hidden_states = all_hidden_states + (hidden_states,)
            outputs = block(
                hidden_states,
                layer_past=past_key_values,
                attention_mask=causal_bias,
                head_mask=None,
                use_cache=use_cache,
                output_attentions=output_attentions,
                position_bias=position_bias,
            )
            hidden_states = outputs[0]
            if output_attentions:
                all_self_attentions = all_self_attentions + (outputs[1],)

        hidden_states = self.ln_f(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states + (hidden_states,)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_self_attentions,
        )


class JAISLMHeadModel(JAISPreTrainedModel, GenerationMixin):
    """JAIS with its (tied) language-modeling head; logits scaled by mup_output_alpha * mup_width_scale."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: JAISConfig) -> None:
        super().__init__(config)
        self.transformer = JAISModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.output_logits_scale = config.mup_output_alpha * config.mup_width_scale
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.FloatTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        head_mask: torch.FloatTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        transformer_outputs = self.transformer(
            input_ids,
            past_key_values=cache if cache is not None else past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        hidden_states = transformer_outputs.last_hidden_state

        lm_logits = self.lm_head(hidden_states)
        lm_logits = lm_logits * torch.tensor(float(self.output_logits_scale), dtype=lm_logits.dtype, device=lm_logits.device)

        loss = None
        if labels is not None:
            shift_logits = lm_logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
            loss = nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))

        return CausalLMOutputWithPast(
            loss=loss,
            logits=lm_logits,
            cache=transformer_outputs.cache,
            hidden_states=transformer_outputs.hidden_states,
            attentions=transformer_outputs.attentions,
        )
