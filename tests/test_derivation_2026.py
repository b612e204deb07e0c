"""The automatic path on the layer kinds of 2026's models, in this process from tiny random models of the zoo
(no rank starts): every kind of layer derived (a dense-first MoE's expert layers), mixers split by their heads
(`test_mixers.py`: each layout's ranks against the whole mixer), routers kept whole,
DeepSpeed's Yuan routing kept off HunYuan, any exception of a sharded forward one line naming its module, and the
weight share measured against its target. That these policies give the unsharded model's tokens at tp 2 is
`test_policies_tp.py::test_the_2026_families_match_the_unsharded_model` (and `policy matrix`, tp 2 and 4)."""

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import assert_close_up_to_rounding
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.load.skeleton import model_class_for
from ds_inference_integration.policy.derive import derive_policy
from ds_inference_integration.tools.architecture_zoo import ZOO


def zoo_model(name):
    config = ZOO[name]()
    torch.manual_seed(0)
    return model_class_for(config).from_config(config).eval()


@pytest.mark.parametrize("name, layer", [("deepseek_v3", "DeepseekV3DecoderLayer"), ("glm4_moe", "Glm4MoeDecoderLayer"),
                                         ("dots1", "Dots1DecoderLayer")])
def test_a_dense_first_moe_splits_the_experts_of_its_later_layers(name, layer):
    """Layer 0 is dense (`first_k_dense_replace`), layers 1-2 hold experts: the first instance alone has none, and
    the run held 75% of the weights per rank at tp 2 (issue #27). Both kinds are checked numerically, too."""
    from ds_inference_integration.policy.verify import first_layers

    model = zoo_model(name)
    policy = derive_policy(model)
    assert policy.experts == {layer: ("mlp.experts",)}
    assert list(first_layers(model, list(policy.layers))) == ["model.layers.0", "model.layers.1"]  # dense, experts


@pytest.mark.parametrize("name, whole, mixers", [
    # state-space, convolution and linear-attention mixers: split by their heads or channels (`shard/mixers.py`)
    ("mamba2", set(), {"mixer"}), ("mamba", set(), {"mixer"}), ("falcon_h1", set(), {"mamba"}),
    ("lfm2", set(), {"conv"}), ("jamba", set(), {"mamba"}), ("bamba", set(), {"mamba"}),
    ("nemotron_h", set(), {"mixer@NemotronHMamba2Mixer"}),  # its attention layers' mixer is split by the table
    ("qwen3_5_text", set(), {"linear_attn"}),
    # its attention's q_proj packs [query | gate] per head: split with its heads
    ("qwen3_next", {"mlp.shared_expert_gate"}, {"linear_attn"}),
    # its lightning attention (a 3 x width qkv_proj into a 1 x width out_proj) kept whole before: 55% per rank
    ("minimax", set(), {"self_attn@MiniMaxLightningAttention"}),
    ("hunyuan_v1_dense", set(), set()), ("ernie4_5_moe", set(), set()),  # a bare-weight router: nothing to split
    ("t5gemma", set(), set()),  # its cross attention split by the self attention's table (`also`): it was refused
    ("nllb_moe", {"ffn.router.classifier"}, set()),  # experts held as modules: each split as an MLP, the router whole
    # tried beyond the list: a sparse attention's indexer scores every token, computed whole (its `wk`, the
    # linear before its norm, was AutoTP's row-parallel guess: "shape '[3, 10, 64, 128]' is invalid" at tp 2)
    ("deepseek_v32", {"self_attn.indexer"}, set()), ("glm_moe_dsa", {"self_attn.indexer"}, set()),
    # a router scoring more outputs than experts (zero-computation experts), found by its name: it was split
    ("longcat_flash", {"mlp.router.classifier"}, set()),
    ("lfm2_moe", set(), {"conv"}), ("granitemoeshared", set(), {"shared_mlp"}), ("falcon_mamba", set(), {"mixer"}),
    ("bigbird_pegasus", set(), set()),  # its encoder attention's `self` (q, k, v) is gathered by its sibling `output`
    # a [gate | up] fc1 (kept whole before: 69% per rank at tp 2); its cross attention split by the table's `also`
    ("moonshine", set(), {"mlp"}), ("granitemoehybrid", set(), {"shared_mlp", "mamba"}),
])
def test_mixers_are_split_by_heads_routers_kept_whole_and_the_rest_split(name, whole, mixers, caplog):
    """State-space, convolution and linear-attention mixers pack streams of different widths in one projection,
    which a split by output rows cuts across: they are split by their heads or channels here (Mamba2 was kept whole,
    100% of its weights on every rank). Routers must route every token alike on every rank. No row-parallel linear
    of the policy lies inside a module kept whole or a mixer (DeepSpeed would split it)."""
    with caplog.at_level(logging.WARNING):
        policy = derive_policy(zoo_model(name))
    kept = {p for paths in policy.replicated.values() for p in paths}
    assert kept == whole, policy.replicated
    assert {p for paths in policy.mixers.values() for p in paths} == mixers, policy.mixers
    assert ("kept whole on every rank" in caplog.text) == bool(whole) and all(p in caplog.text for p in whole)
    for name, rows in policy.layers.items():  # nothing split inside them
        inside = [*policy.replicated.get(name, ()), *policy.mixers.get(name, ())]  # "PATH@Class": that kind only
        assert not any(r == p or r.startswith(p + ".") for r in rows for p in inside)


def test_an_mlp_whose_row_parallel_linear_no_convention_names_is_found_by_its_shapes():
    """LFM2's MLP is w1, w3 -> w2: AutoTP knows `w2` only in Mixtral, and column-split all three (the sharded
    forward failed in feed_forward.w2)."""
    policy = derive_policy(zoo_model("lfm2"))
    assert "feed_forward.w2" in policy.layers["Lfm2DecoderLayer"]


def test_deepspeed_sees_no_yuan_in_hunyuan_and_the_class_is_untouched():
    """DeepSpeed 0.19 sends any module whose str() holds "Yuan" to Yuan-specific code (`auto_tp.py`)."""
    from ds_inference_integration.deepspeed_compat import yuan_named_apart

    model = zoo_model("hunyuan_v1_dense")
    assert "Yuan" in str(model.model.layers[0])
    with yuan_named_apart(model) as renamed:
        assert renamed > 0 and "Yuan" not in str(model)
    assert "HunYuanDenseV1DecoderLayer" in str(model.model.layers[0]) and type(model).__name__.startswith("HunYuan")


@pytest.mark.parametrize("error", [ValueError("mask of shape [1, 4] for 8 heads"), IndexError("index 3 out of range"),
                                   AttributeError("no attribute 'num_heads'"), RuntimeError("shape '[3, 2]' is invalid")])
def test_any_exception_of_a_sharded_forward_is_one_line_naming_the_innermost_module(error, monkeypatch):
    """ProphetNet's ValueError escaped the run's check (which caught RuntimeError only) as a traceback."""
    from ds_inference_integration.policy.verify import verify_sharded_layers

    model = zoo_model("llama")

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(model.model.layers[1].mlp.down_proj, "forward", fail)
    with pytest.raises(InferenceSetupError) as caught:
        verify_sharded_layers(model, {}, "the derived policy", torch.float32)
    message = str(caught.value)
    assert f"fails in model.layers.1.mlp.down_proj: {type(error).__name__}: {error}" in message
    assert "\n" not in message


def test_a_sharded_layer_with_wrong_numbers_is_one_line_naming_it():
    """The run's own check (`verify_sharded_layers`): a layer whose sharded output is off its unsharded copy's beyond
    tolerance (shapes that fit, numbers that do not: DeepSpeed's automatic policy on Persimmon, make test-all's
    launched test) is one line naming the layer, its class and the difference against the tolerance."""
    import copy

    from ds_inference_integration.policy.verify import verify_sharded_layers

    model = zoo_model("llama")
    reference = copy.deepcopy(model.model.layers[1])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.2)  # as one rank's part scaled by a wrong split would
    with pytest.raises(InferenceSetupError) as caught:
        verify_sharded_layers(model, {"model.layers.1": reference}, "the derived policy", torch.float32)
    message = str(caught.value)
    assert message.startswith("the derived policy gives wrong results: layer model.layers.1 (LlamaDecoderLayer) "
                              "differs from the unsharded layer on a probe input, max |diff|"), message
    assert "\n" not in message


def test_an_unsharded_copy_that_fails_on_the_sharded_models_inputs_is_one_line_naming_the_layer(monkeypatch):
    """A layer's inputs made outside it by a part the policy split (CPM-Ant's position bias, one per head) reach the
    unsharded copy in the sharded shape: the copy raised, and the run printed a traceback."""
    import copy

    from ds_inference_integration.policy.verify import verify_sharded_layers

    model = zoo_model("llama")
    reference = copy.deepcopy(model.model.layers[0])

    def fail(*args, **kwargs):
        raise RuntimeError("The size of tensor a (2) must match the size of tensor b (4) at non-singleton dimension 1")

    monkeypatch.setattr(reference, "forward", fail)
    with pytest.raises(InferenceSetupError) as caught:
        verify_sharded_layers(model, {"model.layers.0": reference}, "the derived policy", torch.float32)
    message = str(caught.value)
    assert "layer model.layers.0 (LlamaDecoderLayer)" in message and "the unsharded layer fails on the inputs the " \
        "sharded model gives it (RuntimeError: The size of tensor a (2) must match" in message, message
    assert "\n" not in message


def test_a_rank_holding_what_should_be_split_is_warned_naming_the_modules():
    """The share against the target: split linears count 1/tp, routers and replicated modules whole."""
    from ds_inference_integration.shard.weight_share import full_sizes, measure

    model = zoo_model("mixtral")
    patterns = ["MixtralDecoderLayer"]
    before = full_sizes(model, patterns)
    for layer in model.model.layers:  # as a split at tp 2 would leave it, but the experts not placed
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(attention, name)
            linear.weight = nn.Parameter(linear.weight[: linear.weight.shape[0] // 2].clone())
        attention.o_proj.weight = nn.Parameter(attention.o_proj.weight[:, : attention.o_proj.weight.shape[1] // 2])
    share = measure(model, patterns, before, 2)
    assert share.over_target() and share.share > 0.9 > 0.51 > share.target > 0.5
    assert share.not_placed == ["MixtralDecoderLayer.mlp.experts"]
    assert share.by_design == {"MixtralDecoderLayer.mlp.gate": "kept whole by DeepSpeed AutoTP (a router or low-rank "
                                                                "projection)"}
    warning = share.warning(2)
    assert "held whole and not placed: MixtralDecoderLayer.mlp.experts" in warning and "\n" not in warning


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "llama4_text", "granitemoe", "dbrx"])
def test_each_packed_expert_layout_splits_into_partial_sums_that_add_up_to_the_whole(name, monkeypatch):
    """[experts, 2 x inner, hidden] (Mixtral), transposed and interleaved with per-expert biases (GPT-OSS, from
    transformers' `is_transposed` / `is_concatenated` record), transposed in halves (Llama 4), GraniteMoE's, and
    DBRX's 2-D [experts x inner, hidden] w1, v1 and w2 (found by the derivation: before, not recognised and held
    whole on every rank): two ranks' experts modules, each split by `split_experts`, sum to the unsharded module's
    output (what the all-reduce does; here without one). GPT-OSS and Llama 4 were refused before ("not [experts,
    2 x inner, hidden]")."""
    import copy

    from ds_inference_integration.shard import experts as experts_module
    from ds_inference_integration.shard.experts import split_experts

    monkeypatch.setattr(experts_module, "_all_reduce_output", lambda group: lambda m, a, out: None)  # no group
    model = zoo_model(name)
    policy = derive_policy(model)
    (layer_class, (path,)), = policy.experts.items()
    layer = next(m for m in model.modules() if type(m).__name__ == layer_class)
    experts = layer.get_submodule(path)
    block = layer.get_submodule(path.rpartition(".")[0])
    width = experts.hidden_size if name == "dbrx" else model.config.hidden_size  # DBRX's config: d_model
    x = torch.randn(1, 6, width, generator=torch.Generator().manual_seed(1))
    captured = {}
    def keep(module, args, kwargs, out):
        captured.setdefault("call", (args, kwargs))

    experts.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        block(x)  # the experts' own inputs (routing included), as the block gives them
    args, kwargs = captured["call"]
    with torch.no_grad():
        want = experts(*args, **kwargs)
        parts = []
        for rank in range(2):
            mine = copy.deepcopy(experts)
            mine._forward_hooks.clear()
            split_experts(mine, 2, rank, None)
            weights = [sum(p.numel() for n, p in m.named_parameters() if n != "down_proj_bias") for m in (mine, experts)]
            assert weights[0] * 2 == weights[1], weights  # (GPT-OSS's down bias kept whole: added once)
            parts.append(mine(*args, **kwargs))
    assert_close_up_to_rounding(parts[0] + parts[1], want, scale=parts)


def test_a_layout_still_unknown_is_refused_naming_the_tensors_and_the_layouts_known():
    from ds_inference_integration.shard.experts import split_experts

    odd = nn.Module()
    odd.gate_up_proj = nn.Parameter(torch.zeros(4, 96, 64))
    odd.down_proj = nn.Parameter(torch.zeros(4, 64, 40))
    with pytest.raises(InferenceSetupError, match=r"gate_up_proj \[4, 96, 64\] and down_proj \[4, 64, 40\] are in no "
                                                  r"known layout; known: \[experts, 2 x inner, hidden\]"):
        split_experts(odd, 2, 0, None)


def test_a_replicated_path_naming_a_linear_keeps_that_linear_whole():
    """HunYuan-MoE's router is `mlp.gate.wg`, a linear named by the path itself: before, only linears *below* a
    replicated path were kept whole, so DeepSpeed split the router by rows and the logits were 7.7 off at tp 2.
    A linear subclass with a forward of its own (Llama 4's router returns scores and logits) is set apart
    instead, to be hidden from DeepSpeed while it splits."""
    from ds_inference_integration.shard.attention import ColumnShard
    from ds_inference_integration.shard.inject import replicate_modules

    model = zoo_model("hunyuan_v1_moe")
    policy = derive_policy(model)
    assert policy.replicated == {"HunYuanMoEV1DecoderLayer": ("mlp.gate.wg",)}
    layers = list(model.model.layers)
    assert replicate_modules(layers, policy) == len(layers)
    assert all(isinstance(layer.mlp.gate.wg, ColumnShard) for layer in layers)

    model = zoo_model("llama4_text")
    policy = derive_policy(model)
    apart: list = []
    replicate_modules(list(model.model.layers), policy, apart)
    assert apart == [layer.feed_forward.router for layer in model.model.layers]
    assert type(apart[0]).__name__ == "Llama4Router"  # still itself, not a ColumnShard


def test_an_attention_that_reads_its_head_count_from_the_config_gets_a_table_of_this_ranks_counts():
    """Moonshine views its query by `self.config.num_key_value_heads`: with as many KV heads as query heads
    DeepSpeed's split is right, but it updates only the module's own attributes, so the view failed ("shape
    '[3, 9, 4, 16]' is invalid for input of size 864" at tp 2). The table sets this rank's count on a copy of
    the attention's config."""
    spec = derive_policy(zoo_model("moonshine")).attention
    assert spec.query == "self_attn.q_proj" and ("config.num_key_value_heads", "q_heads") in spec.local
    assert spec.also == ("encoder_attn",)


def test_a_cross_attention_with_the_same_heads_is_split_by_the_same_table_written_and_read_back(tmp_path):
    """T5Gemma's self and cross attention both have fewer KV heads than query heads: "more than one attention
    to split here" refused the model. One table with `also` covers both; written out and read back it is the
    same, and a table without `also` keeps the identity it had before the key existed."""
    import dataclasses

    from ds_inference_integration.policy.schema import load_policy, policy_identity, policy_to_toml

    policy = derive_policy(zoo_model("t5gemma"))
    assert policy.attention.also == ("cross_attn",) and not policy.replicated
    assert [v.key for v in policy.attention.variants()] == ["self_attn.k_proj", "cross_attn.k_proj"]
    path = tmp_path / "t5gemma.toml"
    path.write_text(policy_to_toml(policy))
    assert load_policy(path).attention == policy.attention
    plain = dataclasses.replace(policy, attention=dataclasses.replace(policy.attention, also=()))
    assert policy_identity(plain) != policy_identity(policy)
    # the shipped llama.toml's identity as the code before `also` computed it (ec1ca83): pre-sharded
    # directories written then still match
    from ds_inference_integration.policy.schema import POLICY_DIR

    assert policy_identity(load_policy(POLICY_DIR / "llama.toml")) == "930d13df0ce29ce8"


def test_deepspeed_sees_the_head_counts_of_a_config_that_keeps_them_in_its_encoder_and_decoder():
    """T5Gemma's top config holds no head count (its encoder and decoder configs do): DeepSpeed found none and
    split each projection in 64-row blocks, all 32 rows of a 2-KV-head k_proj on rank 0 at tp 2. They are lent
    to the top config while DeepSpeed splits, and taken back after."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    from ds_inference_integration.deepspeed_compat import kv_heads_seen_by_deepspeed

    config = ZOO["t5gemma"]()
    assert AutoTPMeta.from_model_config(config).num_kv_heads is None
    with kv_heads_seen_by_deepspeed(config, None):
        meta = AutoTPMeta.from_model_config(config)
        assert (meta.num_kv_heads, meta.num_attention_heads) == (2, 4)
    assert AutoTPMeta.from_model_config(config).num_kv_heads is None and "num_key_value_heads" not in vars(config)


def test_a_split_lm_head_reads_inputs_of_any_rank_as_deepspeed_reads_3d_ones():
    """DeepSpeed's LmHeadLinearAllreduce cuts its input as `input[:, :, a:b]`: ProphetNet's [batch, ngram, sequence,
    hidden] input was cut along the sequence, the ranks' partial logits differed in shape, and the all-reduce waited
    until gloo's 120 s timeout. The wrapper gives it a 3-D view; a 3-D input goes through as it was."""
    from ds_inference_integration.deepspeed_compat import _any_rank

    weight = torch.randn(10, 8)

    def deepspeed_forward(input):  # module_inject/layers.py LmHeadLinearAllreduce.forward, this rank's 3 features
        return torch.matmul(input[:, :, 2:5], weight[:, 2:5].transpose(-1, -2))

    x = torch.randn(2, 3, 4, 8)
    want = x[..., 2:5] @ weight[:, 2:5].T
    with pytest.raises(RuntimeError):  # what it did: the sequence cut, not the features
        deepspeed_forward(x)
    assert_close_up_to_rounding(_any_rank(deepspeed_forward)(x), want)  # the same products, maybe other blocking
    assert torch.equal(_any_rank(deepspeed_forward)(x[0]), deepspeed_forward(x[0]))  # the same call


def test_a_per_head_output_gate_keeps_the_query_heads_where_the_table_splits_them():
    """AFMoE's attention gates its output per head (`gate_proj`, the query's width). With fewer KV heads than ranks
    the table splits q/k/v here; DeepSpeed cut the gate in 64-row blocks (ranks 0 and 1 held 64 rows, 2 and 3 none,
    against 32 query rows each at tp 4: "The size of tensor a (32) must match the size of tensor b (64)"). It keeps
    this rank's heads now; the output projection (the query's width in, as the gate's out when they are square) is
    left to DeepSpeed's row split."""
    from ds_inference_integration.shard.attention import ColumnShard, HeadLayout
    from ds_inference_integration.shard.inject import split_attention

    model = zoo_model("afmoe")
    policy = derive_policy(model)
    layer = model.model.layers[0]
    rows = policy.layers["AfmoeDecoderLayer"]
    gate = layer.self_attn.gate_proj.weight.detach().clone()
    assert split_attention(layer, policy.attention, HeadLayout(4, 2, 4, 1), rows) is not None
    assert isinstance(layer.self_attn.gate_proj, ColumnShard)
    assert layer.self_attn.gate_proj.weight.tensor_slices.ranges == ((32, 64),)  # recorded for shard-aware loading
    assert torch.equal(layer.self_attn.gate_proj.weight, gate[32:64])  # a copy of those rows
    assert isinstance(layer.self_attn.o_proj, nn.Linear)


@pytest.mark.parametrize("widths, tp, grain", [
    ((128, 256, 96), 4, 8),  # the zoo's: a 128-wide shared expert, vocabulary 96
    ((4096, 11008, 32000), 2, 64),  # Llama-2-7B's widths: DeepSpeed's own blocks are already even
    ((2048, 1408, 151936), 4, 32),  # a 1408-wide expert (DeepSeek-V2-Lite's): 384/384/320/320 in 64-row blocks
    ((2880, 151936), 4, 16),  # GPT-OSS's 2880: 768/704/704/704 in 64-row blocks
    ((100, 384), 3, 64),  # 100 is split unevenly by any grain: only 384 counts
])
def test_the_grain_deepspeed_splits_mlps_by_gives_every_rank_the_same_rows(widths, tp, grain):
    """`tp_grain_size` for DeepSpeed (`deepspeed_compat.even_grain`): the largest block, 64 at most, that splits
    every width of the model's linears that tp divides into equal shares (DeepSpeed's 64-row blocks gave a 128-wide
    shared expert 64/64/0/0 at tp 4)."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    from ds_inference_integration.deepspeed_compat import even_grain

    model = nn.Sequential(*(nn.Linear(widths[0], w, device="meta") for w in widths))  # the first: the hidden size
    assert even_grain(model, tp) == grain
    meta = AutoTPMeta(tp_grain_size=grain)
    for w in widths:
        sizes = get_shard_size_list(w, tp, meta, "mlp.down_proj")
        assert sizes == [w // tp] * tp if w % tp == 0 else max(sizes) - min(sizes) <= grain + w % grain, (w, sizes)
    assert get_shard_size_list(128, 4, AutoTPMeta(tp_grain_size=64), "mlp.down_proj") == [64, 64, 0, 0]


def test_a_block_tied_into_several_layers_is_split_once_and_shared_after():
    """While DeepSpeed splits, a block whose weights are tied into several layers (Zamba's `shared_transf`) is in its
    first place only, and afterwards every place holds that (split) block: DeepSpeed split the tied weights again in
    each layer (a [256, 256] q_proj left [64, 256] at tp 2). A module of another class holding the same weight (an
    lm_head module tied to the embedding, T5Gemma's) is not such a place, nor is a lone linear."""
    from ds_inference_integration.deepspeed_compat import shared_modules_split_once

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(4, 4)

    class Head(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.out_proj = nn.Linear(4, 4, bias=False)
            self.out_proj.weight = weight

    first, tied = Block(), Block()
    tied.q_proj.weight, tied.q_proj.bias = first.q_proj.weight, first.q_proj.bias  # as transformers ties them
    layers = nn.ModuleList([nn.ModuleDict({"shared": first}), nn.ModuleDict({"shared": tied}), nn.ModuleDict()])
    model = nn.ModuleDict({"layers": layers, "embed": nn.Embedding(4, 4)})
    model["head"] = Head(model["embed"].weight)
    with shared_modules_split_once(model):
        assert isinstance(model["layers"][1], nn.Identity) and model["layers"][0]["shared"] is first
        assert isinstance(model["head"], Head) and model["head"].out_proj.weight is model["embed"].weight
        first.q_proj = nn.Linear(4, 2)  # what DeepSpeed's split puts there
    assert model["layers"][1]["shared"] is tied and tied.q_proj is first.q_proj  # its own block, the split linear


def test_an_attention_inside_a_module_beside_the_norms_is_split_by_its_table():
    """DBRX's layer holds its attention in `norm_attn_norm` beside two norms. Judged as one module, its fused `Wqkv`
    (256 outputs) was taken for an MLP's first linear feeding no row-parallel linear, the module was kept whole, and
    with its `out_proj` inside, nothing of the layer was split (100% per rank, 2026-12-06). Now the module is judged
    by its children: the attention gets the fused table, the experts are split, the router alone kept whole."""
    policy = derive_policy(zoo_model("dbrx"))
    assert policy.attention.fused_qkv == "norm_attn_norm.attn.Wqkv" and policy.attention.layout == "qkv"
    assert policy.layers == {"DbrxBlock": ("attn.out_proj",)}
    assert policy.replicated == {"DbrxBlock": ("ffn.router.layer",)}
    assert policy.experts == {"DbrxBlock": ("ffn.experts",)}


def test_an_attention_whose_key_is_its_value_is_split_by_each_layers_own_heads():
    """Gemma 4 with `attention_k_eq_v`: the full-attention layers have no `v_proj` (None: the key's states are the
    values) and 2 KV heads of their own where the config says 4. Not seen as an attention, it was kept whole in every
    layer of the class (72% per rank at tp 2); left to DeepSpeed's split by the config's count, each rank held half
    a head at tp 4. Now the table names it and splits each layer by its own count, with copies at tp 4."""
    from ds_inference_integration.shard.attention import HeadLayout
    from ds_inference_integration.shard.inject import split_attention

    model = zoo_model("gemma4_text_kv")
    policy = derive_policy(model)
    assert policy.attention is not None and policy.attention.key == "self_attn.k_proj"
    assert not [p for p in policy.replicated["Gemma4TextDecoderLayer"] if "self_attn" in p], policy.replicated
    full = model.model.layers[1]
    assert full.self_attn.v_proj is None and full.self_attn.k_proj.weight.shape[0] == 2 * 64
    attention, head_dim, heads = split_attention(full, policy.attention, HeadLayout(4, 4, 4, 3))
    assert (head_dim, heads.kv_heads, heads.own) == (64, 2, True)
    assert attention.k_proj.weight.shape[0] == 64 and attention.q_proj.weight.shape[0] == 64  # one head each
    assert attention.v_proj is None


def test_an_mlp_across_two_modules_of_the_layer_is_split_not_kept_whole():
    """BERT's layer computes its MLP in `intermediate.dense` and gathers it in `output.dense`, another module. Judged
    alone, `intermediate` had no row-parallel linear and was kept whole while `output.dense` was split: "mat1 and
    mat2 shapes cannot be multiplied (30x256 and 128x128)" at tp 2, in 13 model types of the BERT family
    (`policy sweep`, 2026-12-06)."""
    policy = derive_policy(zoo_model("bert"))
    assert policy.layers == {"BertLayer": ("output.dense",)} and not policy.replicated, policy


def test_the_checkers_inputs_read_the_vocabulary_of_a_composite_config():
    """Gemma 3's, Voxtral's and Fuyu's configs keep `vocab_size` in their text config: the checker's inputs raised
    AttributeError, which ended the launch for every model after it."""
    import transformers as tr

    from ds_inference_integration.tools.policy_check import _inputs

    config = tr.Gemma3Config(text_config={"vocab_size": 96})
    assert not hasattr(config, "vocab_size") or config.vocab_size is None
    ids = _inputs(config, torch)["input_ids"]
    assert ids.shape == (3, 10) and int(ids.max()) < 96


@pytest.mark.parametrize("name, layer, whole, why", [
    # DiffLlama pairs one half of its value heads with the other (`torch.chunk(value_states, 2, dim=1)`): split by
    # heads, its logits were 9.8 off at tp 2
    ("diffllama", "DiffLlamaDecoderLayer", "self_attn", None),
    # BitNet normalises its MLP's inner width (`ffn_sub_norm`): "(256) must match ... (128)" in mlp.ffn_sub_norm
    ("bitnet", "BitNetDecoderLayer", "mlp", "ffn_sub_norm normalises the 256 features"),
    # XLNet's relative attention holds bare [d_model, heads, d_head] parameters: held whole and not placed (FAIL)
    ("xlnet", "XLNetLayer", "rel_attn", "bare parameters"),
    # dots3's indexer reads the layer's input through `wk` (128 -> 128 at hidden 128), which AutoTP names
    # row-parallel: taken for the linear gathering the indexer, the indexer was split ("30x128 and 64x128")
    ("dots3_note_text", "Dots3NoteTextDecoderLayer", "self_attn.indexer", "no row-parallel linear gathers"),
    # TrOCR reshapes its heads' output to `embed_dim` read from its input: "shape '[3, 10, 128]' is invalid"
    ("trocr", "TrOCRDecoderLayer", "self_attn", "reshapes its output to its input's width"),
])
def test_what_no_rank_can_compute_from_its_own_part_is_kept_whole_and_said(name, layer, whole, why, caplog):
    """Found by `policy sweep` (2026-12-06), each failing its sharded forward or its numbers before."""
    with caplog.at_level(logging.WARNING):
        policy = derive_policy(zoo_model(name))
    assert whole in policy.replicated[layer], policy.replicated
    assert whole in caplog.text and (why is None or why in caplog.text), caplog.text


@pytest.mark.parametrize("name", ["gpt2", "openai-gpt"])
def test_conv1d_layers_are_derived_as_the_linears_they_become(name):
    """GPT-1 (and GPT-2 without its shipped file): Conv1D's weight is [in, out]. Read as a linear's, GPT-1's
    `mlp.c_fc` was taken for the MLP's row-parallel end and DeepSpeed's parser saw no linear ("not enough values to
    unpack" in attn at tp 2)."""
    policy = derive_policy(zoo_model(name))
    assert policy.layers == {type(zoo_model(name).transformer.h[0]).__name__: ("attn.c_proj", "mlp.c_proj")}
    assert policy.attention.fused_qkv == "attn.c_attn"


def test_per_head_sinks_of_an_attention_deepspeed_would_split_alone_are_split_by_the_table():
    """GraniteMoE-SWA: as many KV heads as query heads, which DeepSpeed splits by itself, and per-head `sinks`, which
    only the table's split cuts to this rank's heads: left whole, "(2) must match ... (4)" at tp 2."""
    policy = derive_policy(zoo_model("granitemoe_swa"))
    assert policy.attention is not None and policy.attention.key == "self_attn.k_proj"


@pytest.mark.parametrize("name, layer, whole, why", [
    ("doge", "DogeDecoderLayer", "self_attn", "self_attn.dt_proj writes one value per head"),
    ("cpmant", "CpmAntTransformerBlock", "self_att.self_attention",
     "position_bias.relative_attention_bias holds one column per head outside the layers"),
    ("big_bird", "BigBirdLayer", "attention", "builds its attention again from the config while it runs"),
    # a latent attention (`q_a_proj`, DeepSpeed's to split) with no row-parallel output: DeepSeek-V4's grouped
    # o_a_proj and o_b_proj (before: left to DeepSpeed, its split kv_proj failed kv_norm, "(32) must match (16)")
    ("deepseek_v4", "DeepseekV4DecoderLayer", "self_attn", "self_attn (q_a_norm normalises"),
    # a relative-position attention's per-head bias rows ([heads, head_dim]) beside a view by the config's head count
    # (Canary's Parakeet encoder; before: "shape '[1, 2, 1, 32]' is invalid for input of size 128" at tp 2)
    ("canary", "ParakeetEncoderBlock", "self_attn", "self_attn.bias_u holds one row per head"),
    # a parameter of the attention scaling each feature of its query's width (Dory's `sqk` and `s_gate`), which no
    # split cuts with the heads (before: "(2) must match ... (4)" at tp 2); its MLP likewise (`suv_gate`), below
    ("dory", "DoryDecoderLayer", "self_attn", "self_attn.sqk scales each of the 128 features")])
def test_an_attention_whose_heads_need_every_heads_values_is_kept_whole_and_said(name, layer, whole, why, caplog):
    """Doge: `dt_proj` (every value head's features -> one value per head) is row-parallel in its tp plan, so each
    rank got all heads' values beside its own heads' scores; CPM-Ant: the position bias of all heads, made once
    outside the layers, reached attentions holding some. Both failed the sharded forward ("(2) must match ... (4)",
    `policy sweep`, 2026-12-06); each attention is kept whole, with the reason in a warning."""
    import logging

    from ds_inference_integration.policy.derive import derive_policy

    with caplog.at_level(logging.WARNING):
        policy = derive_policy(zoo_model(name))
    assert whole in dict(policy.replicated)[layer], policy.replicated
    assert not any(r.startswith(whole + ".") for r in dict(policy.layers)[layer]), policy.layers
    assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_linear_outside_the_layers_reading_as_many_inputs_as_there_are_heads_keeps_no_attention_whole(caplog):
    """A per-head table outside the layers keeps the attention whole (CPM-Ant, above); a linear whose inputs happen
    to number the heads is not one (VibeVoice-ASR's audio tokenizer reads 4 channels beside 4 heads at the sweep's
    size: its Qwen2 decoder's attention was kept whole on every rank, said as "one column per head")."""
    import logging

    from ds_inference_integration.policy.derive import derive_policy

    model = zoo_model("llama")  # 4 heads
    model.model.audio_stem = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.Linear(4, 16))
    with caplog.at_level(logging.WARNING):
        policy = derive_policy(model)
    assert not policy.replicated and policy.attention is not None, policy.replicated
    assert not any("one column per head" in r.getMessage() for r in caplog.records)


def test_an_mlp_reading_its_packed_first_linear_as_a_two_row_view_is_split_as_gate_and_up():
    """Moshi's and Kyutai's gating MLPs read `fc1`'s output as `.view(batch, length, 2, -1)`: [gate | up] halves,
    as Moonshine's `.chunk(2, dim=-1)`. Not recognised, each MLP was kept whole on every rank ("no row-parallel
    linear gathers what fc1, fc2 compute"; Kyutai 65% per rank at tp 2, 59% now)."""
    from ds_inference_integration.policy.kinds import packed_mlp_names, ssm_layout

    for name in ("kyutai_speech_to_text", "moshi"):
        model = zoo_model(name)
        mlps = [m for n, m in model.named_modules() if type(m).__name__.endswith("GatingMLP")]
        assert mlps and all(packed_mlp_names(m) == ("fc1", "fc2") and ssm_layout(m) == "packed_mlp" for m in mlps)


def test_linears_inside_modules_of_the_models_own_are_split_as_linears_all_or_none():
    """Moshi's and Kyutai's attention projections are nn.Linears inside modules of their own (`q_proj.linear`).
    Judged as modules nested in the attention, each was kept whole on every rank (Moshi 100% per rank at tp 2,
    Kyutai 59%); they are split as the linears they hold. Where the key projection writes fewer heads than the query
    (grouped-query attention, which no table describes through the wrappers), all are kept whole, said: the key
    kept whole beside a split query gave wrong logits."""
    from ds_inference_integration.policy.derive import derive_policy
    from ds_inference_integration.tools.architecture_zoo import _swept

    for name, layer in (("moshi", "MoshiDecoderLayer"), ("kyutai_speech_to_text", "KyutaiSpeechToTextDecoderLayer")):
        policy = derive_policy(zoo_model(name))
        assert "o_proj.linear" in dict(policy.layers)[layer], policy.layers
        assert not any("proj" in p for p in dict(policy.replicated).get(layer, ())), policy.replicated
    config = _swept("kyutai_speech_to_text", num_key_value_heads=2)
    torch.manual_seed(0)
    gqa = derive_policy(model_class_for(config).from_config(config).eval())
    whole = dict(gqa.replicated)["KyutaiSpeechToTextDecoderLayer"]
    assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"} <= set(whole), whole


def test_experts_packed_without_a_gate_are_split_by_their_inner_rows():
    """NemotronH's MoE (Nemotron 3; Nemotron-3.5-Transcribe's decoder) packs its experts as `up_proj` [experts,
    inner, hidden] and `down_proj` [experts, hidden, inner], no gate: not recognised, they were held whole on every
    rank as bare parameters. Derived as experts, each rank keeps 1/tp of every expert's inner rows; the split's
    partial output, all-reduced, is the whole module's (checked here by summing the ranks' parts)."""
    import copy

    from ds_inference_integration.policy.derive import derive_policy
    from ds_inference_integration.policy.kinds import is_ungated_experts
    from ds_inference_integration.shard import experts as split

    model = zoo_model("nemotron_h_moe")
    policy = derive_policy(model)
    assert dict(policy.experts)["NemotronHBlock"] == ("mixer.experts",), policy.experts
    assert not any("experts" in p for p in dict(policy.replicated).get("NemotronHBlock", ())), policy.replicated
    module = next(m for n, m in model.named_modules() if n.endswith("mixer.experts"))
    assert is_ungated_experts(module)
    x, index = torch.randn(5, 128), torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        whole = module(x, index, weights)
        parts = []
        for rank in range(2):
            mine = copy.deepcopy(module)
            split.split_experts(mine, 2, rank, None)  # tp 2; the all-reduce (a forward hook) is the sum below
            assert len(mine._forward_hooks) == 1
            mine._forward_hooks.clear()
            parts.append(mine(x, index, weights))
            assert mine.up_proj.shape == (4, 64, 128) and mine.down_proj.shape == (4, 128, 64)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_a_module_whose_output_joins_a_split_linears_keeps_its_module_whole():
    """Zamba2's shared MLP adds low-rank adapters' outputs (hidden -> rank -> 2 x inner) to its `gate_up_proj`'s: the
    adapters, kept whole beside the split `gate_up_proj`, failed the sharded forward ("(256) must match ... (512)" at
    tp 2). No rank can add its part of the linear to the adapters' whole output: the MLP is kept whole, said."""
    from ds_inference_integration.policy.derive import derive_policy

    policy = derive_policy(zoo_model("zamba2"))
    whole = dict(policy.replicated)["Zamba2HybridLayer"]
    assert "shared_transformer.feed_forward" in whole, whole
    assert not any(p.startswith("shared_transformer.feed_forward.") for p in whole), whole
    assert "shared_transformer.self_attn.o_proj" in dict(policy.layers)["Zamba2HybridLayer"] or \
        "self_attn.o_proj" in dict(policy.layers)["Zamba2HybridLayer"], policy.layers


def test_the_sweeps_small_config_maps_lists_of_layer_indices_to_its_layers():
    """Zamba2's `hybrid_layer_ids` ([6, 12, ...] of 54 layers) stayed the default's while its layer types were cut
    to two: its adapters were looked up for layer 1 in a map of layers 6 to 51, "KeyError: 1" in the unsharded
    model (`policy sweep`: "unsharded model fails")."""
    from transformers import AutoConfig

    from ds_inference_integration.tools.small_config import shrink

    config = shrink(AutoConfig.for_model("zamba2"))
    assert config.hybrid_layer_ids == [i for i, t in enumerate(config.layers_block_type) if t == "hybrid"] != []


def test_an_input_embedding_inside_a_module_of_the_models_own_is_found_for_the_head():
    """Kyutai's input embedding is a module of its own around one table (text and codec codes, summed): reading its
    `weight` raised AttributeError on every rank while DeepSpeed was to shard. The table is the embedding; the head,
    untied and of another shape, gets a placeholder of its own shape (as Moshi's)."""
    from ds_inference_integration.deepspeed_compat import lm_head_tied_as_the_model_ties

    model = zoo_model("kyutai_speech_to_text")
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.empty(head.weight.shape, device="meta"), requires_grad=False)
    with lm_head_tied_as_the_model_ties(model):
        assert not head.weight.is_meta and tuple(head.weight.shape) == (96, 128)


def test_an_mlp_scaling_its_split_features_by_a_parameter_of_its_own_is_kept_whole():
    """Dory's MLP multiplies `gate_proj`'s output by `suv_gate` ([inner]): DeepSpeed split the linear and left the
    parameter whole, "(128) must match ... (256)" at tp 2. Kept whole, the reason said."""
    from ds_inference_integration.policy.derive import derive_policy, derive_whole_modules

    model = zoo_model("dory")
    policy = derive_policy(model)
    assert "mlp" in dict(policy.replicated)["DoryDecoderLayer"], policy.replicated
    whole, _ = derive_whole_modules(model, {"DoryDecoderLayer": ("mlp.down_proj", "self_attn.o_proj")}, {})
    assert whole["DoryDecoderLayer"]["mlp"].startswith("suv_gate scales each of the 256 features"), whole


def test_per_head_parameters_of_an_attention_deepspeed_split_alone_are_split_with_its_heads():
    """HY-V4's latent attention is DeepSpeed's to split (no table names it), which sets its `num_heads` to this
    rank's and leaves `sinks` (one value per query head) whole: "Expected size 2 but got size 4" at tp 2. Each rank
    now holds its heads' run of it, recorded for shard-aware loading; a module whose head count is not this rank's
    is left as it is."""
    from ds_inference_integration.policy.schema import Policy
    from ds_inference_integration.shard.inject import _split_per_head_parameters_deepspeed_left
    from ds_inference_integration.topology import Topology

    model = zoo_model("llama")  # 4 heads
    attention, whole = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    for a, heads in ((attention, 2), (whole, 4)):
        a.num_heads = heads
        a.sinks = torch.nn.Parameter(torch.arange(4.0))
    policy = Policy(source=Path("<derived>"), description="", model_types=("llama",), head_count_attributes=(),
                    layers={"LlamaDecoderLayer": ("mlp.down_proj",)})
    _split_per_head_parameters_deepspeed_left(model, policy, set(), Topology(world_size=2, rank=1, tp_size=2))
    assert attention.sinks.tolist() == [2.0, 3.0] and attention.sinks.tensor_slices.ranges == ((2, 4),)
    assert whole.sinks.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_row_name_that_also_names_a_linear_inside_a_module_kept_whole_is_deepspeeds_only_outside_it():
    """BERT-like layers name the MLP's and the attention's output `output.dense` alike; with the attention kept whole
    (BigBird's), the row was refused as naming a ColumnShard (after the split) or a linear the policy did not make
    row-parallel (before it)."""
    from ds_inference_integration.policy.schema import Policy, build_injection_policy
    from ds_inference_integration.shard.attention import whole

    model = zoo_model("bert")
    policy = Policy(source=Path("<derived>"), description="", model_types=("bert",), head_count_attributes=(),
                    layers={"BertLayer": ("output.dense",)}, replicated={"BertLayer": ("attention",)})
    (keys,) = build_injection_policy(policy, model).values()
    for layer in model.bert.encoder.layer:  # as the split leaves what it keeps whole (`inject.replicate_modules`)
        layer.attention.output.dense = whole(layer.attention.output.dense)
    assert keys == ("output.dense",) and tuple(*build_injection_policy(policy, model).values()) == keys, keys


def test_an_embedding_inside_a_module_kept_whole_is_hidden_from_deepspeeds_split():
    """Granite Speech's conformer attention, kept whole, holds a relative-position table (`rel_pos_emb`, an
    nn.Embedding), which DeepSpeed sliced by its columns as it slices any embedding in a layer: half of it per rank
    at tp 2 (its weight share 64.6% against a target of 69.8%)."""
    from ds_inference_integration.shard.inject import replicate_modules

    model = zoo_model("granite_speech")
    policy = derive_policy(model)
    layers = list(model.model.encoder.layers)
    apart: list = []
    replicate_modules(layers, policy, apart)
    assert [m for m in apart if isinstance(m, nn.Embedding)] == [layer.attn.rel_pos_emb for layer in layers]


def test_a_head_on_meta_the_model_does_not_tie_is_untied_again_after_deepspeeds_set_lm_head():
    """DeepSpeed's `set_lm_head` ties an output head whose weight is on meta (pre-sharded loading) to the input
    embedding; a head it then leaves unsplit (Ergo's, a linear class of its own) stayed tied, and the pre-sharded
    model's logits were the embedding's. After the split it has a meta weight again, for the loader to read."""
    from ds_inference_integration.deepspeed_compat import lm_head_tied_as_the_model_ties

    model = zoo_model("llama")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    embedding = model.get_input_embeddings().weight
    with lm_head_tied_as_the_model_ties(model):
        model.lm_head.weight = embedding  # as set_lm_head does with a head on meta
    assert model.lm_head.weight is not embedding and model.lm_head.weight.is_meta
    assert model.lm_head.weight.shape == embedding.shape


def test_a_head_on_meta_of_another_shape_than_the_input_embedding_is_never_tied_to_it():
    """Moshi's untied head is [96, 128], its input embedding [97, 128]: DeepSpeed's `set_lm_head` tied the head on
    meta to the embedding and split that, [97, 64] at tp 2, which the shard-aware loader could not fill from the
    checkpoint's head ("cannot tell which part of lm_head.weight ... this rank holds"). While DeepSpeed shards the
    head holds a placeholder of its own shape, not on meta (what `set_lm_head` ties), and no other parameter of the
    model is on meta first (DeepSpeed's engine reads the model's `device` from it)."""
    from ds_inference_integration.deepspeed_compat import lm_head_tied_as_the_model_ties

    model = zoo_model("llama")
    model.config.tie_word_embeddings = False
    vocab, hidden = model.get_input_embeddings().weight.shape
    with torch.device("meta"):
        model.lm_head = nn.Linear(hidden, vocab - 1, bias=False)
    embedding = model.get_input_embeddings()
    with lm_head_tied_as_the_model_ties(model):
        head = model.lm_head.weight
        assert not head.is_meta and tuple(head.shape) == (vocab - 1, hidden)
        assert model.device.type != "meta"
    assert model.get_input_embeddings() is embedding and model.lm_head.weight is not embedding.weight


def test_an_mlp_across_two_modules_of_a_module_is_split_not_kept_whole():
    """Reformer's `feed_forward` holds `dense.dense` (128 -> 256) and `output.dense` (256 -> 128, row-parallel): the
    first, judged alone, was kept whole while the second was split, "mat1 and mat2 shapes cannot be multiplied
    (30x256 and 128x128)" at tp 2 (`policy sweep`, 2026-12-07)."""
    policy = derive_policy(zoo_model("reformer"))
    whole = policy.replicated.get("ReformerLayer", ())
    assert not any(p.startswith("feed_forward") for p in whole), whole
    assert policy.layers["ReformerLayer"] == ("output.dense",)


def test_an_mlp_of_its_own_inside_the_module_that_ends_the_layers_mlp_is_kept_whole_alone():
    """X-MOD's `output` holds the MLP's row-parallel `dense` and, after it, a language adapter (128 -> 64 -> 128) on
    the all-reduced output: the adapter's 64 outputs, judged against `dense`'s 256 inputs, kept the whole `output`
    whole; the row name `output.dense` then named nothing outside it but `attention.output.dense`, dropped too, and
    the sharded forward failed ("mat1 and mat2 shapes cannot be multiplied (30x64 and 128x128)", 2026-12-07)."""
    policy = derive_policy(zoo_model("xmod"))
    assert policy.replicated["XmodLayer"] == ("output.adapter_modules",), policy.replicated
    assert policy.layers["XmodLayer"] == ("output.dense",), policy.layers


def test_bare_parameter_experts_beside_a_split_shared_expert_are_kept_whole_alone():
    """Ergo's MoE holds its routed experts as bare parameters (`ErgoExperts`, not linears, not a packed layout this
    project splits), its router and a shared expert of linears: the router's 4 outputs, judged against the shared
    expert's row-parallel input, kept the whole MoE whole (67% of a layer per rank at tp 2). The shared expert is
    split; the experts and the router alone are whole, and counted so (51%)."""
    policy = derive_policy(zoo_model("ergo"))
    assert policy.replicated["ErgoDecoderLayer"] == ("mlp.experts", "mlp.gate"), policy.replicated
    assert "shared_experts.down_proj" in policy.layers["ErgoDecoderLayer"], policy.layers


def test_a_decoder_named_by_the_seq2seq_mapping_only_is_built_by_it():
    """Qwen2-Audio, GLM-ASR, AudioFlamingo 3: decoders behind an audio encoder (not encoder-decoders) that only
    transformers' seq2seq mapping names; AutoModelForCausalLM refused their configs ("Unrecognized configuration
    class"). MusicGen's encoder-decoder config, named by the causal mapping only, goes to that one."""
    import transformers as tr
    from transformers import AutoConfig

    for model_type in ("qwen2_audio", "glmasr", "audioflamingo3"):
        assert model_class_for(AutoConfig.for_model(model_type)) is tr.AutoModelForSeq2SeqLM, model_type
    assert model_class_for(AutoConfig.for_model("musicgen")) is tr.AutoModelForCausalLM
    # a checkpoint of Mllama's or Emu3's image-and-text class (their causal-LM class is the text model alone, whose
    # config the Auto classes do not load back: "refused" before) is built by that class
    mllama = AutoConfig.for_model("mllama", architectures=["MllamaForConditionalGeneration"])
    assert model_class_for(mllama) is tr.AutoModelForImageTextToText
    gemma3 = AutoConfig.for_model("gemma3", architectures=["Gemma3ForConditionalGeneration"])
    assert model_class_for(gemma3) is tr.AutoModelForCausalLM  # named by the causal mapping too: that one, as before
    assert model_class_for(AutoConfig.for_model("llama")) is tr.AutoModelForCausalLM
    assert model_class_for(AutoConfig.for_model("t5")) is tr.AutoModelForSeq2SeqLM


def test_a_config_with_two_text_configs_is_read_by_its_decoders():
    """MusicGen's config holds `text_encoder` and `decoder`: transformers' `get_text_config()` raises ("would be
    ambiguous"), which stopped the policy's derivation and the checker; the decoder's is the one that generates."""
    from transformers import AutoConfig

    from ds_inference_integration.policy.configs import text_config
    from ds_inference_integration.policy.schema import config_value

    config = AutoConfig.for_model("musicgen")
    assert text_config(config) is config.decoder
    assert config_value(config, "num_attention_heads") == config.decoder.num_attention_heads


@pytest.mark.parametrize("model_type, shape", [("canary", (2, 64, 128)), ("cohere_asr", (2, 64, 128)),
                                               ("seamless_m4t_v2", (2, 64, 160))])
def test_speech_models_reading_frames_of_mel_bins_get_a_probe_input(model_type, shape):
    """Canary's and Cohere ASR's Parakeet encoder (`encoder_config.num_mel_bins`, [batch, frames, bins]) and
    SeamlessM4T v2's stacked features (`feature_projection_input_dim`): refused before, "no probe input is known"."""
    from transformers import AutoConfig

    from ds_inference_integration.policy.verify import random_speech_inputs
    from ds_inference_integration.tools.small_config import shrink

    inputs = random_speech_inputs(shrink(AutoConfig.for_model(model_type)), "input_features", 2, torch.Generator())
    assert tuple(inputs["input_features"].shape) == shape


def test_an_embedding_in_a_layer_whose_columns_are_not_its_heads_is_kept_whole():
    """DeepSpeed slices every embedding in a layer by its columns: T5's relative-attention bias ([buckets, heads]) is
    split with the heads; SeamlessM4T v2's `distance_embedding` ([positions, head size]) was cut in half and its
    attention's einsum failed at tp 2. The latter is kept whole (hidden from DeepSpeed), the former left to it."""
    from ds_inference_integration.shard.inject import _embeddings_not_per_head

    model = zoo_model("t5")
    layers = [b for stack in (model.encoder.block, model.decoder.block) for b in stack]
    assert _embeddings_not_per_head(layers, model.config) == []
    extra = nn.Embedding(9, model.config.d_kv)
    layers[0].layer[0].SelfAttention.distance_embedding = extra
    assert _embeddings_not_per_head(layers, model.config) == [extra]


def test_a_model_with_nothing_to_split_is_refused_naming_its_layers_and_what_they_hold():
    """A JetMoE whose MLP experts are in no layout known here (its `output_linear` made 2-D): its attention's and
    MLP's experts are parameters of a module of its own (`JetMoeParallelExperts`), its only linears routers and a
    shared key/value projection. The refusal said only "no row-parallel linear found": it names the layer class
    and what it holds. (JetMoE as published splits its MLP's experts: the next test.)"""
    from transformers import AutoConfig

    from ds_inference_integration.tools.small_config import shrink

    config = shrink(AutoConfig.for_model("jetmoe"))
    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
        for layer in model.model.layers:
            layer.mlp.output_linear.weight = torch.nn.Parameter(torch.empty(4 * 128, 128))
    with pytest.raises(InferenceSetupError) as caught:
        derive_policy(model)
    line = str(caught.value)
    assert "\n" not in line and "JetMoeDecoderLayer: linears mlp.router.layer" in line, line
    assert "weights in JetMoeParallelExperts (not linears" in line and "policy suggest" in line, line


def test_experts_held_by_two_modules_of_their_own_are_split_and_the_attention_of_experts_kept_whole():
    """JetMoE's MLP holds its experts in two modules, `input_linear` [experts, 2 x inner, hidden] (gate and up,
    chunked) and `output_linear` [experts, hidden, inner], plus a bias added after them: refused before (nothing a
    rule splits). Each rank keeps 1/tp of every expert's inner rows, the bias on the first rank only; the ranks'
    outputs sum to the whole module's. Its mixture of attention heads (two such modules without a gate, around
    attention) is kept whole, said."""
    import copy

    from ds_inference_integration.policy.kinds import experts_in_two_modules
    from ds_inference_integration.shard import experts as split

    model = zoo_model("jetmoe")
    policy = derive_policy(model)
    assert dict(policy.experts)["JetMoeDecoderLayer"] == ("mlp",) and "JetMoeDecoderLayer" in dict(policy.layers)
    assert "self_attention" in dict(policy.replicated)["JetMoeDecoderLayer"], policy.replicated
    mlp = model.model.layers[0].mlp
    assert experts_in_two_modules(mlp) == ("input_linear", "output_linear")
    assert experts_in_two_modules(model.model.layers[0].self_attention.experts) is None
    with torch.no_grad():
        mlp.bias.normal_()
        x = torch.randn(1, 5, 128)
        whole, parts = mlp(x), []
        for rank in range(2):
            mine = copy.deepcopy(mlp)
            split.split_experts(mine, 2, rank, None)
            mine._forward_hooks.clear()  # the all-reduce: the sum below
            parts.append(mine(x))
            assert mine.input_linear.weight.shape == (4, 256, 128) and mine.output_linear.weight.shape == (4, 128, 128)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
