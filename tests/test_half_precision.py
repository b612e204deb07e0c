"""`ds-inference policy check` in half precision (issue #28): the check runs in the checkpoint's dtype, and judges every
difference against the unsharded model's own rounding (its distance from the same model in fp32,
`tools/rounding.py`): shipped policies pass on bf16 checkpoints with their partings at near-ties reported; a split
wrong only in half precision fails naming the layer; fp16 on CPU ranks is one line."""

import json

import pytest
import torch
from test_policies_tp import HALF_SCALE, KINDS, faults_check, policy_check, policy_cli, shared_check, wrong_policy_check

from ds_inference_integration.policy.schema import POLICY_DIR, resolve_policy
from ds_inference_integration.tools import rounding
from ds_inference_integration.tools.architecture_zoo import ZOO, save_zoo

# Shipped policies in make test: one decoder, one encoder-decoder, a fused QKV and a multi-query attention;
# make test-all checks every shipped policy of the zoo.
QUICK = ["llama", "t5", "gpt2", "gpt_bigcode_mqa"]


def shipped_in_zoo() -> list[str]:
    found = []
    for name in ZOO:
        policy = resolve_policy("auto", ZOO[name]())
        if not isinstance(policy, str) and policy.source.resolve().parent == POLICY_DIR.resolve():
            found.append(name)
    return found


def test_the_zoo_has_shipped_policies_to_check():
    assert set(QUICK) <= set(shipped_in_zoo()) and len(shipped_in_zoo()) >= 15


# The bf16 checks of make test with the default flags, in one launch (`shared_check`): the quick set and the
# embedding DeepSpeed splits (test_an_embedding_deepspeed_splits_keeps_the_models_dtype)
BF16_DEFAULT = [*QUICK, "switch_transformers"]


@pytest.fixture
def bf16_check():
    return shared_check("policy-check-bf16", lambda root: save_zoo(root, BF16_DEFAULT, "bf16"))


@pytest.mark.parametrize("names", [QUICK, pytest.param(None, marks=pytest.mark.slow)], ids=["quick", "all_shipped"])
@pytest.mark.launched
def test_shipped_policies_pass_in_bf16_with_partings_at_near_ties_reported(names, tmp_path, request):
    """bf16 checkpoints, checked in their own dtype (no --dtype): every check passes on every rank; a row whose
    tokens part from one device is reported with the step, the reference's margin there and the logit difference,
    each within its bound; logits and hidden states within 2 x the unsharded bf16 model's own distance from fp32."""
    if names:
        proc, report, _ = request.getfixturevalue("bf16_check")
    else:
        names = shipped_in_zoo()
        proc, report = policy_check(save_zoo(tmp_path / "zoo", names, "bf16").values(), 2, tmp_path)
    assert proc.returncode == 0 and report["ok"], proc.stdout[-4000:]
    assert report["dtypes"] == ["bf16"] * len(report["models"]) and "tp 2, bf16)" in proc.stdout
    assert {(c["model"], c["check"]) for c in report["checks"]} == {(n, k) for n in report["models"] for k in KINDS}
    assert set(names) <= set(report["models"])
    partings = []
    for c in (c for c in report["checks"] if c["model"] in names):
        if c["check"] == "logits":
            assert "RMS distance from fp32" in c["line"] and c["data"]["ratio"] <= rounding.FACTOR
        if c["check"] in ("greedy", "beam", "sample") and not c["data"]["identical"]:
            assert "at a near-tie (rounding)" in c["line"] and c["data"]["ranks_agree"], c["line"]
            partings += c["data"]["partings"]
    # On this machine's CPU the zoo's tiny bf16 models part at near-ties (beam search of t5 and gpt2 in the quick
    # set, 2026-12-04); each parting carries its figures
    assert partings and all(p["near_tie"] and p["logit_diff"] is not None and p["top2_margin"] is not None
                            for p in partings)


@pytest.mark.launched
def test_a_split_wrong_only_in_half_precision_fails_naming_the_layer():
    """A fault scales rank 1's part of layer 1's down projection by 1.2 after sharding, in half precision only (a
    scale applied twice on one rank): checked in fp32 it is invisible (the fault does not fire) and every check
    passes; checked in bf16, the logits and hidden states fail (and any token check that fails), each naming
    model.layers.1, where the error first exceeds the rounding bound, on both ranks. One launch: the bf16
    checkpoint and an fp32 one of the same model, each checked in its own dtype, beside the T5 of
    test_policy_check_counts_every_rank_and_leaves_no_temporary_files (`faults_check`)."""
    assert HALF_SCALE.endswith("layers.1.mlp.down_proj:1.2")
    proc, report, _ = faults_check()
    assert report["models"] == ["llama_fp32", "llama", "t5"] and report["dtypes"] == ["fp32", "bf16", "fp32"], \
        proc.stdout[-3000:]
    fp32 = [c for c in report["checks"] if c["model"] == "llama_fp32"]
    assert len(fp32) == len(KINDS) and all(c["passed"] for c in fp32), proc.stdout[-3000:]
    assert proc.returncode == 1 and not report["ok"], proc.stdout[-3000:]
    failed = {c["check"]: c for c in report["checks"] if not c["passed"] and c["model"] != "t5"}
    assert all(c["model"] == "llama" for c in failed.values())
    assert {"logits", "hidden_states"} <= set(failed), proc.stdout[-3000:]
    assert failed["hidden_states"]["data"]["layer"] == "model.layers.1"
    # (the loading checks compare paths the fault reaches differently: it scales every sharded copy it sees)
    numeric = [c for kind, c in failed.items() if kind in ("logits", "hidden_states", "greedy", "beam", "sample")]
    assert all("model.layers.1" in c["line"] and c["failed_ranks"] == [0, 1] for c in numeric)
    assert failed["logits"]["data"]["ratio"] > 2 * rounding.FACTOR  # measured 4.8: far from the bound, not at it
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.launched
def test_a_wrong_policy_is_one_fail_line_in_bf16_too():
    """The existing wrong policy (OPT without fc2 row-parallel), on a bf16 checkpoint: one FAIL line naming fc2.
    (The check is test_policies_tp.py's `wrong_policy_check`, whose third model is this one.)"""
    proc, report = wrong_policy_check()
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["dtypes"][report["models"].index("opt_bf16")] == "bf16"
    failed = [c for c in report["checks"] if not c["passed"] and c["model"] == "opt_bf16"]
    assert [c["check"] for c in failed] == ["sharded_forward"] and "fc2" in failed[0]["line"]


@pytest.mark.launched
def test_fp16_on_cpu_ranks_is_one_line_before_any_rank_starts(tmp_path):
    model = save_zoo(tmp_path / "zoo", ["llama"])["llama"]
    proc = policy_cli("check", str(model), "--tp-size", "2", "--dtype", "fp16", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --dtype fp16: DeepSpeed's CPU accelerator supports fp32 and bf16 only")
    assert len(proc.stderr.strip().splitlines()) == 1
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "float16"
    (model / "config.json").write_text(json.dumps(config))
    proc = policy_cli("check", str(model), "--tp-size", "2", timeout=60)
    assert proc.returncode == 2 and "is float16 (its config)" in proc.stderr


# The verdict on tokens, in process --------------------------------------------------------------------------

def _run(ids, steps):
    return {"ids": torch.tensor(ids), "steps": torch.tensor(steps, dtype=torch.float32)}


def test_a_parting_at_a_near_tie_passes_and_one_with_a_clear_margin_fails():
    # one row, prompt of 1 token, 2 new tokens over a vocabulary of 3; the runs part at new token 1
    want = _run([[0, 2, 1]], [[[0.0, 0.0, 5.0], [0.0, 1.00, 0.98]]])
    near = _run([[0, 2, 2]], [[[0.0, 0.0, 5.0], [0.0, 0.99, 1.00]]])
    ok, text, data = rounding.token_verdict("greedy", near, want, logit_bound=0.05)
    assert ok and "1 of 1 rows part from unsharded, first at (row 0, new token 1) at a near-tie" in text
    assert data["partings"][0]["top2_margin"] == pytest.approx(0.02)
    clear = _run([[0, 2, 2]], [[[0.0, 0.0, 5.0], [0.0, 0.2, 1.0]]])  # logits there differ by 0.8
    ok, text, _ = rounding.token_verdict("greedy", clear, want, logit_bound=0.05)
    assert not ok and "beyond rounding" in text
    # greedy: the same logits, but the reference's margin to the sharded token is far above 2 x the bound
    wide = _run([[0, 2, 1]], [[[0.0, 0.0, 5.0], [0.0, 1.0, 0.0]]])
    odd = _run([[0, 2, 2]], [[[0.0, 0.0, 5.0], [0.0, 1.0, 0.0]]])
    assert not rounding.token_verdict("greedy", odd, wide, logit_bound=0.05)[0]
    assert rounding.token_verdict("sample", odd, wide, logit_bound=0.05)[0]  # a seeded draw may cross anywhere
    assert rounding.token_verdict("beam", want, want, 0.05) == (True, "beam token ids: identical to unsharded",
                                                                {"identical": True, "partings": []})


# Loading in half precision -----------------------------------------------------------------------------------

# launched: RWKV's modeling asks `ninja --version` (transformers' is_ninja_available) when it loads
@pytest.mark.launched
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_the_skeleton_makes_every_buffer_as_from_pretrained_does(dtype, tmp_path):
    """Shard-aware and pre-sharded loading build the model on meta with real buffers (`loading.build_skeleton`):
    every buffer of every model of the zoo must equal, bitwise and in dtype, what `from_pretrained` makes on one
    device. In bf16 GPT-J's and CodeGen's sinusoidal positions and MiniMax's decays differed (computed under bf16
    where from_pretrained computes them again in fp32): their greedy ids through shard-aware loading differed from
    the full load."""
    from transformers import AutoConfig

    from ds_inference_integration.load.skeleton import build_skeleton, model_class_for

    different = []
    for name in ZOO:
        model_dir = save_zoo(tmp_path, [name], dtype)[name]
        config = AutoConfig.from_pretrained(model_dir)
        cls = model_class_for(config)
        one_device = cls.from_pretrained(model_dir, dtype=rounding.DTYPES[dtype])
        skeleton = build_skeleton(cls, config, rounding.DTYPES[dtype], model_dir)
        mine = dict(skeleton.named_buffers())
        for key, want in one_device.named_buffers():
            got = mine.get(key)
            if got is None or got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                different.append(f"{name}: {key}")
    assert not different, different


# --reduce_dtype fp32 ------------------------------------------------------------------------------------------

def test_fp32_sums_round_a_row_parallel_layer_once_as_one_device_does(monkeypatch):
    """A row-parallel layer over 2 ranks (threads; the all-reduce sums their tensors), in bf16: with the partial
    products rounded to bf16 before the sum, many outputs differ from one device's `F.linear` (which accumulates in
    fp32 and rounds once); with `reduction.reduce_in_fp32`, the partials stay fp32 and the sum is rounded once:
    (almost) none differ, and none by more than one rounding step."""
    import threading

    from deepspeed import comm
    from test_mixers import ThreadRanks
    from torch import nn
    from torch.nn import functional as F

    from ds_inference_integration.shard.mixers import RowShard
    from ds_inference_integration.shard.reduction import reduce_in_fp32

    torch.manual_seed(0)
    weight = torch.randn(64, 512).to(torch.bfloat16)
    x = torch.randn(4, 16, 512).to(torch.bfloat16)
    one_device = F.linear(x, weight)
    monkeypatch.setattr(comm, "inference_all_reduce", ThreadRanks.all_reduce)
    differing = {}
    for fp32 in (False, True):
        ranks, outs = ThreadRanks(2), [None, None]

        def rank(r):
            holder = nn.Sequential(RowShard(weight[:, r * 256:(r + 1) * 256], None, ranks.handle(r)))
            if fp32:
                assert reduce_in_fp32(holder) == 1
            outs[r] = holder(x[..., r * 256:(r + 1) * 256])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert torch.equal(outs[0], outs[1]) and outs[0].dtype == torch.bfloat16
        differing[fp32] = (outs[0] != one_device).float().mean().item()
        step = (outs[0].float() - one_device.float()).abs() / one_device.float().abs().clamp(min=1e-3)
        if fp32:
            assert step.max().item() <= torch.finfo(torch.bfloat16).eps
    assert differing[False] > 0.1 and differing[True] < 0.01, differing


@pytest.mark.launched
def test_fp32_sums_through_deepspeeds_row_parallel_layers_pass_the_verdict(tmp_path):
    """`--reduce-dtype fp32` (the run's --reduce_dtype) on two shipped policies whose row-parallel layers are
    DeepSpeed's LinearAllreduce (Llama; GPT-2 after its Conv1D layers become linears): every check passes, both
    loading paths included, and the sharded model is no further from fp32 than one device is (ratio <= 1.1)."""
    dirs = save_zoo(tmp_path / "zoo", ["llama", "gpt2"], "bf16")
    proc, report = policy_check(dirs.values(), 2, tmp_path, "--reduce-dtype", "fp32")
    assert proc.returncode == 0 and report["ok"], proc.stdout[-3000:]
    ratios = [c["data"]["ratio"] for c in report["checks"] if c["check"] == "logits"]
    assert len(ratios) == 2 and max(ratios) <= 1.1, ratios


@pytest.mark.launched
def test_an_embedding_deepspeed_splits_keeps_the_models_dtype(bf16_check):
    """DeepSpeed 0.19.8 builds the embedding it splits (SwitchTransformers' `relative_attention_bias`) in the default
    dtype, fp32, inside a bf16 model, and the sharded forward failed ("expected m1 and m2 to have the same dtype");
    `deepspeed_compat.restore_parameter_dtypes` gives it back its dtype: every check passes in bf16 at tp 2."""
    proc, report, _ = bf16_check
    assert proc.returncode == 0 and report["ok"], proc.stdout[-3000:]
    assert "switch_transformers" in report["models"] and report["dtypes"] == ["bf16"] * len(report["models"])
