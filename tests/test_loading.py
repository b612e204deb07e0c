"""Load only your shard (#6): the safetensors slice reader, the skeleton built on meta, path choice and
fallback, `ds-inference shard` and its pre-sharded directories, and the memory benchmark's command.

Numerical identity of every loading path with the naive one, for every policy family at tp 2 and
tp 4, is checked by `ds-inference policy check` in test_policies_tp.py (two lines per model)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import BIN, DEFAULT_MODEL, TRANSLATE_ARGS, WORKERS, once_per_run, run_example
from ds_inference_integration.arguments import DeepSpeedInferenceArguments, InferenceSetupError
from ds_inference_integration.load.checkpoint import SafetensorsCheckpoint, checkpoint_files
from ds_inference_integration.load.loaders import is_skeleton, load_model, pending_load
from ds_inference_integration.load.slices import ranges_of
from ds_inference_integration.run.ranks import free_port
from tiny_models import save_decoder

ON = DeepSpeedInferenceArguments(deepspeed_inference=True)




def cli(*args, timeout=300, env=None):
    import os

    return subprocess.run([str(BIN / "ds-inference"), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reader_returns_exactly_the_selected_rows_and_columns(tmp_path, dtype, monkeypatch):
    import ds_inference_integration.load.checkpoint as ckpt_module

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


def test_deepspeeds_record_of_a_split_becomes_the_one_record_the_loaders_read():
    """DeepSpeed records its splits as an affine map on each parameter; `slices.from_deepspeed` turns it into the
    record every other split leaves (`TensorSlices`), which is what the loaders read. For DeepSpeed's own maps
    (column- and row-parallel, uneven, fused QKV, blocks gathered from two runs), every rank's record cuts from the
    full tensor exactly what DeepSpeed's own `extract` gives that rank; a layout it cannot read is one line naming the
    parameter and --loading full."""
    from deepspeed.checkpoint.affine import block_gather_map, contiguous_split_map, sub_param_map
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    from ds_inference_integration.load.slices import from_deepspeed, take

    def held(amap, rank):
        entry = amap.to_dict()
        p = torch.empty(tuple(entry["ranks"][rank]["shard_shape"]), device="meta")
        setattr(p, DS_AUTOTP_UC_META, {"conversion": {"affine_map": entry}})
        return p

    maps = {"column": contiguous_split_map((12, 5), [6, 6], 0), "row": contiguous_split_map((4, 10), [5, 5], 1),
            "uneven": contiguous_split_map((10, 3), [4, 3, 3], 0), "bias": contiguous_split_map((8,), [4, 4], 0),
            "fused_qkv": sub_param_map(shape=(12, 4), sub_dim_sizes=[4, 4, 4], shard_widths=[[2, 2]] * 3,
                                       partition_dim=0),
            "gathered": block_gather_map((8, 2), {0: [0, 3], 1: [1, 2]}, 2, 0)}
    for kind, amap in maps.items():
        full = torch.arange(torch.Size(amap.logical_shape).numel(), dtype=torch.float32).reshape(amap.logical_shape)
        for rank in amap.shard_shapes:
            slices = from_deepspeed(f"{kind}.weight", held(amap, rank), tuple(amap.logical_shape), rank)
            assert torch.equal(take(full, slices.dim, slices.ranges), amap.extract(full, rank)), (kind, rank, slices)
    assert from_deepspeed("w", held(maps["fused_qkv"], 1), (12, 4), 1).ranges == ((2, 4), (6, 8), (10, 12))

    def refused(p, full, rank, says):
        with pytest.raises(InferenceSetupError) as e:
            from_deepspeed("layers.0.w", p, full, rank)
        assert "layers.0.w" in str(e.value) and says in str(e.value) and "--loading full" in str(e.value), e.value

    refused(torch.empty(6, 5, device="meta"), (12, 5), 0, "recorded no layout")
    refused(held(maps["column"], 0), (12, 6), 0, "recorded no layout")  # a map of another tensor
    corner = held(maps["column"], 0)  # a block cut along both dimensions
    getattr(corner, DS_AUTOTP_UC_META)["conversion"]["affine_map"]["ranks"][0]["pieces"][0]["shape"] = [6, 4]
    refused(corner, (12, 5), 0, "not a run of blocks along one dimension")
    scaled = held(maps["column"], 1)
    getattr(scaled, DS_AUTOTP_UC_META)["conversion"]["affine_map"]["ranks"][1]["pieces"][0]["scale"] = 0.5
    refused(scaled, (12, 5), 1, "scaled by 0.5")


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
    loader = pending_load(skeleton).loader
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


def test_a_checkpoint_that_needs_a_conversion_is_refused_shard_aware_with_the_reason_typed(tmp_path, caplog):
    """Kimi-Linear's convolutions are converted at load: shard-aware reading refuses them, and the refusal says so by
    its type (`needs_conversion`, what `policy check` falls back to a full load on, as `--loading auto` does),
    not only in its words; a refusal for another reason (no safetensors) is not one."""
    from transformers import AutoModelForCausalLM

    from ds_inference_integration.tools.architecture_zoo import save_zoo

    path = save_zoo(tmp_path, ["kimi_linear"])["kimi_linear"]
    with pytest.raises(InferenceSetupError, match="needs conversion") as refused:
        load_model(AutoModelForCausalLM, path, inference_args=ON, mode="shard-aware")
    assert refused.value.needs_conversion is True
    model = load_model(AutoModelForCausalLM, path, inference_args=ON)  # auto: loaded full, and said
    assert not is_skeleton(model) and "needs conversion" in caplog.text
    (path / "model.safetensors").rename(path / "elsewhere.bin")
    with pytest.raises(InferenceSetupError, match="no safetensors weights") as refused:
        load_model(AutoModelForCausalLM, path, inference_args=ON, mode="shard-aware")
    assert refused.value.needs_conversion is False


@pytest.mark.launched
def test_shard_command_writes_one_file_per_rank_and_a_manifest(presharded):
    from ds_inference_integration.load.presharded import read_manifest

    src, out, stdout = presharded
    manifest = read_manifest(out)
    names = [f"rank-{r:05d}-of-00002.safetensors" for r in (0, 1)]
    assert manifest["tp_size"] == 2 and [f["name"] for f in manifest["files"]] == names
    assert manifest["policy"].startswith("t5:") and len(manifest["source"]["sha256"]) == 64
    for record in manifest["files"]:  # size, content hash and rank of each file, and the rank inside the file
        path = out / record["name"]
        assert record["bytes"] == path.stat().st_size and len(record["sha256"]) == 64
        meta = SafetensorsCheckpoint([path]).metadata[path]
        assert (meta["tp_rank"], meta["tp_size"], meta["shard_id"]) == (str(record["rank"]), "2", manifest["shard_id"])
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "pytorch_model.bin").exists() and not list(out.glob(".*.tmp"))
    full = sum(t.numel() for t in load_file(src / "model.safetensors").values())
    per_rank = [sum(t.numel() for t in load_file(out / f).values()) for f in names]
    assert all(0.45 * full < n < 0.65 * full for n in per_rank), (per_rank, full)  # about half each
    assert "wrote" in stdout and "2 rank files" in stdout


# The predictions of a pre-sharded directory equal its source's: test_translation_tp.py's proposal command runs on
# this directory (one tp-2 launch and one reference fewer: 19 CPU-s of a suite over its 10 minutes, 2026-12-06)
@pytest.mark.launched
def test_a_damaged_rank_file_stops_every_rank_before_generating(presharded, tmp_path):
    """A damaged rank-1 file, which only rank 1 hashes: both ranks stop with the same line, before generating."""
    args = ["--do_predict", "--max_predict_samples", "24", "--per_device_eval_batch_size", "8", *TRANSLATE_ARGS]
    _, damaged, manifest = _copy(presharded, tmp_path / "copy")
    _rewrite(damaged / manifest["files"][1]["name"], _bump)
    run = run_example(["--model_name_or_path", str(damaged), *args, "--deepspeed_inference"], tmp_path / "damaged",
                      nprocs=2, launcher="deepspeed")  # which adds no traceback of its own (torchrun does)
    assert run.returncode != 0 and "Traceback" not in run.output
    errors = run.error_lines()
    assert sorted(e.rsplit(" [rank ", 1)[1] for e in errors) == ["0]", "1]"], run.output[-3000:]
    assert all("does not hold what was written (sha256 differs" in e and "(found by TP rank 1)" in e for e in errors)
    assert not (tmp_path / "damaged" / "predict_results.json").exists()


def _copy(presharded, tmp_path):
    """A copy of the source and of its pre-sharded directory (the copy's manifest points at the copied source)."""
    import json

    src, out, _ = presharded
    tmp_path.mkdir(exist_ok=True)
    shutil.copytree(src, tmp_path / "t5")
    shutil.copytree(out, tmp_path / "t5_tp2")
    manifest = json.loads((tmp_path / "t5_tp2" / "manifest.json").read_text())
    manifest["source"]["path"] = str(tmp_path / "t5")
    (tmp_path / "t5_tp2" / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "t5", tmp_path / "t5_tp2", manifest


def _problem(out, manifest, rank):
    from ds_inference_integration.load.presharded import verify_rank_files

    return verify_rank_files(manifest, out, rank)


@pytest.mark.launched
def test_presharded_directory_that_does_not_fit_the_run_is_refused(presharded, tmp_path):
    from ds_inference_integration.load.presharded import check_manifest

    src, out, manifest = _copy(presharded, tmp_path)
    policy, f32 = manifest["policy"], torch.float32
    check_manifest(manifest, out, 2, policy, f32)
    assert _problem(out, manifest, 0) is None and _problem(out, manifest, 1) is None  # a copy: hashed, and equal
    with pytest.raises(InferenceSetupError, match=r"pre-sharded for --tp_size 2, this run has tp 4: re-run"):
        check_manifest(manifest, out, 4, policy, f32)
    with pytest.raises(InferenceSetupError, match="sharded with policy"):
        check_manifest(manifest, out, 2, "autotp", f32)
    with pytest.raises(InferenceSetupError, match="was sharded in float32, this run uses bfloat16: pass --inference_dtype fp32"):
        check_manifest(manifest, out, 2, policy, torch.bfloat16)
    outside = {**manifest, "files": [{**manifest["files"][0], "name": "../t5/model.safetensors"}, manifest["files"][1]]}
    with pytest.raises(InferenceSetupError, match="outside the model directory"):
        check_manifest(outside, out, 2, policy, f32)
    # a changed source checkpoint: same shapes, one value different
    state = load_file(src / "model.safetensors")
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InferenceSetupError, match="the source checkpoint .* changed since .* was sharded"):
        check_manifest(manifest, out, 2, policy, f32)


def _rewrite(path, change=None, metadata=None):
    """Re-save a rank file: `change` edits its tensors, `metadata` its safetensors metadata."""
    ck = SafetensorsCheckpoint([path])
    meta = {**ck.metadata[path], **(metadata or {})}
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    if change:
        change(tensors)
    save_file(tensors, str(path), metadata=meta)


def _bump(tensors):
    name = sorted(tensors)[5]
    tensors[name].view(-1)[0] += 1


@pytest.mark.parametrize("case", ["other_model", "forged_metadata", "corrupted", "half_reshard", "swapped_ranks",
                                  "missing_file", "truncated"])
@pytest.mark.launched
def test_mixed_or_damaged_rank_files_are_refused(presharded, tmp_path, case):
    import os

    src, out, manifest = _copy(presharded, tmp_path)
    r0, r1 = (out / f["name"] for f in manifest["files"])
    if case == "other_model":  # another model's rank file with the same shapes, from another sharding
        _rewrite(r1, _bump, {"shard_id": "0" * 32})
        expect, rank = "belongs to another sharding (shard_id", 0
    elif case == "forged_metadata":  # the same, claiming this sharding's id: only the content hash can tell
        _rewrite(r1, _bump)
        expect, rank = "does not hold what was written (sha256 differs", 1
    elif case == "corrupted":  # bytes changed inside the data, same size, header intact
        raw = bytearray(r0.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        r0.write_bytes(bytes(raw))
        expect, rank = "does not hold what was written", 0
    elif case == "half_reshard":  # old manifest, new rank 0 (an interrupted re-shard of changed weights)
        _rewrite(r0, _bump, {"shard_id": "1" * 32})
        expect, rank = "belongs to another sharding (shard_id", 1
    elif case == "swapped_ranks":
        os.replace(r0, tmp_path / "r0")
        os.replace(r1, r0)
        os.replace(tmp_path / "r0", r1)
        expect, rank = "belongs to another sharding (tp_rank", 0
    elif case == "missing_file":
        r1.unlink()
        expect, rank = "is missing", 0
    else:
        r1.write_bytes(r1.read_bytes()[:-64])
        expect, rank = "bytes, the manifest recorded", 0
    problem = _problem(out, manifest, rank)
    assert problem is not None and expect in problem, problem


@pytest.mark.launched
def test_interrupted_shard_leaves_a_directory_that_is_refused_and_can_be_redone(presharded, tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    src, out, manifest = _copy(presharded, tmp_path)
    (out / "manifest.json").unlink()  # what `shard` does first; a run killed before the end leaves this
    with pytest.raises(InferenceSetupError, match="has rank files but no manifest.json: an interrupted"):
        load_model(AutoModelForSeq2SeqLM, out, inference_args=ON)
    (out / "manifest.json").write_text('{"format": "ds-inference-presharded/1", "tp_size": 2}')
    with pytest.raises(InferenceSetupError, match="has format 'ds-inference-presharded/1', this version reads"):
        load_model(AutoModelForSeq2SeqLM, out, inference_args=ON)
    # a re-run over it is allowed; a bad policy file is refused before anything is touched, and a run that
    # gets as far as starting ranks has removed the old manifest first
    proc = cli("shard", str(src), "--tp-size", "2", str(out), "--policy", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --injection_policy")
    import ds_inference_integration.tools.shard_command as preshard

    (out / "manifest.json").write_text(json.dumps(manifest))
    seen = []

    def fail_to_start(*args, **kwargs):
        seen.append((out / "manifest.json").exists())
        raise RuntimeError("no ranks today")

    monkeypatch.setattr(preshard, "start_ranks", fail_to_start)
    with pytest.raises(RuntimeError, match="no ranks today"):
        preshard.run_shard(str(src), 2, str(out))
    assert seen == [False] and not (out / "manifest.json").exists()


@pytest.mark.launched
def test_shard_command_rejects_bad_input(tmp_path):
    proc = cli("shard", str(tmp_path / "nothing"), "--tp-size", "2", str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not a model directory (no config.json)" in proc.stderr
    proc = cli("shard", str(DEFAULT_MODEL), "--tp-size", "2", str(tmp_path / "out"), "--dtype", "fp8")
    assert proc.returncode == 2 and "--dtype 'fp8' is invalid; valid: fp32, fp16, bf16" in proc.stderr


# make test keeps one model per mechanism (T5 at tp 4: a gathered bias of one head per rank; Kyutai: the generate
# probe and a layer it never runs; BigBird: the switched attention); T5 at tp 2, MPT's and LongT5's other bias layouts
# at tp 2 and 4, and Gemma 3's tower are make test-all's
@pytest.mark.parametrize("name, tp", [("t5", 4), ("kyutai_speech_to_text", 2), ("big_bird", 2), *(
    pytest.param(n, tp, marks=pytest.mark.slow) for n, tp in (("t5", 2), ("mpt", 2), ("mpt", 4), ("longt5", 2),
                                                              ("longt5", 4), ("gemma3", 2)))])
@pytest.mark.launched
def test_the_check_of_a_derived_policy_at_load_passes_a_right_one(tmp_path, name, tp):
    """What predict and the server run before using a derived policy (`verify_sharded_layers`, here through
    `ds-inference shard`): T5's later blocks read the position bias its first block makes, split with the
    heads, MPT's blocks the ALiBi bias of this rank's heads and LongT5's its local attention's bias, which the
    unsharded copy could not add (refused: "gives wrong results ... the unsharded layer fails on the inputs the
    sharded model gives it", though `policy check` passes the policy); each rank's part is gathered for the copy
    where the ranks' parts differ. At tp 4 each rank's one head broadcast over the copy's four without an error, so
    the gathering, tried only where the copy failed, was not tried (refused again: "differs from the unsharded
    layer", MPT, LongT5, Pop2Piano at tp 4, 2026-12-07).
    Kyutai's speech-to-text generates only from audio: its probe is two steps of its generate, each layer compared on
    its first call (the second's cache holds this rank's heads), and its codec's decoder, which speech-to-text never
    runs, said as not checked; Gemma 3's vision tower, which a text probe does not run, likewise (its run was
    refused: "not reached by the probe").
    BigBird's model switches its layers to full attention for a short input while it runs: the copy, left
    block-sparse, refused the probe's 8 tokens; it is switched as its sharded twin was."""
    from ds_inference_integration.tools.architecture_zoo import ZOO, tiny_model

    tiny_model(ZOO[name]()).save_pretrained(tmp_path / "model")
    proc = cli("shard", str(tmp_path / "model"), "--tp-size", str(tp), "--policy", "derive", str(tmp_path / "out"),
               env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checked numerically" in proc.stdout + proc.stderr and (tmp_path / "out" / "manifest.json").is_file()
    if name == "kyutai_speech_to_text":
        assert "not run by the probe (the model's generate), so not checked: codec_model.decoder" in proc.stdout + \
            proc.stderr
    if name == "gemma3":
        assert "not run by the probe, so not checked: model.vision_tower" in proc.stdout + proc.stderr


@pytest.mark.launched
def test_shard_command_loads_full_a_checkpoint_that_needs_a_conversion(tmp_path):
    """Kimi-Linear's convolutions are converted by transformers at load, so they cannot be read shard-aware: the
    command refused the model, its error naming `--loading full`, an option it does not have. It loads such a
    checkpoint full on every rank, as a run's `--loading auto` does, says so in one warning line, and writes the
    rank files."""
    from ds_inference_integration.tools.architecture_zoo import ZOO, tiny_model

    tiny_model(ZOO["kimi_linear"]()).save_pretrained(tmp_path / "model")
    proc = cli("shard", str(tmp_path / "model"), "--tp-size", "2", str(tmp_path / "out"), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "k_conv1d.weight needs conversion" in warnings[0], warnings
    assert warnings[0].endswith(": loaded full on every rank") and "--loading" not in warnings[0], warnings
    assert sorted(p.name for p in (tmp_path / "out").glob("rank-*")) == ["rank-00000-of-00002.safetensors",
                                                                         "rank-00001-of-00002.safetensors"]


@pytest.mark.slow  # 5 launches, about 50 s: `make test-all` runs it
@pytest.mark.launched
def test_bench_memory_runs_every_path_and_compares_tokens(tmp_path):
    (tmp_path / "tmp").mkdir()
    proc = cli("bench", "memory", "--config", "128,2,4,256,96", "--tp-size", "2", "--output-dir", str(tmp_path),
               "--repeats", "2", timeout=600, env={"TMPDIR": str(tmp_path / "tmp")})
    assert not list((tmp_path / "tmp").glob("bench_memory_*"))  # the model and its copies are removed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_memory.json").read_text())
    modes = [r["mode"] for r in result["rows"]]
    assert modes == 2 * ["single", *[m for m in ("full", "shard-aware", "shard-aware-get-slice", "pre-sharded")
                                     for _ in (0, 1)]]
    spread = result["ratios"]["peak_rss_per_rank_over_single"]["pre-sharded"]  # each ratio with its spread
    assert spread["n"] == 2 and 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert result["tokens_identical"] is True
    assert all(r["peak_rss_mb"] > r["baseline_rss_mb"] > 0 and r["ready_s"] > 0 for r in result["rows"])
    assert "model loaded shard-aware" in next(r for r in result["rows"] if r["mode"] == "shard-aware")["report"]
    assert (tmp_path / "bench_memory.md").read_text().count("| pre-sharded | 1 |") == 2  # rank 1, each repeat


# A checkpoint that lacks some tensors: only those are initialised, exactly as from_pretrained does ------------

ONE_RANK = ("llama_kv4", "gpt2")


def one_rank_rows() -> list[dict]:
    """tests/workers/one_rank_shard.py on the ONE_RANK models in bf16, in one process, once per pytest run for both
    of the test's cases (a process each cost ~5 CPU-s more, 2026-12-06): its json lines."""
    def make(out: Path) -> None:
        out.mkdir()
        dirs = [str(save_decoder(name, out)) for name in ONE_RANK]
        proc = subprocess.run([sys.executable, str(WORKERS / "one_rank_shard.py"), "bf16", *dirs],
                              capture_output=True, text=True, timeout=180,
                              env={**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "2",
                                   "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (out / "rows.jsonl").write_text(proc.stdout)

    out = once_per_run("one-rank-shard", make)
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("name", ONE_RANK)
@pytest.mark.launched
def test_one_rank_equals_from_pretrained_bitwise(name):
    """tp 1 (one GPU): nothing is split, so every loading mode must give from_pretrained(dtype=bf16)'s logits
    bit for bit. Two things broke that: DeepSpeed cast RoPE's fp32 `inv_freq` to bf16 (Llama), and shard-aware
    loading read GPT-2's Conv1D weights transposed although DeepSpeed had left the module a Conv1D."""
    rows = [r for r in one_rank_rows() if r["model"] == name]
    assert [r["mode"] for r in rows] == ["full", "shard-aware"]
    for r in rows:
        assert r["max_abs_diff"] == 0.0, r
        assert r["buffers_as_reference"], r
    if name.startswith("llama"):
        assert any(b.endswith("inv_freq") for b in rows[0]["buffers"])


def test_missing_tensors_are_initialised_alone_bitwise_as_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)).eval()
    with torch.no_grad():  # trained-looking (non-default) norms, so a re-initialisation would show
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.uniform_(2, 3)
    model.config.save_pretrained(tmp_path)
    dropped = {"transformer.ln_f.bias", "transformer.h.1.ln_1.bias", "lm_head.weight"}  # lm_head: tied to wte
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in dropped},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    skeleton = load_model(AutoModelForCausalLM, tmp_path, inference_args=ON, dtype=torch.float32, mode="shard-aware")
    loader = pending_load(skeleton).loader
    assert loader.missing == {"transformer.ln_f.bias", "transformer.h.1.ln_1.bias"}
    loader.fill_replicated(skeleton, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    mine = dict(skeleton.named_parameters())
    compared = 0
    for name, want in ref.named_parameters():
        if not mine[name].is_meta and mine[name].abs().sum() > 0 or name in loader.missing:
            assert torch.equal(mine[name], want), name
            compared += 1
    assert compared >= 8 and torch.equal(mine["transformer.ln_f.weight"], model.transformer.ln_f.weight)
    for name, buf in ref.named_buffers():
        assert torch.equal(dict(skeleton.named_buffers())[name], buf), name


# Malformed checkpoints: what safetensors (and so from_pretrained) refuses is refused, naming file and tensor ----

def _write_raw(path, header, data: bytes):
    import json
    import struct

    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _malformed(tmp_path, case: str):
    """A copy of the embedded model whose checkpoint is broken in one way; returns (model dir, expected text)."""
    import json
    import struct

    d = tmp_path / case
    shutil.copytree(DEFAULT_MODEL, d)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    name = sorted(k for k in header if k != "__metadata__")[3]
    entry = header[name]
    if case == "dtype_f64":  # the case: same offsets, dtype changed in the header
        entry["dtype"] = "F64"
        return d, _write_raw(path, header, data) or f"tensor {name!r} (F64"
    if case == "short_offsets":
        entry["data_offsets"][1] -= 4
        return d, _write_raw(path, header, data) or f"tensor {name!r}"
    if case == "overlap":  # another tensor's offsets point into this one
        other = sorted(k for k in header if k != "__metadata__")[4]
        header[other]["data_offsets"] = list(entry["data_offsets"])
        return d, _write_raw(path, header, data) or "tensor"
    if case == "truncated":
        path.write_bytes(raw[:-100])
        return d, "truncated"
    if case == "not_json":
        path.write_bytes(struct.pack("<Q", 8) + b"notjson!" + data)
        return d, "not valid JSON"
    if case.startswith("index_"):  # an index checkpoint whose index names a file outside the directory, or none
        path.rename(d / "model-1.safetensors")
        weight_map = {k: "model-1.safetensors" for k in header if k != "__metadata__"}
        weight_map[name] = {"index_outside": "../t5/model.safetensors", "index_missing_file": "model-2.safetensors"}[case]
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return d, {"index_outside": "outside the model directory",
                   "index_missing_file": "names 'model-2.safetensors', which is not in"}[case]
    raise ValueError(case)


MALFORMED = ["dtype_f64", "short_offsets", "overlap", "truncated", "not_json", "index_outside", "index_missing_file"]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_checkpoints_are_refused_naming_file_and_tensor(tmp_path, case):
    from transformers import AutoModelForSeq2SeqLM

    model_dir, expected = _malformed(tmp_path, case)
    with pytest.raises(Exception):  # noqa: B017 - from_pretrained refuses it too (safetensors' own error)
        AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    with pytest.raises(InferenceSetupError) as info:
        load_model(AutoModelForSeq2SeqLM, model_dir, inference_args=ON)
    message = str(info.value)
    assert "\n" not in message and expected in message, message
    assert str(model_dir) in message or "index" in case, message


@pytest.mark.launched
def test_malformed_checkpoint_run_ends_in_one_line_before_generating(tmp_path):
    model_dir, expected = _malformed(tmp_path, "dtype_f64")
    run = run_example(["--model_name_or_path", str(model_dir), "--do_predict", "--max_predict_samples", "4",
                       *TRANSLATE_ARGS, "--deepspeed_inference"], tmp_path / "out")
    assert run.returncode == 2, run.output[-3000:]
    assert [e for e in run.error_lines() if expected in e and "model.safetensors is not a valid safetensors file" in e]
    assert "Traceback" not in run.output and not (tmp_path / "out" / "predict_results.json").exists()


def test_bench_memory_refuses_an_unknown_path_in_one_line(capsys):
    from ds_inference_integration.tools import cli

    assert cli.main(["bench", "memory", "--modes", "single,fast"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --modes 'fast' is not a loading path; valid: single, full, shard-aware, shard-aware-get-slice, "
        "pre-sharded"]


def test_modules_are_printed_once_while_deepspeed_shards_and_as_they_are_after():
    """`deepspeed_compat.modules_printed_once`: DeepSpeed's `'Yuan' in str(layer)` tests print each module once
    (0.17 of a pre-sharded rank's 0.71 s went to printing whole layers again); outside it, printing is torch's."""
    from torch import nn

    from ds_inference_integration.deepspeed_compat import modules_printed_once

    layer = nn.Sequential(nn.Linear(2, 2))
    with modules_printed_once():
        first = repr(layer)
        layer[0] = nn.ReLU()
        assert repr(layer) == first and "Linear" in first
    assert "ReLU" in repr(layer) and "Linear" not in repr(layer)


def test_the_pending_load_is_handed_over_on_the_skeleton_in_the_open(tmp_path):
    """Issue #43's seam (a module-global registry keyed by the model before it, #29's hidden attributes before that):
    `load_model` returns the skeleton carrying its one PendingLoad under the documented `PENDING_ATTRIBUTE`, and
    `shard_model` takes it as an argument (a skeleton without it is refused, naming how to pass it); sharded, the
    model is a skeleton no more and carries nothing of the load. A model loaded whole carries none."""
    from transformers import AutoModelForCausalLM

    from ds_inference_integration.load.loaders import PENDING_ATTRIBUTE, PendingLoad
    from ds_inference_integration.load.readers import ShardAwareLoader
    from ds_inference_integration.shard.inject import shard_model
    from ds_inference_integration.topology import ProcessGroups, Topology

    path = save_decoder("llama_kv2", tmp_path)
    skeleton = load_model(AutoModelForCausalLM, path, inference_args=ON)
    pending = pending_load(skeleton)
    assert vars(skeleton)[PENDING_ATTRIBUTE] is pending and is_skeleton(skeleton)
    assert isinstance(pending, PendingLoad) and isinstance(pending.loader, ShardAwareLoader) and pending.start > 0
    with pytest.raises(TypeError, match="without its pending load: pass pending=pending_load"):
        shard_model(skeleton, ON, Topology(1, 0, 1), ProcessGroups(None, None, None), None, torch.float32)
    sharded, report = shard_model(skeleton, ON, Topology(1, 0, 1), ProcessGroups(None, None, None), None,
                                  torch.float32, pending=pending)
    assert "shard-aware" in report.loading and not is_skeleton(sharded) and PENDING_ATTRIBUTE not in vars(sharded)
    assert not any(p.is_meta for p in sharded.parameters())
    full = AutoModelForCausalLM.from_pretrained(path)
    assert pending_load(full) is None and not is_skeleton(full)


def test_a_split_output_head_is_not_copied_where_the_loader_reads_its_shard_after():
    """`deepspeed_compat.lm_head_not_copied`: DeepSpeed copies the whole (tied) output head before it cuts this
    rank's columns from the copy; where a pre-sharded rank file holds the head's shard, it gets a meta weight
    instead (the loader fills every meta parameter after the split), and the embedding it was tied to is left as
    it was. Elsewhere DeepSpeed's copy stands. (Predictions through it: test_presharded_predictions_equal_the_source.)"""
    from deepspeed.module_inject.layers import LmHeadLinearAllreduce
    from torch import nn

    from ds_inference_integration.deepspeed_compat import lm_head_not_copied

    for read_after in (True, False):
        embedding = nn.Embedding(16, 4)
        head = nn.Linear(4, 16, bias=False)
        head.weight = embedding.weight  # tied, as a Llama with tie_word_embeddings
        with lm_head_not_copied(read_after):
            split = LmHeadLinearAllreduce(head, None)
            placed = split.weight
            if split.weight.is_meta:  # DeepSpeed's last set_lm_head ties a meta head to the embedding again
                split.weight = embedding.weight
        assert split.weight is placed  # undone (ProphetNet: rank 1's head, cut to no columns, came back whole)
        assert split.weight.is_meta is read_after and tuple(split.weight.shape) == (16, 4)
        assert split.weight is not embedding.weight and not embedding.weight.is_meta
        if not read_after:
            assert torch.equal(split.weight, embedding.weight)
    assert LmHeadLinearAllreduce(nn.Linear(4, 16, bias=False), None).weight.is_meta is False  # restored after


def test_no_garbage_collection_runs_while_a_model_is_loaded_or_sharded(tmp_path, monkeypatch):
    """`run.collector.collector_paused` around `load_model` and `shard_model`: a full collection walks every object
    of the process (0.12 s in a rank after its imports; one inside loading made a pre-sharded rank ready in 0.4 s
    instead of 0.1 s). With the collector set to run every few allocations, none runs while the skeleton is built,
    while `from_pretrained` runs under `load_model`, or while DeepSpeed shards; it is on again after, and stays off
    where the caller had it off."""
    import gc
    import types

    import deepspeed
    from transformers import AutoModelForCausalLM

    from ds_inference_integration.load import loaders
    from ds_inference_integration.shard.inject import shard_model
    from ds_inference_integration.topology import ProcessGroups, Topology

    path = save_decoder("llama_kv2", tmp_path)
    busy, runs = [], []

    def count(phase, info):
        if phase == "start":
            runs.append(bool(busy))

    def within(work):
        def run(*args, **kwargs):
            busy.append(1)
            try:
                return work(*args, **kwargs)
            finally:
                busy.pop()
        return run

    def many_objects(model, **kwargs):  # what DeepSpeed's walk does to the heap: objects by the thousand
        return types.SimpleNamespace(module=model, held=[[i] for i in range(5000)])

    monkeypatch.setattr(loaders, "build_skeleton", within(loaders.build_skeleton))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(within(AutoModelForCausalLM.from_pretrained)))
    monkeypatch.setattr(deepspeed, "init_inference", within(many_objects))
    threshold = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    gc.callbacks.append(count)
    try:
        skeleton = load_model(AutoModelForCausalLM, path, inference_args=ON)
        full = load_model(AutoModelForCausalLM, path)
        shard_model(full, ON, Topology(1, 0, 1), ProcessGroups(None, None, None), None, torch.float32)
        assert runs.count(True) == 0, f"{runs.count(True)} collections ran while loading or sharding"
        assert gc.isenabled()
        runs.clear()
        within(lambda: [[i] for i in range(100)])()
        assert True in runs, "the collector runs again after"
        gc.disable()
        load_model(AutoModelForCausalLM, path)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert is_skeleton(skeleton)


def test_load_model_names_a_model_its_auto_class_does_not_build_in_one_line(tmp_path):
    """`load_model` with an Auto class that builds no model of the checkpoint's type (a decoder-only model given to a
    seq2seq script): one line from the loader itself, before any weight is read (transformers' own error is a
    ValueError listing every config class)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, LlamaConfig, LlamaForCausalLM

    from ds_inference_integration import InferenceSetupError
    from ds_inference_integration.load.loaders import load_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=64)).save_pretrained(tmp_path / "llama")
    with pytest.raises(InferenceSetupError, match=r"llama holds a 'llama' model, which AutoModelForSeq2SeqLM does "
                                                  r"not build; valid: one of its \d+ types, such as t5, bart"):
        load_model(AutoModelForSeq2SeqLM, tmp_path / "llama")


@pytest.mark.parametrize("model_type, architectures, says", [
    ("gemma4_unified_assistant", None, r"\(Gemma4UnifiedAssistantForCausalLM\), a speculative-decoding assistant: its "
                                       r"forward reads its target model's states \(shared_kv_states\)"),
    ("musicgen", ["MusicgenForConditionalGeneration"], r"\(MusicgenForCausalLM\), whose generate makes audio codes"),
    ("musicgen_melody", None, r"\(MusicgenMelodyForCausalLM\), whose generate makes audio codes"),
    ("dia", ["DiaForConditionalGeneration"], r"\(DiaForConditionalGeneration\), whose generate makes audio codes"),
    ("vibevoice", None, r"\(VibeVoiceForConditionalGeneration\), whose generate makes audio codes"),
    # generate's key/value cache, built from a config without `num_hidden_layers` (BLT's are in its sub-configs)
    ("blt", None, r"\(BltForCausalLM\) whose key/value cache transformers [0-9.]+ cannot build from its config "
                  r"\(AttributeError: .*num_hidden_layers.*unsharded too"),
])
def test_a_model_that_generates_no_text_by_itself_is_refused_before_its_weights_are_read(tmp_path, model_type,
                                                                                        architectures, says):
    """A speculative-decoding assistant reads its target's key/value states (alone, its forward raised after the
    whole model had loaded); a text-to-speech or text-to-music model generates audio codes (MusicGen's class failed
    on a config attribute it lacks, Dia's forward on its codes' shape); a model whose generate cannot build its cache
    (BLT: unsharded too). One line from the loader, before any weight is read (the directory holds none): predict,
    the server and `policy check` load through it."""
    from transformers import AutoConfig

    from ds_inference_integration import InferenceSetupError
    from ds_inference_integration.load.loaders import load_model
    from ds_inference_integration.load.skeleton import model_class_for

    config = AutoConfig.for_model(model_type)
    config.architectures = architectures
    config.save_pretrained(tmp_path)
    with pytest.raises(InferenceSetupError, match=f"holds a '{model_type}' model {says}.*; valid: "):
        load_model(model_class_for(config), tmp_path)


def test_the_targets_of_assistants_and_speech_to_text_models_generate_text():
    """What the refusal above leaves alone: Gemma 4 itself (the assistant's target), speech-to-text classes of types
    that also make audio (SeamlessM4T's text classes, VibeVoice's ASR), streaming speech-to-text (Kyutai)."""
    import transformers as tr

    from ds_inference_integration.load.skeleton import check_generates_text

    for name in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "SeamlessM4TForTextToText",
                 "SeamlessM4TForSpeechToText", "VibeVoiceAsrForConditionalGeneration",
                 "KyutaiSpeechToTextForConditionalGeneration", "WhisperForConditionalGeneration"):
        model_class = getattr(tr, name)
        config = model_class.config_class()
        check_generates_text(config, model_class, "d")  # raises for one that does not


def test_a_rank_file_holds_parameters_that_share_memory_each_as_its_own(tmp_path):
    """Zamba2's shared block, read shard-aware, is a parameter of its own in each place over one memory: safetensors
    refused to save them ("Some tensors share memory"), a traceback on every rank of `ds-inference shard`. Each is
    saved as a copy, read back equal; one parameter in two places is still saved once."""
    from ds_inference_integration.load.presharded import new_identity, write_rank_file

    memory = torch.arange(8.0).reshape(2, 4)
    model = torch.nn.Module()
    model.a, model.b, model.c = (torch.nn.Linear(4, 2, bias=False) for _ in range(3))
    model.a.weight = torch.nn.Parameter(memory, requires_grad=False)
    model.b.weight = torch.nn.Parameter(memory.view(2, 4), requires_grad=False)  # another parameter, one memory
    model.c.weight = model.a.weight  # one parameter in two places
    record = write_rank_file(model, tmp_path, 0, new_identity(1, "p", torch.float32))
    saved = load_file(str(tmp_path / record["name"]))
    assert sorted(saved) == ["a.weight", "b.weight"]
    assert torch.equal(saved["a.weight"], memory) and torch.equal(saved["b.weight"], memory)


def test_a_pre_sharded_tensor_of_another_split_is_refused_naming_it(tmp_path):
    """A pre-sharded directory written by a version that split a tensor otherwise (DeepSpeed's 64-row blocks, before
    the run passed an even `tp_grain_size`: a 128-wide expert at tp 4 was 64/64/0/0, now 32 each) holds this rank's
    part in another shape: refused in one line naming the tensor, not read into the model."""
    from ds_inference_integration import InferenceSetupError
    from ds_inference_integration.load.readers import PreShardedLoader

    stored = {"layers.0.mlp.shared_experts.up_proj.weight": torch.ones(64, 16)}  # the rank's file, as read
    ckpt = type("Ckpt", (), {"__contains__": lambda self, n: n in stored, "read": lambda self, n, dtype, view: stored[n],
                             "files": [tmp_path / "rank-0-of-4.safetensors"], "bytes_read": 0})()
    loader = PreShardedLoader(tmp_path, torch.float32, ckpt)
    name = "layers.0.mlp.shared_experts.up_proj.weight"
    assert loader._read_shard([name], None, torch.empty(64, 16, device="meta"), 0).shape == (64, 16)
    with pytest.raises(InferenceSetupError, match=r"rank-0-of-4.safetensors holds layers.0.mlp.shared_experts.up_proj"
                                                  r".weight as \[64, 16\], this run splits it to \[32, 16\]: re-run "
                                                  r"`ds-inference shard`"):
        loader._read_shard([name], None, torch.empty(32, 16, device="meta"), 0)


def test_the_model_class_is_the_checkpoints_own_where_its_type_has_several():
    """A text-to-text SeamlessM4T shares its model_type with the speech-to-text one: the class comes from the
    checkpoint's `architectures` first (the speech class was built and refused for want of audio, "no probe input is
    known for its 'input_features'"), from the type where the checkpoint names none of its type's classes."""
    import transformers as tr

    from ds_inference_integration.load.skeleton import model_class_for

    text = tr.SeamlessM4TConfig(architectures=["SeamlessM4TForTextToText"])
    assert model_class_for(text) is tr.AutoModelForSeq2SeqLM
    assert tr.AutoModelForSeq2SeqLM._model_mapping[type(text)].__name__ == "SeamlessM4TForTextToText"
    assert model_class_for(tr.SeamlessM4TConfig()) is tr.AutoModelForSpeechSeq2Seq
    assert model_class_for(tr.SeamlessM4TConfig(architectures=["SomethingElse"])) is tr.AutoModelForSpeechSeq2Seq
    assert model_class_for(tr.WhisperConfig(architectures=["WhisperForConditionalGeneration"])) is \
        tr.AutoModelForSpeechSeq2Seq
    assert model_class_for(tr.LlamaConfig(architectures=["LlamaForCausalLM"])) is tr.AutoModelForCausalLM
    assert model_class_for(tr.T5Config()) is tr.AutoModelForSeq2SeqLM


def test_a_config_validators_error_is_one_line_with_its_cause():
    """huggingface_hub's strict configs say "Class validation error for validator 'validate_architecture':" on the
    first line and the cause on the second: the one-line error said only the first (`policy sweep`'s cells, and a
    user's `error:` line for a checkpoint whose config fails its own checks)."""
    from transformers import AutoConfig

    from ds_inference_integration.errors import first_line

    with pytest.raises(Exception) as caught:
        AutoConfig.for_model("gemma4_assistant")  # its default text config fails its own validator
    line = first_line(caught.value)
    assert line.startswith("Class validation error") and "hidden_size_per_layer_input must be 0" in line, line
    assert first_line(ValueError("one\ntwo")) == "one" and first_line(ValueError("")) == "ValueError"
