"""Policy files: schema, resolution, and validation against the real model before any sharding."""

import pytest
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from conftest import save_tiny_model
from ds_inference_integration import (
    InferenceSetupError,
    available_policies,
    build_injection_policy,
    check_head_counts,
    load_policy,
    resolve_policy,
)
from ds_inference_integration.policy.schema import DERIVE


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_models")
    return {kind: AutoModelForSeq2SeqLM.from_pretrained(save_tiny_model(kind, root / kind))
            for kind in ("t5", "bart", "mbart", "marian")}


def test_shipped_policies_cover_t5_and_bart_families():
    known = available_policies()
    for model_type in ("t5", "mt5", "bart", "mbart", "marian"):
        assert model_type in known
    assert resolve_policy("autotp", AutoConfig.for_model("t5")) is None


@pytest.mark.parametrize("kind, expected", [
    ("t5", {"T5Block": ("DenseReluDense.wo", "EncDecAttention.o", "SelfAttention.o")}),
    ("bart", {"BartEncoderLayer": (".fc2", "self_attn.out_proj"),
              "BartDecoderLayer": (".fc2", "encoder_attn.out_proj", "self_attn.out_proj")}),
    ("mbart", {"MBartEncoderLayer": (".fc2", "self_attn.out_proj"),
               "MBartDecoderLayer": (".fc2", "encoder_attn.out_proj", "self_attn.out_proj")}),
    ("marian", {"MarianEncoderLayer": (".fc2", "self_attn.out_proj"),
                "MarianDecoderLayer": (".fc2", "encoder_attn.out_proj", "self_attn.out_proj")}),
])
def test_policy_becomes_deepspeed_keys_with_the_leading_dot(models, kind, expected):
    model = models[kind]
    policy = resolve_policy("auto", model.config)
    got = {cls.__name__: keys for cls, keys in build_injection_policy(policy, model).items()}
    assert got == expected


def test_missing_module_is_named_with_the_valid_linears(models, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model_types = ["t5"]\n[layers.T5Block]\nrow_parallel = ["SelfAttention.o", "DenseReluDense.wout"]\n')
    with pytest.raises(InferenceSetupError,
                       match=r"'DenseReluDense.wout' names no module inside T5Block .*linears there: "
                             r".*layer.1.DenseReluDense.wo"):
        build_injection_policy(load_policy(bad), models["t5"])


def test_unknown_layer_class_lists_the_layer_classes(models, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model_types = ["t5"]\n[layers.T5Blok]\nrow_parallel = ["SelfAttention.o"]\n')
    with pytest.raises(InferenceSetupError,
                       match=r"'T5Blok' matches nothing in T5ForConditionalGeneration; layer classes there: T5Block"):
        build_injection_policy(load_policy(bad), models["t5"])


def test_non_linear_names_are_refused(models, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model_types = ["t5"]\n[layers.T5Block]\nrow_parallel = ["SelfAttention"]\n')
    with pytest.raises(InferenceSetupError, match="is T5Attention, not a linear"):
        build_injection_policy(load_policy(bad), models["t5"])


@pytest.mark.parametrize("text, message", [
    ("model_types = [", "not valid TOML"),
    ('model_types = ["t5"]\nfoo = 1\n[layers.T5Block]\nrow_parallel = ["o"]\n', r"unknown key\(s\) \['foo'\]; valid keys"),
    ('model_types = ["t5"]\n', r"needs a \[layers.<ClassName>\] table"),
    ('model_types = []\n[layers.T5Block]\nrow_parallel = ["o"]\n', "'model_types' must be a non-empty list"),
    ('model_types = ["t5"]\n[layers.T5Block]\nrow_parallel = []\n', "row_parallel' must be a non-empty list"),
    ('model_types = ["t5"]\n[layers.T5Block]\nrowparallel = ["o"]\n',
     r"must hold row_parallel = \[\.\.\.\] \(and may hold replicated"),
])
def test_schema_errors(tmp_path, text, message):
    bad = tmp_path / "p.toml"
    bad.write_text(text)
    with pytest.raises(InferenceSetupError, match=message):
        load_policy(bad)


def test_unknown_policy_name_and_model_type():
    with pytest.raises(InferenceSetupError,
                       match="'nope.toml' is not a file; valid: auto, autotp, derive, or a policy file path"):
        resolve_policy("nope.toml", AutoConfig.for_model("t5"))
    assert resolve_policy("auto", AutoConfig.for_model("xglm")) == DERIVE  # no file: derived from the model


def test_head_counts_must_divide_tp():
    cfg = AutoConfig.for_model("t5", num_heads=3)
    policy = resolve_policy("auto", cfg)
    check_head_counts(policy, cfg, 3)
    with pytest.raises(InferenceSetupError, match="t5: num_heads=3 is not divisible by --tp_size 2; valid tp sizes: 1, 3"):
        check_head_counts(policy, cfg, 2)
    bart = AutoConfig.for_model("bart", encoder_attention_heads=4, decoder_attention_heads=6)
    with pytest.raises(InferenceSetupError, match="decoder_attention_heads=6 is not divisible by --tp_size 4"):
        check_head_counts(resolve_policy("auto", bart), bart, 4)
    with pytest.raises(InferenceSetupError, match="num_attention_heads=3 is not divisible"):
        check_head_counts(None, cfg, 2)  # autotp: the config's usual head-count names


def test_codegen_heads_must_divide_tp_times_deepspeeds_four_blocks():
    """DeepSpeed splits CodeGen's fused qkv_proj in 4 blocks per rank and asserts on it mid-sharding: the head count
    is checked against tp x 4 before the model loads (a tiny CodeGen with 8 heads passes `policy check` at tp 2)."""
    from transformers import CodeGenConfig

    four, eight = CodeGenConfig(n_head=4, n_embd=128), CodeGenConfig(n_head=8, n_embd=128)
    with pytest.raises(InferenceSetupError, match=r"^codegen: num_attention_heads=4 is not divisible by --tp_size 2 "
                                                  r"x 4 \(DeepSpeed splits its fused qkv_proj in 4 blocks per rank\); "
                                                  r"valid tp sizes: 1$"):
        check_head_counts(resolve_policy("auto", four), four, 2)
    check_head_counts(resolve_policy("auto", eight), eight, 2)
    with pytest.raises(InferenceSetupError, match=r"num_attention_heads=8 .* --tp_size 4 x 4 .*; valid tp sizes: 1, 2$"):
        check_head_counts(resolve_policy("auto", eight), eight, 4)


def test_the_policy_is_resolved_once_before_sharding_and_no_string_reaches_it(models):
    """Issue #29's seam: `setup_inference` turns `resolve_policy`'s answer into a Policy, or None for AutoTP,
    before sharding (`policy_for_model`: "derive" becomes the policy derived from the model, None at tp 1 where
    nothing is split); `shard_model` refuses anything else instead of resolving it itself."""
    from ds_inference_integration.arguments import DeepSpeedInferenceArguments
    from ds_inference_integration.policy.derive import policy_for_model
    from ds_inference_integration.policy.schema import Policy
    from ds_inference_integration.shard.inject import shard_model
    from ds_inference_integration.topology import ProcessGroups, Topology

    model = next(iter(models.values()))
    derived = policy_for_model(DERIVE, model, 2)
    assert isinstance(derived, Policy) and str(derived.source).startswith("<derived")
    assert policy_for_model(DERIVE, model, 1) is None and policy_for_model(None, model, 2) is None
    assert policy_for_model(derived, model, 2) is derived
    with pytest.raises(InferenceSetupError, match="policy 'auto' is not resolved"):
        policy_for_model("auto", model, 2)
    with pytest.raises(TypeError, match="shard_model takes a Policy, or None"):
        shard_model(model, DeepSpeedInferenceArguments(deepspeed_inference=True), Topology(1, 0, 1),
                    ProcessGroups(None, None, None), DERIVE, float)
