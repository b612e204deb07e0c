"""Mixture-of-experts split in this process (no rank starts): each rank's experts output is a partial sum that adds
up to the unsharded one, and shard-aware loading converts only this rank's slices of the per-expert checkpoint
tensors. That the split model gives the unsharded tokens at tp 2 and 4 is `test_policies_tp.py`'s."""

import copy

import pytest
import torch
import transformers as tr

from conftest import assert_close_up_to_rounding
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.policy.derive import derive_policy
from ds_inference_integration.shard.experts import split_experts

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=1)
MOE = {
    "mixtral": lambda: tr.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: tr.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64),
    "olmoe": lambda: tr.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
}


def model_of(name):
    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(MOE[name]()).eval()


@pytest.mark.parametrize("name", list(MOE))
def test_the_ranks_expert_outputs_add_up_to_the_unsharded_experts(name):
    experts = model_of(name).model.layers[0].mlp.experts
    hidden = torch.randn(7, COMMON["hidden_size"])
    index = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2)
    want = experts(hidden, index, weights)
    parts = []
    for rank in range(2):
        mine = copy.deepcopy(experts)
        split_experts(mine, 2, rank, group=None)
        assert mine.gate_up_proj.shape[1] == experts.gate_up_proj.shape[1] // 2
        parts.append(mine.forward(hidden, index, weights))  # forward(): without the all-reduce hook
    assert_close_up_to_rounding(parts[0] + parts[1], want, scale=parts, msg=name)


def test_the_derived_policy_splits_the_experts_and_keeps_the_router():
    policy = derive_policy(model_of("mixtral"))
    assert policy.experts == {"MixtralDecoderLayer": ("mlp.experts",)}
    assert policy.layers == {"MixtralDecoderLayer": ("self_attn.o_proj",)}  # the router is no linear: whole


def test_an_inner_size_that_does_not_divide_is_refused_with_the_valid_sizes():
    experts = model_of("mixtral").model.layers[0].mlp.experts
    with pytest.raises(InferenceSetupError, match=r"inner size 128 is not divisible by --tp_size 3; valid tp sizes: "
                                                  r"1, 2, 4, 8, 16, 32, 64"):
        split_experts(experts, 3, 0, group=None)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_shard_aware_loading_reads_only_this_ranks_slices_of_each_expert(name, tmp_path):
    """The checkpoint holds one tensor per expert and projection (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj);
    each rank's packed tensors come out bitwise equal to the full load's, split."""
    from ds_inference_integration.load.checkpoint import SafetensorsCheckpoint, checkpoint_files
    from ds_inference_integration.load.keys import plan_keys
    from ds_inference_integration.load.readers import ShardAwareLoader
    from ds_inference_integration.load.skeleton import build_skeleton

    full = model_of(name)
    full.save_pretrained(tmp_path)
    ckpt = SafetensorsCheckpoint(checkpoint_files(tmp_path))
    skeleton = build_skeleton(tr.AutoModelForCausalLM, full.config, torch.float32, tmp_path)
    plan, reason = plan_keys(skeleton, ckpt)
    assert reason is None and plan.packed, reason
    loader = ShardAwareLoader(tmp_path, torch.float32, ckpt, plan)
    for rank in range(2):
        mine, ref = copy.deepcopy(skeleton.model.layers[0].mlp.experts), copy.deepcopy(full.model.layers[0].mlp.experts)
        split_experts(mine, 2, rank, group=None)
        split_experts(ref, 2, rank, group=None)
        for attr in ("gate_up_proj", "down_proj"):
            p = getattr(mine, attr)
            got = loader._read_whole([f"model.layers.0.mlp.experts.{attr}"], p)
            assert torch.equal(got, getattr(ref, attr)), (name, rank, attr)
    whole = loader._read_whole(["model.layers.0.mlp.experts.gate_up_proj"], skeleton.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(whole, full.model.layers[0].mlp.experts.gate_up_proj)
