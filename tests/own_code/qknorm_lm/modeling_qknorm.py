"""The model of configuration_qknorm.py (test fixture): `blocks[i].attn.qkv_packed` [Q | K | V] read with
`split([nq * d, nkv * d, nkv * d])` by the attention's own `n_q_heads` / `n_kv_heads`, then an RMS norm over each
head's features on the query and key (`q_norm`, `k_norm`), rotary, grouped key/value heads repeated for their query
heads; `blocks[i].mlp.gate_up` [gate | up] read with `.chunk(2, -1)`, `down`."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_qknorm import QKNormConfig


class RMSNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Rotary(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.index = index
        self.n_q_heads, self.n_kv_heads = config.n_q_heads, config.n_kv_heads
        self.head_dim = config.hidden_size // config.n_q_heads
        self.qkv_packed = nn.Linear(config.hidden_size, (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim,
                                    bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_eps)
        self.out = nn.Linear(self.n_q_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache=None):
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv_packed(x).split([self.n_q_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        q = self.q_norm(q.view(b, s, self.n_q_heads, d)).transpose(1, 2)
        k = self.k_norm(k.view(b, s, self.n_kv_heads, d)).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        group = self.n_q_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / d ** 0.5 + mask
        out = torch.matmul(scores.softmax(-1), v)
        return self.out(out.transpose(1, 2).reshape(b, s, self.n_q_heads * d))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.ffn_size, bias=False)
        self.down = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.attn = Attention(config, index)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


class QKNormModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config.hidden_size // config.n_q_heads, config.rope_base)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class QKNormForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = QKNormConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.model = QKNormModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                use_cache=None, labels=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(b, past + s, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
        cos, sin = self.model.rotary(position_ids)
        keys = torch.arange(past + s, device=input_ids.device)
        causal = keys[None, :] <= (past + torch.arange(s, device=input_ids.device))[:, None]
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
        x = self.model.embed(input_ids)
        for block in self.model.blocks:
            x = block(x, cos, sin, mask, cache)
        logits = self.lm_head(self.model.norm(x)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)
