"""The GPU check's CPU smoke mode (`launch/gpu_check.py --smoke`): the same code the GPU machine runs, so it
does not rot between the rare sessions that have a GPU. Structured output (its json file) is what is read."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, REPO


def gpu_check(tmp_path, sections: str) -> dict:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_check.py"), "--smoke", "--sections", sections,
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    report = json.loads(out.read_text())
    assert proc.returncode == (0 if report["ok"] else 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(tmp_path.glob("gpu_check_*")), "its working directory must be removed"
    return report


# make test runs the decode section (the check's start-up and its JSON with it); the kernel refusal and the
# real-shape verdict are make test-all's: the refusal is test_arguments.py's in process (a launched refusal cost
# 10 CPU-s), and `policy check` of Llama at tp 2 test_policies_tp.py's, in bf16 test_half_precision.py's (12 CPU-s;
# 2026-12-06)


@pytest.mark.slow
@pytest.mark.launched
def test_smoke_kernel_refusal(tmp_path):
    """The cheapest section: the plugin with DeepSpeed's kernels refused on CPU ranks in one line."""
    report = gpu_check(tmp_path, "kernel_inject")
    assert list(report["sections"]) == ["kernel_inject"] and report["ok"], json.dumps(report, indent=1)[:4000]
    refused = report["sections"]["kernel_inject"]["refused"]
    assert len(refused) == 1 and refused[0].startswith("error: --replace_with_kernel_inject")


@pytest.mark.slow
@pytest.mark.launched
def test_smoke_examples(tmp_path):
    """In `make test-all` (~60 s: four single-process example runs; the same comparisons at tp 2 are in
    test_translation_tp.py and test_generation.py)."""
    report = gpu_check(tmp_path, "examples")
    sections = report["sections"]
    assert list(sections) == ["examples"]
    assert report["ok"], json.dumps(sections, indent=1)[:4000]
    rows = {r["script"]: r for r in sections["examples"]["rows"]}
    # one rank with --deepspeed_inference against the plain Trainer path, line for line
    assert rows["translation"]["lines_compared"] == 12 and rows["translation"]["identical"]
    assert rows["translation"]["bleu_plain"] == rows["translation"]["bleu_plugin"] is not None
    assert rows["generation"]["lines_compared"] == 8 and rows["generation"]["identical"]


@pytest.mark.slow
@pytest.mark.launched
def test_smoke_loading_and_engine(tmp_path):
    sections = gpu_check(tmp_path, "loading,engine")["sections"]
    engine = sections["engine"]["runs"]
    assert [r["kernel_inject"] for r in engine] == [False, True] and engine[0]["rows"] and engine[1]["skipped"]
    loading = sections["loading"]
    assert loading["ok"] and loading["tokens_identical"]
    assert {r["mode"] for r in loading["rows"]} == {"single", "full", "shard-aware", "shard-aware-get-slice",
                                                   "pre-sharded"}
    assert all(r["logits_max_abs_diff_vs_single"] == 0.0 for r in loading["rows"])


@pytest.mark.launched
def test_smoke_decode(tmp_path):
    """In `make test`: the check's start-up and its JSON, and the decode section (plain generate, the plugin at tp 1,
    the plugin with a static cache compiled, the serve step engine, each with its fraction of the bandwidth bound;
    batch 1 profiled), on CPU."""
    report = gpu_check(tmp_path, "decode")
    sections = report["sections"]
    assert list(sections) == ["decode"] and report["ok"], json.dumps(report, indent=1)[:4000]
    decode = sections["decode"]
    assert decode["ok"], json.dumps(decode, indent=1)[:4000]
    paths = {(r["path"], r["batch_size"]) for r in decode["rows"]}
    assert paths == {(p, b) for p in ("plain generate", "plugin tp 1", "plugin tp 1, static cache + torch.compile",
                                      "plugin tp 1, step engine") for b in (1, 2)}
    for row in decode["rows"]:
        assert 0 < row["fraction_of_bound"] < 1 and row["bound_tokens_per_s"] > row["tokens_per_s"] > 0
        assert row.get("tokens_equal_eager", True)  # the plugin's and the compiled tokens against plain generate's
    assert decode["bandwidth_measured_bytes_s"] > 1e8 and decode["profile_batch_1"]["top_ops"]


@pytest.mark.slow
@pytest.mark.launched
def test_smoke_real_shape_verdict(tmp_path):
    """In `make test-all` (12 CPU-s): the real-shape verdict (a model of Llama-3.2-1B's config family saved in bf16,
    through `policy check --dtype bf16` at tp 2), on CPU (see the comment above test_smoke_kernel_refusal)."""
    verdict = gpu_check(tmp_path, "verdict_1b")["sections"]["verdict_1b"]
    assert verdict["ok"] and verdict["passed"] == verdict["total"] == 8, json.dumps(verdict, indent=1)[:4000]
    assert "bf16" in next(c["line"] for c in verdict["checks"] if c["check"] == "logits")


@pytest.mark.slow
@pytest.mark.launched
def test_smoke_tp2_on_one_device(tmp_path):
    """In `make test-all` (~30 s): both examples at tp 2 under torchrun with `--ddp_backend gloo` (on the GPU
    machine, two ranks share its one GPU) against one plain process, line for line, and `policy check` at tp 2 in
    bf16 on the embedded models. The same comparisons run in `make test` through test_translation_tp.py,
    test_generation.py and test_half_precision.py; this one keeps the GPU check's own code for them running."""
    section = gpu_check(tmp_path, "tp2_one_gpu")["sections"]["tp2_one_gpu"]
    assert section["ok"], json.dumps(section, indent=1)[:4000]
    rows = {r["script"]: r for r in section["rows"]}
    assert rows["translation"]["lines_compared"] == 12 and rows["translation"]["identical"]
    assert rows["generation"]["lines_compared"] == 8 and rows["generation"]["identical"]
    assert "--ddp_backend gloo" in rows["generation"]["plugin"]["cmd"]
    check = section["policy_check"]
    assert check["passed"] == check["total"] == 16


def test_ranks_sharing_a_gpu_use_gloo(monkeypatch):
    """NCCL refuses two ranks on one device: where local ranks outnumber GPUs (tp 2 on a one-GPU machine) the
    tools' ranks start gloo, which carries CUDA tensors; one rank per GPU keeps NCCL; CPU is gloo."""
    import torch

    from ds_inference_integration.run.ranks import process_group_backend

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert process_group_backend(True, {"LOCAL_SIZE": "2"}) == "gloo"
    assert process_group_backend(True, {"LOCAL_WORLD_SIZE": "1"}) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert process_group_backend(True, {"LOCAL_SIZE": "8"}) == "nccl"
    assert process_group_backend(False, {"LOCAL_SIZE": "1"}) == "gloo"
