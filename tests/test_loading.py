"""Load only your shard (#6): the safetensors slice reader, the skeleton built on meta, path choice and
fallback, `ds-inference shard` and its pre-sharded directories, and the memory benchmark's command.

Numerical identity of every loading path with the naive one, for every policy family at tp 2 and
tp 4, is checked by `ds-inference policy check` in test_policies_tp.py (two lines per model)."""

import json
import shutil
import subprocess

import pytest
import torch
from conftest import BIN, DEFAULT_MODEL, TRANSLATE_ARGS, assert_ok, run_example
from safetensors.torch import load_file, save_file
from tiny_models import save_decoder

from ds_inference_integration.arguments import DeepSpeedInferenceArguments, InferenceSetupError
from ds_inference_integration.checkpoint import SafetensorsCheckpoint, checkpoint_files, ranges_of
from ds_inference_integration.loading import check_manifest, is_skeleton, load_model, read_manifest

ON = DeepSpeedInferenceArguments(deepspeed_inference=True)


def cli(*args, timeout=300):
    return subprocess.run([str(BIN / "ds-inference"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reader_returns_exactly_the_selected_rows_and_columns(tmp_path, dtype, monkeypatch):
    import ds_inference_integration.checkpoint as ckpt_module

    monkeypatch.setattr(ckpt_module, "CHUNK_BYTES", 50_000)  # force several chunks per read
    torch.manual_seed(0)
    w = torch.randn(300, 3000).to(dtype)
    save_file({"w": w, "b": torch.randn(7), "e": torch.randn(2, 3, 4)}, str(tmp_path / "model.safetensors"))
    ck = SafetensorsCheckpoint.open(tmp_path)
    rows = [(3, 9), (20, 300)]
    picked = torch.cat([w[a:b] for a, b in rows])
    # long column runs (read row by row, only their bytes) and short ones (whole rows, then cut)
    for cols in ([(0, 1100), (2000, 3000)], [(5, 10)], [(1024, 2048)]):
        got = ck.read("w", rows=rows, cols=cols)
        assert torch.equal(got, torch.cat([picked[:, a:b] for a, b in cols], dim=1))
    before = ck.bytes_read
    ck.read("w", cols=[(500, 3000)])  # runs of at least a page: nothing beyond the kept columns is read
    assert ck.bytes_read - before == 300 * 2500 * w.element_size()
    assert torch.equal(ck.read("w", dtype=torch.float32), w.float())
    assert torch.equal(ck.read("e", rows=[(1, 2)]), load_file(tmp_path / "model.safetensors")["e"][1:2])
    assert ranges_of([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]


def test_skeleton_is_on_meta_with_real_buffers_and_index_checkpoints_work(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_decoder("llama_kv2", tmp_path)
    sharded = tmp_path / "llama_index"
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="300KB")
    assert len(checkpoint_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").is_file()
    full = AutoModelForCausalLM.from_pretrained(sharded)
    skeleton = load_model(AutoModelForCausalLM, sharded, inference_args=ON)
    assert is_skeleton(skeleton)
    assert all(p.is_meta for p in skeleton.parameters())  # no memory, no random init
    inv_freq = dict(skeleton.named_buffers())["model.rotary_emb.inv_freq"]
    assert not inv_freq.is_meta and torch.equal(inv_freq, dict(full.named_buffers())["model.rotary_emb.inv_freq"])
    loader = skeleton._ds_inference_loader
    assert set(loader.key_of) == {n for n, _ in full.named_parameters()}
    # without the flag, load_model is from_pretrained
    plain = load_model(AutoModelForCausalLM, sharded)
    assert not is_skeleton(plain) and torch.equal(plain.lm_head.weight, full.lm_head.weight)


def test_checkpoint_without_safetensors_falls_back_or_fails_clearly(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    path = save_decoder("opt", tmp_path)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    model = load_model(AutoModelForCausalLM, path, inference_args=ON)
    assert not is_skeleton(model)
    assert "model loaded full on every rank (no safetensors weights)" in caplog.text
    with pytest.raises(InferenceSetupError, match="--loading shard-aware: .*no safetensors weights; valid here: --loading full"):
        load_model(AutoModelForCausalLM, path, inference_args=ON, mode="shard-aware")


@pytest.fixture(scope="module")
def presharded(tmp_path_factory):
    """The embedded translation model, copied, and pre-sharded for tp 2 by the command."""
    root = tmp_path_factory.mktemp("preshard")
    src = root / "t5"
    shutil.copytree(DEFAULT_MODEL, src)
    proc = cli("shard", str(src), "--tp-size", "2", str(root / "t5_tp2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return src, root / "t5_tp2", proc.stdout


def test_shard_command_writes_one_file_per_rank_and_a_manifest(presharded):
    src, out, stdout = presharded
    manifest = read_manifest(out)
    assert manifest["tp_size"] == 2 and manifest["files"] == [f"rank-{r:05d}-of-00002.safetensors" for r in (0, 1)]
    assert manifest["policy"].startswith("t5:") and len(manifest["source"]["sha256"]) == 64
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    full = sum(t.numel() for t in load_file(src / "model.safetensors").values())
    per_rank = [sum(t.numel() for t in load_file(out / f).values()) for f in manifest["files"]]
    assert all(0.45 * full < n < 0.65 * full for n in per_rank), (per_rank, full)  # about half each
    assert "wrote" in stdout and "2 rank files" in stdout


def test_presharded_predictions_equal_the_source_and_mismatches_fail_clearly(presharded, tmp_path):
    src, out, _ = presharded
    args = ["--do_predict", "--max_predict_samples", "24", "--per_device_eval_batch_size", "8", *TRANSLATE_ARGS]
    ref = run_example(["--model_name_or_path", str(src), *args], tmp_path / "ref")
    assert_ok(ref)
    tp = run_example(["--model_name_or_path", str(out), *args, "--deepspeed_inference"], tmp_path / "tp", nprocs=2)
    assert_ok(tp)
    assert tp.predictions() == ref.predictions() and len(ref.predictions()) == 24
    assert tp.output.count("model loaded pre-sharded: read") == 2  # one line per rank, naming the path
    manifest = read_manifest(out)
    with pytest.raises(InferenceSetupError, match=r"pre-sharded for --tp_size 2, this run has tp 4: re-run"):
        check_manifest(manifest, out, 4, manifest["policy"])
    with pytest.raises(InferenceSetupError, match="sharded with policy"):
        check_manifest(manifest, out, 2, "autotp")
    # a changed source checkpoint: same shapes, one value different
    state = load_file(src / "model.safetensors")
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InferenceSetupError, match="the source checkpoint .* changed since .* was sharded"):
        check_manifest(manifest, out, 2, manifest["policy"])
    # end to end, one process (a world of one: tp 1): one line naming both tp sizes, exit 2, no traceback
    bad = run_example(["--model_name_or_path", str(out), *args, "--deepspeed_inference"], tmp_path / "bad")
    assert bad.returncode == 2
    assert "is pre-sharded for --tp_size 2, this run has tp 1" in bad.output and "Traceback" not in bad.output


def test_shard_command_rejects_bad_input(tmp_path):
    proc = cli("shard", str(tmp_path / "nothing"), "--tp-size", "2", str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not a model directory (no config.json)" in proc.stderr
    proc = cli("shard", str(DEFAULT_MODEL), "--tp-size", "2", str(tmp_path / "out"), "--dtype", "fp8")
    assert proc.returncode == 2 and "--dtype 'fp8' is invalid; valid: fp32, fp16, bf16" in proc.stderr


@pytest.mark.slow  # 5 launches, about 50 s: `make test-all` runs it
def test_bench_memory_runs_every_path_and_compares_tokens(tmp_path):
    proc = cli("bench", "memory", "--config", "128,2,4,256,96", "--tp-size", "2", "--output-dir", str(tmp_path),
               timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_memory.json").read_text())
    modes = [r["mode"] for r in result["rows"]]
    assert modes == ["single", "full", "full", "shard-aware", "shard-aware", "pre-sharded", "pre-sharded"]
    assert result["tokens_identical"] is True
    assert all(r["peak_rss_mb"] > r["baseline_rss_mb"] > 0 and r["ready_s"] > 0 for r in result["rows"])
    assert "model loaded shard-aware" in next(r for r in result["rows"] if r["mode"] == "shard-aware")["report"]
    assert (tmp_path / "bench_memory.md").read_text().count("| pre-sharded |") == 2
