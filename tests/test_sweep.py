"""`ds-inference policy sweep` (tools/sweep.py), in this process: the small configs it builds, the verdict of each
type, and its launches going on past a type the ranks stopped in. Its full run (every type, tp 2 and 4, ~20 min)
writes docs/sweep.md; `test_the_sweep_table_names_every_type` reads that file."""

import json
from pathlib import Path

import pytest

from ds_inference_integration.tools import sweep

SWEEP = Path(__file__).resolve().parents[1] / "docs" / "sweep.md"


@pytest.mark.parametrize("model_type", ["gemma3_text", "jetmoe", "bert"])
def test_a_default_config_is_made_small_and_builds(model_type, tmp_path):
    """Widths 128, 2 layers, 4 heads, a vocabulary of 96, whatever the default's sizes (Gemma 3's 262k vocabulary,
    JetMoE's experts, BERT as a decoder); the `layer_types` the config derives match its two layers."""
    from transformers import AutoConfig

    config = sweep.shrink(AutoConfig.for_model(model_type))
    assert config.vocab_size == 96 and config.num_hidden_layers == 2 and config.num_attention_heads == 4
    assert len(getattr(config, "layer_types", None) or [0, 0]) == 2
    directory, why = sweep.build(model_type, tmp_path)
    assert directory is not None and why == "" and (directory / "config.json").is_file()


@pytest.mark.parametrize("model_type", ["ministral", "recurrent_gemma", "gemma4", "fun_asr_nano", "blt"])
def test_a_default_config_whose_sizes_are_read_elsewhere_builds(model_type, tmp_path):
    """Types the sweep could not build (2026-12-06): Ministral's default leaves `head_dim` None, which its attention
    reads; RecurrentGemma's layer types are a read-only property of its block types; Gemma 4's text config, changed
    in place, kept per-layer settings for layers 5 to 29 of 2; Fun-ASR-Nano's adaptor width is a quarter of its text
    model's; BLT's hashed byte-group vocabulary (3M rows) kept 386M parameters."""
    directory, why = sweep.build(model_type, tmp_path)
    assert directory is not None and why == "", why


def test_a_type_whose_causal_class_saves_a_config_no_auto_class_loads_is_built_as_published():
    """Mllama's and Emu3's causal-LM classes are their text models, saved with a text config no Auto class loads
    back (the sweep said "refused: transformers does not load it"); their checkpoints are of the image-and-text
    class. Types whose causal class reloads (Qwen3.5, dots3) keep it."""
    assert sweep.published_class("mllama") == ["MllamaForConditionalGeneration"]
    assert sweep.published_class("emu3") == ["Emu3ForConditionalGeneration"]
    assert sweep.published_class("qwen3_5") is None and sweep.published_class("llama") is None


def test_a_type_transformers_cannot_build_from_its_own_default_is_said_so(tmp_path):
    """MusicGen's causal-LM class reads `dropout` from a config that has none: transformers' own failure, said as
    such, not taken for the small config's."""
    directory, why = sweep.build("musicgen", tmp_path)
    assert directory is None and why.startswith("transformers builds no model of its default config either"), why


def test_a_type_that_generates_no_text_by_itself_is_said_refused_not_built():
    """Gemma 4's assistants (one whose default config its own validator refuses), MusicGen, VibeVoice and Dia were
    "not built" or "unsharded model fails": they are refused in the loader's one line, which the table says."""
    for model_type in ("gemma4_assistant", "gemma4_unified_assistant", "musicgen", "vibevoice", "dia"):
        assert sweep.refusal(model_type).startswith(f"{model_type} holds a '{model_type}' model ("), model_type
    assert sweep.refusal("llama") is None and sweep.refusal("vibevoice_asr") is None
    row = sweep.table({"dia": "speech-seq2seq"}, {}, {2: {}}, {}, {"dia": "dia holds ..."}).splitlines()[-1]
    assert row == "| dia | speech-seq2seq | refused before loading: dia holds ... |"


def test_a_model_that_fails_on_padded_prompts_is_checked_on_prompts_of_one_length(tmp_path, monkeypatch):
    """Dory's own forward fails on a left-padded batch with its cache; it generates from prompts of one length. The
    checker's reference said "unsharded model fails" of it: now it is computed on prompts of one length, the failure
    kept to be said on the logits line (and the sharded model given the same prompts). Llama keeps its padded ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_inference_integration.tools import policy_check
    from ds_inference_integration.tools.architecture_zoo import ZOO, tiny_model

    monkeypatch.setattr(policy_check, "_from_first_rank", lambda compute, topology, groups: compute())
    for name in ("dory", "llama"):
        config = ZOO[name]()
        tiny_model(config).save_pretrained(tmp_path / name)
        inputs = policy_check._inputs(config, torch)
        assert not bool(inputs["attention_mask"].all())
        unpadded = policy_check._prompts(config, torch, torch.Generator().manual_seed(0), lengths=(7, 7, 7))
        want = policy_check._reference(AutoModelForCausalLM, tmp_path / name, inputs, None, None, torch, None, unpadded)
        assert want["greedy"].shape == (3, 7 + policy_check.NEW_TOKENS if name == "dory" else 10 + 8)
        if name == "dory":
            assert "must match the size of tensor b" in want["unpadded"], want["unpadded"]
        else:
            assert "unpadded" not in want


@pytest.mark.parametrize("model_type", ["encoder-decoder", "speech-encoder-decoder"])
def test_a_composite_encoder_decoder_gets_the_start_token_a_saved_one_has(model_type):
    """EncoderDecoder's and SpeechEncoderDecoder's default configs have no decoder start token, which a saved model
    sets: their unsharded model could not generate ("`decoder_start_token_id` or `bos_token_id` has to be defined"),
    so the sweep said "unsharded model fails" of two types that shard right."""
    from transformers import AutoConfig

    config = sweep.shrink(AutoConfig.for_model(model_type))
    assert isinstance(config.decoder_start_token_id, int) and config.pad_token_id == config.decoder_start_token_id
    assert sweep.shrink(AutoConfig.for_model("t5")).decoder_start_token_id == 0  # its own, kept


def test_a_type_that_cannot_be_built_is_said_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "MAX_PARAMETERS", 1000)
    directory, why = sweep.build("llama", tmp_path)
    assert directory is None and "parameters after shrinking" in why, why


def _check(model, kind, passed=True, skipped=False, line="x", **data):
    return {"model": model, "check": kind, "passed": passed, "skipped": skipped, "line": f"{model} tp2 {line}",
            "data": data}


def test_each_verdict_says_what_happened():
    kinds = ["logits", "hidden_states", "greedy", "beam", "sample", "loading_shard-aware", "loading_pre-sharded"]
    share = _check("a", "weights_per_rank", shares=[0.5, 0.5])
    assert sweep.verdict([_check("a", k) for k in kinds] + [share]) == "pass (50% per rank)"
    skipped = [_check("a", k, passed=k != "beam", skipped=k == "beam") for k in kinds] + [share]
    assert sweep.verdict(skipped) == "pass (50% per rank; beam skipped)"
    failed = [_check("a", k, passed=k != "sample", line=f"{k} bad") for k in kinds] + [share]
    assert sweep.verdict(failed) == "FAIL (7/8): sample bad"
    assert sweep.verdict([_check("a", "setup", False, line="setup: no")]) == "refused: setup: no"
    assert sweep.verdict([_check("a", "error", False, line="ValueError: boom")]) == "CRASH: ValueError: boom"
    assert sweep.verdict([]) == "no result"


def test_the_launches_go_on_past_a_type_the_ranks_stopped_in(tmp_path, monkeypatch):
    """Ranks that raise in a type end the launch after its "error" record; ranks killed in one (a hang) leave it no
    record: either way the next launch starts after it, and every type gets a verdict."""
    launches = []

    def fake_run_check(dirs, tp, policy, timeout, json_path):
        names = [Path(d).name for d in dirs]
        launches.append(names)
        checks, failure = [], None
        for name in names:
            if name == "raises":
                checks.append(_check(name, "error", False, line="RuntimeError: boom"))
                failure = "rank 0 exited 1"
                break
            if name == "hangs":
                failure = "killed after 900 s"
                break
            checks += [_check(name, "logits"), _check(name, "weights_per_rank", shares=[0.5, 0.5])]
        Path(json_path).write_text(json.dumps({"checks": checks, "rank_failure": failure}))

    import ds_inference_integration.tools.policy_check as policy_check

    monkeypatch.setattr(policy_check, "run_check", fake_run_check)
    dirs = {n: tmp_path / n for n in ("a", "raises", "b", "hangs", "c")}
    cells = sweep.check_all(dirs, 2, 900, tmp_path)
    assert launches == [["a", "raises", "b", "hangs", "c"], ["b", "hangs", "c"], ["c"]]
    assert cells["raises"] == "CRASH: RuntimeError: boom" and cells["hangs"].startswith("CRASH: the ranks stopped in it")
    assert all(cells[n].startswith("pass (50%") for n in ("a", "b", "c")), cells


def test_the_sweep_table_names_every_type():
    """docs/sweep.md, written by `ds-inference policy sweep --out docs/sweep.md`, has a row for every model type
    transformers generates with (a new transformers adds types: run the sweep again)."""
    rows = [line.split(" | ")[0].removeprefix("| ") for line in SWEEP.read_text().splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert rows == list(sweep.generating_types()), "run `ds-inference policy sweep --out docs/sweep.md` again"


# make test-all's: a launch of its own (~15 s); Fuyu's head is also in make test's shared tp-2 check (MECHANISMS_44)
@pytest.mark.slow
@pytest.mark.launched
def test_the_checker_says_a_model_it_cannot_load_in_one_line_and_goes_on(tmp_path):
    """Emu3's text config has no class an Auto class builds: loading it raised in every rank, which ended the launch
    for every model after it (CRASH in the sweep); now one setup line, and Fuyu, after it, gets its eight checks.
    Fuyu itself: a composite config (its vocabulary in the text config: the checker's inputs raised AttributeError)
    whose `vision_embed_tokens` DeepSpeed's `set_lm_head` took for the input embedding: its bias became the
    shard-aware skeleton's output head ("IndexError: tuple index out of range")."""
    from test_policies_tp import KINDS, policy_check
    from transformers import AutoConfig

    from ds_inference_integration.tools.architecture_zoo import tiny_model

    # Emu3 saved by its causal-LM class, its text model alone: the sweep builds it as published now (its image-and-text
    # class, `sweep.published_class`), which loads, and this test failed with it from 2026-12-07
    tiny_model(sweep.shrink(AutoConfig.for_model("emu3"))).save_pretrained(tmp_path / "models" / "emu3")
    dirs = [tmp_path / "models" / "emu3", sweep.build("fuyu", tmp_path / "models")[0]]
    proc, report = policy_check(dirs, 2, tmp_path)
    assert report is not None and report["rank_failure"] is None, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_model = {}
    for c in report["checks"]:
        by_model.setdefault(c["model"], {})[c["check"]] = c
    (emu3,) = by_model["emu3"].values()
    assert emu3["check"] == "setup" and "does not load it as a generating model" in emu3["line"], emu3
    assert set(by_model["fuyu"]) == KINDS and all(c["passed"] for c in by_model["fuyu"].values()), by_model["fuyu"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_hybrid_keeps_a_layer_of_each_kind_and_latent_attention_fits():
    """Bailing-hybrid's default: linear attention in five layers of six, experts in groups of 8, multi-head latent
    attention of 64 + 128 wide heads. Two layers of its first kind were both linear attention (its own cache then
    refused the model), 8 groups of 4 experts none each ("shape '[-1, 8, 0]' is invalid")."""
    from transformers import AutoConfig

    config = sweep.shrink(AutoConfig.for_model("bailing_hybrid"))
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert config.num_hidden_layers == len(config.layer_types) == len(config.mlp_layer_types)
    assert set(config.mlp_layer_types) == {"dense", "sparse"} and config.n_group == 1
    assert (config.qk_rope_head_dim, config.qk_nope_head_dim, config.kv_lora_rank) == (16, 16, 32)


def test_per_layer_lists_are_cut_with_the_layers_and_shared_key_values_kept_valid():
    """Gemma 3n's default: 35 layers, per-layer inner sizes and activation sparsities, its last 15 layers reading
    earlier layers' keys and values. Its lists stayed 35 long and 15 shared layers of 2 refused the config ("The set
    of layer types producing a cache is different ..."): every list of one value per layer is cut to the picked
    layers (inner sizes made small), a consumer of each kind kept after its producers, as published (its first
    layers sparse). Lists of layer indices (Llama 4's `moe_layers`) are not taken for per-layer values."""
    from transformers import AutoConfig

    config = sweep.shrink(AutoConfig.for_model("gemma3n_text"))
    assert config.num_hidden_layers == 4 and config.num_kv_shared_layers == 2
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.intermediate_size == [256] * 4 and config.activation_sparsity_pattern == [0.95, 0.95, 0.0, 0.0]
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    llama4 = sweep.shrink(AutoConfig.for_model("llama4_text"))
    assert all(i < llama4.num_hidden_layers for i in llama4.moe_layers), llama4.moe_layers


def test_the_small_config_is_the_one_its_checkpoint_loads_back(tmp_path):
    """BLT's top config derives `encoder_cross_output_size` (a projection of the local encoder's width to the global
    transformer's) from its sub-configs in its own `__init__`: shrunk after it ran, the model was built without the
    projection and loaded with it ("MISSING", drawn again at each load); and the local encoder and decoder read the
    global width as `hidden_size_global` (left 2048: "mat1 and mat2 shapes cannot be multiplied")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = sweep.shrink(AutoConfig.for_model("blt"))
    assert config.encoder_config.hidden_size_global == config.global_config.hidden_size == 128
    assert config.global_config.encoder_cross_output_size == 2 * config.encoder_config.hidden_size
    directory, why = sweep.build("blt", tmp_path)
    built = dict(AutoModelForCausalLM.from_config(config).state_dict())
    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert sorted(built) == sorted(loaded) and all(built[k].shape == loaded[k].shape for k in built)


def test_the_sweep_command_refuses_bad_input_in_one_line(capsys):
    from ds_inference_integration.tools.cli import main

    assert main(["policy", "sweep", "--only", "llama,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only 'nope' is not a model type transformers generates with; valid: ")
    assert err.count("\n") == 1
    assert main(["policy", "sweep", "--tp-sizes", "2,x"]) == 2
    assert capsys.readouterr().err.startswith("error: --tp-sizes")
