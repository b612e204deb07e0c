"""The model of configuration_mpt.py (test fixture): MPT's ALiBi bias made in the model's forward by a function of
its own code (`build_alibi_bias`, [1, heads, 1, keys]) and passed to each block as `attn_bias`; each attention adds
it to its scores. DeepSpeed replaces a method named `transformer._attn_bias` (mosaicml's MPT code's, whose signature
it assumes) by one cutting the bias to a rank's heads; this model's builder has another name, as other published
remote code's do."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mpt import MPTConfig


def gen_slopes(n_heads, alibi_bias_max=8):
    n = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n + 1, dtype=torch.float32) * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, alibi_bias_max=8):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32).view(1, 1, 1, seq_len)
    return alibi_bias * gen_slopes(n_heads, alibi_bias_max)  # [1, heads, 1, keys]


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads, index):
        super().__init__()
        self.d_model, self.n_heads, self.index = d_model, n_heads, index
        self.head_dim = d_model // n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, attn_bias, mask, cache=None):
        b, s, _ = x.shape
        query, key, value = self.Wqkv(x).chunk(3, dim=2)
        q = query.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = key.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = value.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        scores = q.matmul(k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + attn_bias[:, :, :, -k.shape[2]:] + mask
        out = scores.softmax(-1).matmul(v).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.out_proj(out)


class MPTMLP(nn.Module):
    def __init__(self, d_model, expansion_ratio):
        super().__init__()
        self.up_proj = nn.Linear(d_model, expansion_ratio * d_model, bias=False)
        self.down_proj = nn.Linear(expansion_ratio * d_model, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x), approximate="none"))


class MPTBlock(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)
        self.attn = MultiheadAttention(config.d_model, config.n_heads, index)
        self.norm_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)
        self.ffn = MPTMLP(config.d_model, config.expansion_ratio)

    def forward(self, x, attn_bias=None, mask=None, cache=None):
        x = x + self.attn(self.norm_1(x), attn_bias, mask, cache)
        return x + self.ffn(self.norm_2(x))


class MPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([MPTBlock(config, i) for i in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)

    def alibi(self, keys):
        return build_alibi_bias(self.config.n_heads, keys, self.config.alibi_bias_max)


class MPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["MPTBlock"]
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.transformer = MPTModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)

    def get_input_embeddings(self):
        return self.transformer.wte

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, cache=None, use_cache=None,
                labels=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(b, past + s, dtype=torch.long, device=input_ids.device)
        # ALiBi by distance to the last key (the same for every row of a left-padded batch), as MPT's own
        keys = torch.arange(past + s, device=input_ids.device)
        causal = keys[None, :] <= (past + torch.arange(s, device=input_ids.device))[:, None]
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
        attn_bias = self.transformer.alibi(past + s)
        x = self.transformer.wte(input_ids)
        for block in self.transformer.blocks:
            x = block(x, attn_bias=attn_bias, mask=mask, cache=cache)
        logits = self.lm_head(self.transformer.norm_f(x)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)
