"""The policy derived for a model with no file, read in this process from tiny random models (no rank starts):
the row-parallel linears (the config's tp plan first), the attention table and its per-rank attributes, and the
one-line refusal of what cannot be placed. That each derived policy also gives the unsharded model's tokens is
`test_policies_tp.py`'s (`policy check`, several ranks)."""

import pytest
import torch
import transformers as tr

from ds_inference_integration import InferenceSetupError
from ds_inference_integration.policy.derive import derive_policy
from ds_inference_integration.policy.schema import load_policy, policy_to_toml

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, vocab_size=96,
              pad_token_id=0, bos_token_id=1, eos_token_id=1)


def model_of(config):
    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(config)


def test_phi3_fused_qkv_with_grouped_kv_heads_and_the_config_the_attention_reads():
    policy = derive_policy(model_of(tr.Phi3Config(**COMMON, num_key_value_heads=2)))
    assert policy.layers == {"Phi3DecoderLayer": ("mlp.down_proj", "self_attn.o_proj")}
    spec = policy.attention
    assert (spec.fused_qkv, spec.layout, spec.query_heads, spec.kv_heads) == (
        "self_attn.qkv_proj", "qkv", "num_attention_heads", "num_key_value_heads")
    # Phi3Attention.forward slices at self.config.num_attention_heads * head_dim: that count must be this rank's
    assert dict(spec.local) == {"num_key_value_heads": "kv_heads", "num_key_value_groups": "q_per_kv",
                                "config.num_attention_heads": "q_heads"}
    assert policy.head_count_attributes == ("num_attention_heads",)


def test_fewer_kv_heads_than_query_heads_gets_an_attention_table():
    """Gemma 2B has one KV head: without a table DeepSpeed gave every KV head to rank 0 (58.6% / 41.4% at tp 2)."""
    spec = derive_policy(model_of(tr.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=32))).attention
    assert (spec.query, spec.key, spec.value, spec.kv_heads) == (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "num_key_value_heads")
    assert dict(spec.local) == {"num_key_value_groups": "q_per_kv"}
    # as many KV heads as query heads, separate projections: DeepSpeed's own split is right, no table
    assert derive_policy(model_of(tr.LlamaConfig(**COMMON, num_key_value_heads=4))).attention is None


@pytest.mark.parametrize("config, layout, kv", [
    (tr.PersimmonConfig(**COMMON, qk_layernorm=True), "per_head", 4),  # view(.., heads, 3, head_dim)
    (tr.GPTNeoXConfig(**COMMON), "per_head", 4),  # view(.., -1, 3 * head_size)
    (tr.BloomConfig(hidden_size=128, n_layer=1, n_head=4, vocab_size=96), "per_head", 4),
    (tr.FalconConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=8, num_kv_heads=2, vocab_size=96,
                     new_decoder_architecture=True), "grouped", 2),
    (tr.FalconConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=96, multi_query=True,
                     new_decoder_architecture=False), "qkv", 1),  # num_kv_heads says 4; multi_query means one
    (tr.GPTBigCodeConfig(n_embd=128, n_layer=1, n_head=4, vocab_size=96, multi_query=True), "qkv", 1),
    (tr.GPTBigCodeConfig(n_embd=128, n_layer=1, n_head=4, vocab_size=96, multi_query=False), "per_head", 4),
], ids=["persimmon", "gpt_neox", "bloom", "falcon_new", "falcon_mqa", "gpt_bigcode_mqa", "gpt_bigcode_mha"])
def test_fused_layout_comes_from_the_config_and_the_attentions_own_view(config, layout, kv):
    spec = derive_policy(model_of(config)).attention
    kv_heads = spec.kv_heads if isinstance(spec.kv_heads, int) else getattr(config, spec.kv_heads)
    assert (spec.layout, kv_heads) == (layout, kv)


def test_the_configs_tp_plan_is_the_first_source_of_row_parallel_linears():
    """transformers' base_model_tp_plan names the row-wise linears; AutoTP decides only for those it does not name
    (here the plan, changed on purpose, makes up_proj row-wise and says down_proj is column-wise)."""
    config = tr.LlamaConfig(**COMMON, num_key_value_heads=4)
    config.base_model_tp_plan = {"layers.*.mlp.up_proj": "rowwise", "layers.*.mlp.down_proj": "colwise"}
    assert derive_policy(model_of(config)).layers == {"LlamaDecoderLayer": ("mlp.up_proj", "self_attn.o_proj")}
    config.base_model_tp_plan = {}
    assert derive_policy(model_of(config)).layers == {"LlamaDecoderLayer": ("mlp.down_proj", "self_attn.o_proj")}


def test_an_attention_no_rank_can_compute_from_its_own_heads_is_kept_whole(caplog):
    """OLMo-2 normalises all of q_proj's output at once: its attention is kept whole on every rank (with a warning
    naming the norm), and the MLP is still split; per-head norms (Qwen3) split as usual."""
    with caplog.at_level("WARNING"):
        policy = derive_policy(model_of(tr.Olmo2Config(**COMMON, num_key_value_heads=2)))
    assert policy.replicated == {"Olmo2DecoderLayer": ("self_attn",)} and policy.attention is None
    assert policy.layers == {"Olmo2DecoderLayer": ("mlp.down_proj",)}  # o_proj is inside the whole attention
    assert "Olmo2DecoderLayer.self_attn.q_norm normalises a whole projection" in caplog.text
    qwen3 = derive_policy(model_of(tr.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32)))
    assert not qwen3.replicated and qwen3.attention is not None


def test_replicated_modules_are_read_written_and_refused_when_they_name_nothing(tmp_path):
    from ds_inference_integration.shard.inject import replicate_modules

    path = tmp_path / "p.toml"
    path.write_text('model_types = ["x"]\n[layers.LlamaDecoderLayer]\nrow_parallel = ["mlp.down_proj"]\n'
                    'replicated = ["self_attn"]\n')
    policy = load_policy(path)
    assert policy.replicated == {"LlamaDecoderLayer": ("self_attn",)}
    path.write_text(policy_to_toml(policy))
    assert load_policy(path).replicated == policy.replicated
    model = model_of(tr.LlamaConfig(**COMMON, num_key_value_heads=4))
    layers = list(model.model.layers)
    assert replicate_modules(layers, policy) == 4  # q, k, v, o of the one layer: whole, and not nn.Linear
    assert not any(isinstance(m, torch.nn.Linear) for m in layers[0].self_attn.modules())
    path.write_text('model_types = ["x"]\n[layers.LlamaDecoderLayer]\nrow_parallel = []\nreplicated = ["attn"]\n')
    with pytest.raises(InferenceSetupError, match="replicated 'attn' names no module inside LlamaDecoderLayer"):
        replicate_modules(list(model_of(tr.LlamaConfig(**COMMON)).model.layers), load_policy(path))
    path.write_text('model_types = ["x"]\n[layers.LlamaDecoderLayer]\nrow_parallel = []\n')
    with pytest.raises(InferenceSetupError, match="row_parallel' must be a non-empty list"):
        load_policy(path)


def test_a_derived_policy_written_out_reads_back_the_same(tmp_path):
    """What `policy suggest` prints: a key with a dot is quoted (TOML would read it as a table); written unquoted
    by hand, the same entry is read too."""
    policy = derive_policy(model_of(tr.Phi3Config(**COMMON, num_key_value_heads=2)))
    path = tmp_path / "phi3.toml"
    path.write_text(policy_to_toml(policy))
    again = load_policy(path)
    assert (again.layers, again.attention, again.head_count_attributes) == (
        policy.layers, policy.attention, policy.head_count_attributes)
    path.write_text(policy_to_toml(policy).replace('"config.num_attention_heads"', "config.num_attention_heads"))
    assert load_policy(path).attention == policy.attention
    path.write_text(policy_to_toml(policy).replace('"config.num_attention_heads"', '"model.config.x"'))
    with pytest.raises(InferenceSetupError, match=r"\[attention.local\] entries .*model.config.x"):
        load_policy(path)
