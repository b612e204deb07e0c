"""Phi (the original "MixFormer" remote code of phi-1 / phi-1.5), written for tests: model.

A parallel block (one LayerNorm feeding both the attention and the MLP, whose outputs are summed with the residual),
a fused `Wqkv` read as `(three h d)` with einops, partial rotary embeddings over the first `rotary_dim` channels of
each head, and a head `lm_head` holding its own LayerNorm and Linear.
"""

import math
from typing import Any

import torch
import torch.nn as nn
from einops import rearrange
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_phi import PhiConfig


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


class Embedding(nn.Module):
    """Token embedding (no absolute positions: rotary)."""

    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, input_ids: torch.LongTensor) -> torch.FloatTensor:
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        hidden_states = self.wte(input_ids)
        return self.drop(hidden_states)


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the first `dim` channels of each head (non-interleaved halves)."""

    def __init__(self, dim: int, base: float = 10000.0, max_position_embeddings: int = 2048, device: Any = None) -> None:
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.max_position_embeddings = max_position_embeddings
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [batch, seq, heads, head_dim]; cos/sin: [batch, seq, 1, dim / 2]
        x_rot, x_pass = x[..., : self.dim], x[..., self.dim :]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([rotated.to(x.dtype), x_pass], dim=-1)

    def forward(self, qkv: torch.Tensor, position_ids: torch.LongTensor) -> torch.Tensor:
        """qkv: [batch, seq, 3, heads, head_dim]; rotates q and k at `position_ids` ([batch or 1, seq])."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(qkv.device)[None, None, :]
        cos = freqs.cos()[:, :, None, :]
        sin = freqs.sin()[:, :, None, :]
        q = self._rotate(qkv[:, :, 0], cos, sin)
        k = self._rotate(qkv[:, :, 1], cos, sin)
        return torch.stack([q, k, qkv[:, :, 2]], dim=2)


class MLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, config: PhiConfig, n_inner: int | None = None, act_fn: str | None = None) -> None:
        super().__init__()
        act_fn = config.activation_function if act_fn is None else act_fn
        n_inner = getattr(config, "n_inner", None) if n_inner is None else n_inner
        n_inner = n_inner if n_inner is not None else 4 * config.n_embd
        self.fc1 = nn.Linear(config.n_embd, n_inner)
        self.fc2 = nn.Linear(n_inner, config.n_embd)
        self.act = ACT2FN[act_fn]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.act(hidden_states)
        return self.fc2(hidden_states)


def _find_mha_dims(config: PhiConfig, n_head: int | None = None, n_head_kv: int | None = None) -> tuple[int, int]:
    n_head = n_head if n_head is not None else config.n_head
    n_head_kv = n_head_kv if n_head_kv is not None else (getattr(config, "n_head_kv", None) or n_head)
    return n_head, n_head_kv


class MHA(nn.Module):
    """Multi-head attention with a fused Wqkv projection and (partial) rotary embeddings."""

    def __init__(self, config: PhiConfig, rotary_dim: int | None = None, rotary_base: float = 10000.0,
                 bias: bool = True, layer_idx: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim if rotary_dim is not None else getattr(config, "rotary_dim", 0)
        if self.rotary_dim > 0:
            self.rotary_emb = RotaryEmbedding(self.rotary_dim, base=rotary_base, max_position_embeddings=config.n_positions)
        self.n_head, self.n_head_kv = _find_mha_dims(config)
        self.head_dim = config.n_embd // self.n_head
        op_size = self.head_dim * (self.n_head + 2 * self.n_head_kv)
        hidden_size = config.n_embd
        self.Wqkv = nn.Linear(hidden_size, op_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim)
        self.layer_idx = layer_idx

    def forward(
        self,
        x: torch.FloatTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.FloatTensor:
        qkv = self.Wqkv(x)
        if self.n_head == self.n_head_kv:
            qkv = rearrange(qkv, "... (three h d) -> ... three h d", three=3, d=self.head_dim)
        else:  # grouped heads: [q | k v] with the k/v heads packed as (two hkv d)
            q = rearrange(qkv[..., : self.n_head * self.head_dim], "... (h d) -> ... h d", d=self.head_dim)
            kv = rearrange(qkv[..., self.n_head * self.head_dim :], "... (two hkv d) -> ... two hkv d", two=2, d=self.head_dim)
            repeat = self.n_head // self.n_head_kv
            kv = kv.repeat_interleave(repeat, dim=-2)
            qkv = torch.cat([q.unsqueeze(-3), kv], dim=-3)
        if self.rotary_dim > 0:
            qkv = self.rotary_emb(qkv, position_ids)
        q, k, v = qkv.unbind(dim=2)  # [batch, seq, heads, head_dim]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)

        scores = torch.matmul(q, (k * self.softmax_scale).transpose(-1, -2)).to(torch.float32)
        if attention_mask is not None:  # fp32 additive bias, added and normalised in fp32
            scores = scores + attention_mask
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        attention = self.attn_dropout(attention)
        out = torch.matmul(attention, v)
        out = rearrange(out, "b h s d -> b s (h d)")
        return self.out_proj(out)


class ParallelBlock(nn.Module):
    """One LayerNorm, then attention and MLP in parallel: hidden = attn_out + mlp_out + residual."""

    def __init__(self, config: PhiConfig, block_idx: int | None = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.block_idx = block_idx
        self.mixer = MHA(config, layer_idx=block_idx)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden_states: torch.FloatTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.FloatTensor:
        residual = hidden_states
        hidden_states = self.ln(hidden_states)
        attn_outputs = self.mixer(
            hidden_states, past_key_values=past_key_values, attention_mask=attention_mask, position_ids=position_ids
        )
        if isinstance(attn_outputs, tuple):
            attn_outputs = attn_outputs[0]
        attn_outputs = self.resid_dropout(attn_outputs)
        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        return attn_outputs + feed_forward_hidden_states + residual


class CausalLMHead(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.linear = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:
        hidden_states = self.ln(hidden_states)
        return self.linear(hidden_states).to(torch.float32)


class CausalLMLoss(nn.Module):
    """Shifted cross entropy."""

    def __init__(self, shift_labels: bool = True) -> None:
        super().__init__()
        self.shift_labels = shift_labels
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(self, logits: torch.FloatTensor, labels: torch.LongTensor) -> torch.FloatTensor:
        if self.shift_labels:
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
        return self.loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))


class PhiPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the loading glue."""

    config_class = PhiConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False
    _no_split_modules = ["ParallelBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            if module.bias is not None:
                module.bias.data.zero_()
            module.weight.data.fill_(1.0)


class PhiModel(PhiPreTrainedModel):
    """Embedding and the stack of parallel blocks (the final LayerNorm lives in the head)."""

    def __init__(self, config: PhiConfig) -> None:
        super().__init__(config)
        self.embd = Embedding(config)
        self.h = nn.ModuleList([ParallelBlock(config, block_idx=i) for i in range(config.n_layer)])
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embd.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.embd.wte = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
    ) -> torch.FloatTensor:
        hidden_states = self.embd(input_ids)
        batch_size, seq_length = hidden_states.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                full = attention_mask.long().cumsum(-1) - 1
                full = full.masked_fill(attention_mask == 0, 0)
                position_ids = full[:, -seq_length:]
            else:
                position_ids = torch.arange(past_length, past_length + seq_length, device=input_ids.device)[None]
        bias = _attention_bias(attention_mask, batch_size, seq_length, past_length, torch.float32, hidden_states.device)
        for layer in self.h:
            hidden_states = layer(
                hidden_states, past_key_values=past_key_values, attention_mask=bias, position_ids=position_ids
            )
        return hidden_states


class PhiForCausalLM(PhiPreTrainedModel, GenerationMixin):
    """Phi for causal language modeling."""

    _keys_to_ignore_on_load_unexpected = [r"transformer\.h\.\d+\.mlp.(fc_in|fc_out)\.(weight|bias)"]

    def __init__(self, config: PhiConfig) -> None:
        super().__init__(config)
        self.transformer = PhiModel(config)
        self.lm_head = CausalLMHead(config)
        self.loss = CausalLMLoss()
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.embd.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.transformer.embd.wte = new_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.linear

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.linear = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        # transformers >= 5 hands the cache over as `cache`; older callers as `past_key_values`
        past_key_values = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else getattr(self.config, "use_cache", True)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        hidden_states = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, position_ids=position_ids
        )
        lm_logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss(lm_logits, labels)

        return CausalLMOutputWithPast(loss=loss, logits=lm_logits, cache=past_key_values if use_cache else None)
