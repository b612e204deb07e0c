"""Models that ship their own code (`auto_map`, `trust_remote_code`): trusted, loaded, sharded and checked through
every entry point. The models are tests/own_code's, written in the style of published remote-code families
(`own_code_models.py`); each is built once per pytest run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from own_code_models import DERIVED, families, save_own_code
from test_policies_tp import assert_all_pass, policy_check, tp2_shared

from conftest import EXAMPLES, PREFIX, TRANSLATE_ARGS, once_per_run, run_example, run_in_process

BIN = Path(sys.executable).parent
QKNORM_POLICY = """description = "qknorm_lm: head counts under its own config names"
model_types = ["qknorm_lm"]
head_count_attributes = ["n_q_heads"]

[layers.Block]
row_parallel = ["attn.out", "mlp.down"]
packed = ["mlp.gate_up"]

[attention]
query_heads = "n_q_heads"
kv_heads = "n_kv_heads"
fused_qkv = "attn.qkv_packed"
layout = "qkv"
local = { n_q_heads = "q_heads", n_kv_heads = "kv_heads" }
"""
PROMPT = "Do you wish to run the custom code"


@pytest.fixture(scope="module")
def own() -> dict[str, Path]:
    """{family: its model directory}, written once per pytest run."""
    root = once_per_run("own_code_models", lambda out: [save_own_code(f, out) for f in families()])
    return {f: root / f for f in families()}


def _skeleton(model_dir: Path):
    from ds_inference_integration.load.own_code import load_config, own_model_class
    from ds_inference_integration.load.skeleton import build_skeleton, model_class_for

    config = load_config(model_dir, True)
    return build_skeleton(own_model_class(model_class_for(config, True), config, True), config, torch.float32,
                          model_dir)


# In process ----------------------------------------------------------------------------------------------------

def test_a_directory_with_code_and_no_option_is_one_line_naming_the_option_and_the_files(own, caplog):
    """Without trust: one line naming --trust_remote_code and the files that would run; with it, nothing. A directory
    of a type transformers builds itself (DeepSeek-V2's checkpoints name `deepseek_v2`) runs transformers' classes
    without the option, as one process does, said in a warning."""
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.load.own_code import check_trust, code_files

    assert code_files(own["chatglm"]) == ["configuration_chatglm.py", "modeling_chatglm.py"]
    with pytest.raises(InferenceSetupError) as refused:
        check_trust(own["internlm2"], False)
    line = str(refused.value)
    assert "\n" not in line and "--trust_remote_code" in line and "modeling_internlm2.py" in line
    check_trust(own["internlm2"], True)
    with caplog.at_level("WARNING"):
        check_trust(own["deepseek_v2"], False)
    assert "transformers builds its own classes for model_type 'deepseek_v2'" in caplog.text


def test_the_kind_checks_build_the_classes_auto_map_names(own):
    """A remote config named like transformers' own (DeepseekV2Config, PhiConfig) builds the model's own class, not
    transformers' class of the same name; ChatGLM's auto_map names one decoder for AutoModelForSeq2SeqLM and
    AutoModelForCausalLM: built as a causal LM; a script's Auto class the auto_map does not name is one line naming
    the classes it does."""
    import transformers as tr

    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.load.own_code import is_own_code, load_config, own_model_class
    from ds_inference_integration.load.skeleton import check_model_kind, model_class_for

    for family, name in (("deepseek_v2", "DeepseekV2ForCausalLM"), ("phi_msft", "PhiForCausalLM")):
        config = load_config(own[family], True)
        assert is_own_code(type(config)) and model_class_for(config, True) is tr.AutoModelForCausalLM
        cls = own_model_class(tr.AutoModelForCausalLM, config, True)
        assert cls.__name__ == name and is_own_code(cls), cls
        check_model_kind(config, tr.AutoModelForCausalLM, own[family], True)
    chatglm = load_config(own["chatglm"], True)
    assert model_class_for(chatglm, True) is tr.AutoModelForCausalLM
    with pytest.raises(InferenceSetupError, match="auto_map names .*AutoModelForCausalLM.*no class for "
                                                  "AutoModelForSeq2SeqLM"):
        check_model_kind(load_config(own["internlm2"], True), tr.AutoModelForSeq2SeqLM, own["internlm2"], True)


def test_a_model_of_its_own_code_gets_the_buffers_its_init_computes(own):
    """transformers 5.25 leaves the non-persistent buffers of a model of its own code (rotary `inv_freq`) as
    uninitialised memory after `from_pretrained` unless its `_init_weights` fills them, which code written for
    transformers 4 does not: the loaders compute them again as the model's `__init__` does, in a skeleton and in a
    full load alike."""
    import transformers as tr

    from ds_inference_integration.load.own_code import from_pretrained

    want = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))  # InternLM2's, head_dim 32
    model = from_pretrained(tr.AutoModelForCausalLM, own["internlm2"], True)
    assert torch.equal(model.model.layers[0].attention.rotary_emb.inv_freq, want)
    skeleton = _skeleton(own["internlm2"])
    assert torch.equal(skeleton.model.layers[0].attention.rotary_emb.inv_freq, want)


def test_the_probe_reads_what_the_names_do_not_say(own):
    """Each mechanism of the derivation on the families' skeletons (parameters on meta): fused layouts read from the
    rows each head reads (ChatGLM's [all q | k, v of each group], InternLM2's [q q k v] per group, through a norm on
    each head: qknorm_lm), separate projections under names no rule knows (reference LLaMA's `wq`, `wk`, `wv`), the
    attributes a rank's split needs (ChatGLM's `core_attention`, OLMo's `fused_dims` tuple
    and its config's `n_heads`), row-parallel linears from the data flow (OLMo's, directly on its block; InternLM2's
    `wo`), packed projections (ChatGLM's [gate | up], OLMo's [x | gate], a cross-attention's [key | value]), and a
    per-head bias made outside the layers, by a module (JAIS's ALiBi slopes) or by the model's forward and passed to
    each layer (MPT's `attn_bias`)."""
    from ds_inference_integration.policy.derive import derive_policy
    from ds_inference_integration.policy.derive.probe import Probe

    chatglm = derive_policy(_skeleton(own["chatglm"]))
    assert (chatglm.attention.fused_qkv, chatglm.attention.layout) == ("self_attention.query_key_value", "qkv")
    assert dict(chatglm.attention.local) == {"core_attention.hidden_size_per_partition": "q_width",
                                             "num_attention_heads_per_partition": "q_heads",
                                             "num_multi_query_groups_per_partition": "kv_heads"}
    assert chatglm.packed == {"GLMBlock": ("mlp.dense_h_to_4h",)} and not chatglm.replicated
    internlm2 = derive_policy(_skeleton(own["internlm2"]))
    assert (internlm2.attention.fused_qkv, internlm2.attention.layout) == ("attention.wqkv", "grouped")
    assert "attention.wo" in internlm2.layers["InternLM2DecoderLayer"] and not internlm2.replicated
    olmo = derive_policy(_skeleton(own["hf_olmo"]))
    assert olmo.layers == {"OLMoSequentialBlock": ("attn_out", "ff_out")} and olmo.attention.fused_qkv == "att_proj"
    assert dict(olmo.attention.local) == {"config.n_heads": "q_heads", "fused_dims": ("q_width",) * 3}
    assert olmo.packed == {"OLMoSequentialBlock": ("ff_proj",)} and not olmo.replicated
    llama = derive_policy(_skeleton(own["llama_ref"]))  # wq/wk/wv/wo: separate projections no name rule knows
    assert (llama.attention.query, llama.attention.key, llama.attention.value) == (
        "attention.wq", "attention.wk", "attention.wv")
    # its repeat count is query heads per key/value head, though it equals the key/value heads in this model
    assert dict(llama.attention.local) == {"n_local_heads": "q_heads", "n_local_kv_heads": "kv_heads",
                                           "n_rep": "q_per_kv"}
    assert "attention.wo" in llama.layers["TransformerBlock"] and not llama.replicated
    seq2seq = derive_policy(_skeleton(own["own_seq2seq"]))
    assert seq2seq.packed == {"TranslatorDecoderLayer": ("encoder_attn.kv_proj",)}
    jais = derive_policy(_skeleton(own["jais"]))
    assert jais.head_biases == ("transformer.relative_pe",) and not jais.head_inputs  # cut once, by its module
    mpt = derive_policy(_skeleton(own["mpt_ref"]))  # ALiBi made by the model's forward, passed to each block
    assert mpt.head_inputs == {"MPTBlock": {"attn_bias": -3}} and not mpt.head_biases
    # a rotary table an input of every layer (InternLM2's, ChatGLM's) is not one, whatever its sizes
    assert not internlm2.head_inputs and not chatglm.head_inputs and not llama.head_inputs
    model = _skeleton(own["qknorm_lm"])
    rows = Probe(model).heads(model.model.blocks[0], "attn.qkv_packed")
    assert [r[0] for r in rows.q] == [0, 32, 64, 96] and [r[0] for r in rows.kv_heads()] == [128, 160]
    assert [r[0] for r in rows.v] == [192, 192, 224, 224]
    verdicts = {m for m, _, _ in chatglm.verdicts}
    assert {"row-parallel linears", "attention", "per-rank attributes", "packed projections"} <= verdicts


def test_head_counts_under_names_no_rule_knows_are_refused_in_one_line_naming_them(own):
    """qknorm_lm's config calls its head counts `n_q_heads` and `n_kv_heads`: left to DeepSpeed, its fused projection
    would be cut across query, key and value; the refusal names the probe's counts, the attributes holding them and
    what to declare."""
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.policy.derive import derive_policy

    with pytest.raises(InferenceSetupError) as refused:
        derive_policy(_skeleton(own["qknorm_lm"]))
    line = str(refused.value)
    assert "\n" not in line and "holds 4 query and 2 key/value heads" in line and "n_q_heads = 4" in line
    assert 'fused_qkv = "attn.qkv_packed", layout = "qkv"' in line


def test_layouts_the_tables_do_not_name_are_not_taken_for_one():
    """`layout_of` on rows as a probe reads them: the three layouts a table names, and a fourth ([K | Q | V]) none."""
    from ds_inference_integration.policy.derive.layouts import layout_of
    from ds_inference_integration.policy.derive.probe import HeadRows, decode

    def block(start):
        return list(range(start, start + 2))

    qkv = HeadRows(12, q=[block(0), block(2), block(4), block(6)], k=[block(8)] * 4, v=[block(10)] * 4)
    assert layout_of(qkv) == ("qkv", 4, 1, 2)
    grouped = HeadRows(8, q=[block(0), block(4)], k=[block(2), block(6)], v=[block(3), block(7)])
    assert layout_of(HeadRows(8, q=[[0, 1], [4, 5]], k=[[2, 3], [6, 7]], v=[[0, 0], [0, 0]])) is None
    assert layout_of(grouped) is None  # (v's rows overlap k's: not a layout)
    per_head = HeadRows(12, q=[block(0), block(6)], k=[block(2), block(8)], v=[block(4), block(10)])
    assert layout_of(per_head) == ("per_head", 2, 2, 2)
    keys_first = HeadRows(6, q=[block(2)], k=[block(0)], v=[block(4)])
    assert layout_of(keys_first) is None
    # each head its own scale (a norm over its features): 0.5 x (index + 1), then 3 x (index + 1)
    operand = torch.tensor([[0.5, 1.0], [3 * 5.0, 3 * 6.0]])
    assert decode(operand, 8) == [[0, 1], [4, 5]]


def test_a_policy_file_declares_what_the_probe_reads(tmp_path):
    """`packed`, `head_biases` and `[attention.local]` entries of a module inside the attention and of a tuple
    attribute read back as they were written, and written out read back the same; a wrong entry is one line."""
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.policy.schema import load_policy, policy_identity, policy_to_toml

    path = tmp_path / "p.toml"
    text = QKNORM_POLICY.replace('description', 'head_biases = ["transformer.relative_pe"]\ndescription', 1)
    text = text.replace('local = { n_q_heads = "q_heads", n_kv_heads = "kv_heads" }',
                        'local = { "core.width" = "q_width", dims = ["q_width", "kv_width", "kv_width"] }')
    path.write_text(text)
    policy = load_policy(path)
    assert policy.packed == {"Block": ("mlp.gate_up",)} and policy.head_biases == ("transformer.relative_pe",)
    assert dict(policy.attention.local) == {"core.width": "q_width", "dims": ("q_width", "kv_width", "kv_width")}
    path.write_text(policy_to_toml(policy))
    again = load_policy(path)
    assert policy_identity(again) == policy_identity(policy)
    assert (again.packed, again.head_biases, again.attention) == (policy.packed, policy.head_biases, policy.attention)
    path.write_text(text.replace('"core.width" = "q_width"', '"core.width" = "q_wide"'))
    with pytest.raises(InferenceSetupError, match=r"\[attention.local\] entries .*q_wide"):
        load_policy(path)
    path.write_text(text.replace('packed = ["mlp.gate_up"]', 'packed = "mlp.gate_up"'))
    with pytest.raises(InferenceSetupError, match="layers.Block.packed"):
        load_policy(path)


def test_a_bias_for_every_head_passed_to_the_layers_is_cut_to_a_ranks_heads(tmp_path):
    """`head_inputs`: read back as written; an input the layer's forward cannot take, or a bad axis, is one line;
    the cut keeps this rank's heads on the named axis, of [1, heads, 1, keys] as of the batch and heads flattened
    together, whether the input comes by keyword or by position, and leaves a bias for all heads alike (one entry on
    that axis) as it is."""
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.policy.head_layout import HeadLayout
    from ds_inference_integration.policy.schema import load_policy, policy_identity, policy_to_toml
    from ds_inference_integration.shard.biases import cut_head_inputs, cut_heads

    path = tmp_path / "p.toml"
    text = QKNORM_POLICY.replace('packed = ["mlp.gate_up"]', 'packed = ["mlp.gate_up"]\nhead_inputs = { bias = -3 }')
    path.write_text(text)
    policy = load_policy(path)
    assert policy.head_inputs == {"Block": {"bias": -3}}
    path.write_text(policy_to_toml(policy))
    assert policy_identity(load_policy(path)) == policy_identity(policy)
    for bad in ("{ bias = 1 }", '"bias"', "{ 1bias = -3 }"):
        path.write_text(text.replace("{ bias = -3 }", bad))
        with pytest.raises(InferenceSetupError, match="layers.Block.head_inputs"):
            load_policy(path)

    heads = HeadLayout(4, 4, 2, 1)  # rank 1 of 2: heads 2 and 3
    alibi = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 1, 5)
    assert cut_heads(alibi, -3, heads)[0, :, 0, 0].tolist() == [2.0, 3.0]
    flat = torch.arange(8.0).view(8, 1, 1)  # batch 2 x heads 4
    assert cut_heads(flat, -3, heads).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    same = torch.zeros(1, 1, 1, 5)
    assert cut_heads(same, -3, heads) is same

    class Block(torch.nn.Module):
        def forward(self, x, bias=None, mask=None):
            return bias

    block = Block()
    cut_head_inputs([block], {"Block": {"bias": -3}}, heads, "p.toml")
    assert block(None, bias=alibi).shape[1] == 2 and block(None, alibi).shape[1] == 2
    with pytest.raises(InferenceSetupError, match="'biases' is no input of Block.forward; valid: x, bias, mask"):
        cut_head_inputs([Block()], {"Block": {"biases": -3}}, heads, "p.toml")
    with pytest.raises(InferenceSetupError, match="layers.Decoder match no layer"):
        cut_head_inputs([Block()], {"Decoder": {"bias": -3}}, heads, "p.toml")


# Launched -------------------------------------------------------------------------------------------------------

def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`ds-inference ARGS`, its stdin a pipe that answers "y" should anything ask."""
    return subprocess.run([str(BIN / "ds-inference"), *args], input="y\n" * 8, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


class _NoStdin:
    """A stdin that fails the test when read: transformers asks on stdin before running a model's own code."""

    def read(self, *args):
        raise AssertionError("stdin was read")

    readline = read

    def isatty(self) -> bool:
        return True


def test_every_entry_point_refuses_code_it_was_not_told_to_trust_in_one_line(own, tmp_path, monkeypatch, capsys):
    """No option: each command and each example refuses the directory in one line naming --trust_remote_code and the
    code files, before any rank starts, and reads nothing from stdin (a terminal's, which transformers would ask):
    the commands in this process (`cli.main`'s exit code 2), the examples through their parser (the `error:` line
    and exit 2 of a real process: test_a_refusal_is_one_line_and_exit_2_in_a_real_process)."""
    from conftest import load_example
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.tools.cli import main

    monkeypatch.setattr("sys.stdin", _NoStdin())
    model, seq2seq = str(own["internlm2"]), str(own["own_seq2seq"])
    for command in (["policy", "check", model, "--tp-size", "2"], ["policy", "suggest", model],
                    ["shard", model, "--tp-size", "2", str(tmp_path / "sharded")],
                    ["serve", model, "--tp_size", "2", "--port", "0"],
                    ["policy", "matrix", "--add", model, "--tp-sizes", "2"],
                    ["bench", "memory", "--model", model], ["bench", "predict", "--model", seq2seq]):
        code = main(command)
        err = capsys.readouterr().err
        assert code == 2 and err.count("error:") == 1, (command, code, err[-2000:])
        assert "--trust_remote_code" in err and "modeling_" in err and PROMPT not in err, (command, err)
    assert not (tmp_path / "sharded").exists()
    from ds_inference_integration.run import output_dir as locks

    common = ["--report_to", "none", "--do_predict"]
    for script, extra in (("run_generation", ["--model_name_or_path", model, "--max_prompts", "2"]),
                          ("run_translation", ["--model_name_or_path", seq2seq, *TRANSLATE_ARGS]),
                          ("run_summarization", ["--model_name_or_path", seq2seq, "--predict_with_generate"]),
                          ("run_speech_recognition_seq2seq", ["--model_name_or_path", seq2seq,
                                                              "--predict_with_generate"])):
        try:
            with pytest.raises(InferenceSetupError, match="--trust_remote_code") as refused:
                load_example(script).main(["--output_dir", str(tmp_path / script), *common, *extra])
        finally:
            locks.release_all()  # the refused run's hold on its output directory (rank 0's), as its process's end would
        assert "\n" not in str(refused.value) and "modeling_" in str(refused.value), (script, refused.value)


@pytest.mark.launched
def test_a_refusal_is_one_line_and_exit_2_in_a_real_process(own, tmp_path):
    """The refusal as a user sees it: one `error:` line and exit 2 from an example run as a script (its stdin a pipe
    that would answer "y"), and from `ds-inference serve`, before any rank starts."""
    runs = [subprocess.run([sys.executable, str(EXAMPLES / "run_generation.py"), "--output_dir", str(tmp_path / "out"),
                            "--model_name_or_path", str(own["internlm2"]), "--report_to", "none"], input="y\n" * 8,
                           capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}),
            _cli("serve", str(own["internlm2"]), "--tp_size", "2", "--port", "0")]
    for proc in runs:
        out = proc.stdout + proc.stderr
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "--trust_remote_code" in errors[0], out[-2000:]
        assert PROMPT not in out and "Traceback" not in out, out[-2000:]


def _only_what_every_rank_needs_whole(checks: dict, names: list[str]) -> None:
    """Weights: each rank about 1/tp (`assert_all_pass`); whole by design only what every rank needs whole:
    DeepSeek-V2's router and its latent attention's down-projection (shared by every head; vLLM keeps it whole too)."""
    for name in names:
        share = checks[name]["weights_per_rank"]["data"]
        assert {k.rpartition("Layer.")[2] for k in share["by_design"]} <= {
            "mlp.gate", "self_attn.kv_a_proj_with_mqa"} and not share["not_placed"], (name, share)


def _check(own, names, tp, tmp_path, *extra):
    proc, report = policy_check([own[n] for n in names], tp, tmp_path, "--trust_remote_code", *extra, timeout=600)
    _only_what_every_rank_needs_whole(assert_all_pass(proc, report, names, tp), names)
    return proc, report


@pytest.mark.launched
def test_models_with_their_own_code_match_the_unsharded_model_at_tp2():
    """The eleven families the derivation splits by itself, in the shared tp-2 check (`test_policies_tp.tp2_shared`,
    --trust_remote_code): every check passes (logits, hidden states, greedy, beam and sampled ids, the weights each
    rank holds, shard-aware and pre-sharded loading), each derived policy's verdicts printed before its checks;
    nothing kept whole but what every rank needs whole."""
    proc, report, _ = tp2_shared()
    names = [f"own_{f}" for f in DERIVED]
    checks = assert_all_pass(proc, report, names, 2)
    _only_what_every_rank_needs_whole(checks, names)
    assert set(names) <= set(report["derivations"])
    assert "derived policy of own_chatglm, each mechanism's verdict:" in proc.stdout
    assert "packed projections    GLMBlock.mlp.dense_h_to_4h" in proc.stdout


@pytest.mark.slow
@pytest.mark.launched
def test_models_with_their_own_code_match_the_unsharded_model_at_tp4(own, tmp_path):
    """As at tp 2, at tp 4: ChatGLM's and InternLM2's two key/value heads copied on two ranks each."""
    _check(own, DERIVED, 4, tmp_path)


@pytest.mark.slow
@pytest.mark.launched
@pytest.mark.parametrize("tp", [2, 4])
def test_the_worked_example_goes_from_refusal_to_a_checked_policy(own, tmp_path, tp):
    """docs/policies.md's worked example: qknorm_lm refused in one line saying what to declare, then every check
    passed with the policy file written from it."""
    if tp == 2:
        proc, report = policy_check([own["qknorm_lm"]], tp, tmp_path, "--trust_remote_code", timeout=300)
        assert proc.returncode == 1 and report["checks"][0]["check"] == "setup", proc.stdout[-2000:]
        assert "n_q_heads = 4" in report["checks"][0]["line"] and "declare them" in report["checks"][0]["line"]
    policy = tmp_path / "qknorm.toml"
    policy.write_text(QKNORM_POLICY)
    _check(own, ["qknorm_lm"], tp, tmp_path, "--policy", str(policy))


def _one_process(model_dir: Path, prompts: list[str], new_tokens: int) -> list[str]:
    """Greedy texts one process generates, a prompt at a time (the model's own code, trusted)."""
    import transformers as tr

    from ds_inference_integration.load.own_code import from_pretrained, load_tokenizer

    tokenizer = load_tokenizer(model_dir, True)
    model = from_pretrained(tr.AutoModelForCausalLM, model_dir, True).eval()
    texts = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return texts


def _served(model_dir: Path, tmp_path: Path, prompts: list[str], new_tokens: int, extra=()) -> tuple[list[str], str]:
    from serving import ServerProc, post_all

    (tmp_path / "serve").mkdir(exist_ok=True)
    server = ServerProc(model_dir, ["--tp_size", "2", "--trust_remote_code", *extra], tmp_path / "serve", 2)
    try:
        server.wait_ready(240)
        answers = post_all(server.url + "/v1/completions",
                           [{"prompt": p, "max_tokens": new_tokens, "temperature": 0} for p in prompts], concurrency=8)
        assert [s for s, _ in answers] == [200] * len(prompts), answers[:2]
        return [a["choices"][0]["text"].strip() for _, a in answers], server.output()
    finally:
        server.stop()
        assert not server.group_alive()


GENERATION_ARGS = ["--max_new_tokens", "12", "--per_device_eval_batch_size", "8", "--report_to", "none",
                   "--max_prompts", "16", "--trust_remote_code"]


@pytest.mark.slow
@pytest.mark.launched
@pytest.mark.parametrize("family", ["internlm2", "deepseek_v2"])
def test_run_generation_and_the_server_at_tp2_answer_as_one_process(own, tmp_path, family):
    """run_generation.py at tp 2 (torchrun) writes what it writes in one process, and `serve --tp_size 2` answers the
    same prompts as one process generates them, token for token, 8 clients at once."""
    prompts = (EXAMPLES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()[:16]
    single = run_in_process([*GENERATION_ARGS, "--model_name_or_path", str(own[family])], tmp_path / "single",
                            script=EXAMPLES / "run_generation.py")
    tp = run_example([*GENERATION_ARGS, "--model_name_or_path", str(own[family]), "--deepspeed_inference"],
                     tmp_path / "tp", nprocs=2, script=EXAMPLES / "run_generation.py")
    assert tp.returncode == 0, tp.output[-3000:]
    assert tp.predictions() == single.predictions() and len(single.predictions()) == 16
    assert [json.loads(line)["generations"][0] for line in
            (tmp_path / "single" / "generated_predictions.jsonl").read_text().splitlines()] == _one_process(
        own[family], prompts, 12)
    served, _ = _served(own[family], tmp_path, prompts, 12)
    assert served == [json.loads(line)["generations"][0] for line in
                      (tmp_path / "single" / "generated_predictions.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.launched
def test_a_copy_sharded_with_its_code_loads_back_with_the_option(own, tmp_path):
    """`ds-inference shard --trust_remote_code` carries the code files beside the rank files; run_generation.py at tp
    2 reads that copy (each rank its own file) and writes what one process writes from the source."""
    family = "internlm2"
    single = run_in_process([*GENERATION_ARGS, "--model_name_or_path", str(own[family])], tmp_path / "single",
                            script=EXAMPLES / "run_generation.py")
    sharded = tmp_path / "sharded"
    made = _cli("shard", str(own[family]), "--tp-size", "2", str(sharded), "--trust_remote_code", timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    assert {"modeling_internlm2.py", "configuration_internlm2.py", "manifest.json"} <= {
        p.name for p in sharded.iterdir()}
    again = run_example([*GENERATION_ARGS, "--model_name_or_path", str(sharded), "--deepspeed_inference"],
                        tmp_path / "presharded", nprocs=2, script=EXAMPLES / "run_generation.py")
    assert again.returncode == 0 and "model loaded pre-sharded" in again.output, again.output[-3000:]
    assert again.predictions() == single.predictions()


@pytest.mark.slow
@pytest.mark.launched
def test_run_translation_and_the_server_at_tp2_translate_as_one_process(own, tmp_path):
    """The encoder-decoder with its own code (fused per-head self-attention, packed cross-attention [key | value]):
    run_translation.py at tp 2 predicts what it predicts in one process, and the server at tp 2 translates the same
    sources to the same texts."""
    args = [*TRANSLATE_ARGS, "--model_name_or_path", str(own["own_seq2seq"]), "--do_predict", "--test_file",
            str(EXAMPLES / "data" / "num2words" / "test.json"), "--max_predict_samples", "16",
            "--per_device_eval_batch_size", "8", "--val_max_target_length", "32", "--max_source_length", "48",
            "--trust_remote_code"]
    single = run_in_process(args, tmp_path / "single")
    tp = run_example([*args, "--deepspeed_inference"], tmp_path / "tp", nprocs=2)
    assert tp.returncode == 0, tp.output[-3000:]
    assert tp.predictions() == single.predictions() and len(single.predictions()) == 16
    sources = [json.loads(line)["translation"]["en"] for line in
               (EXAMPLES / "data" / "num2words" / "test.json").read_text(encoding="utf-8").splitlines()[:16]]
    served, _ = _served(own["own_seq2seq"], tmp_path, [PREFIX + s for s in sources], 31)
    assert served == [p.strip() for p in single.predictions()]


def test_policy_suggest_prints_the_derived_policy_of_a_models_own_class_with_its_verdicts(own, capsys, tmp_path):
    """`policy suggest --trust_remote_code`: the header names the model's own class and its code files, each
    mechanism's verdict follows as comments, and the file reads back as the policy derived."""
    from ds_inference_integration.policy.derive import derive_policy
    from ds_inference_integration.policy.schema import load_policy, policy_identity
    from ds_inference_integration.tools.cli import main

    assert main(["policy", "suggest", str(own["chatglm"]), "--trust_remote_code"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# derived from ChatGLMForConditionalGeneration (the model's own code: "
                           "configuration_chatglm.py, modeling_chatglm.py)"), text[:300]
    assert "#   packed projections    GLMBlock.mlp.dense_h_to_4h" in text and "--trust_remote_code" in text
    (tmp_path / "chatglm.toml").write_text(text)
    assert policy_identity(load_policy(tmp_path / "chatglm.toml")) == policy_identity(
        derive_policy(_skeleton(own["chatglm"])))
