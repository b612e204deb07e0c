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


def test_smoke_kernel_refusal(tmp_path):
    """In `make test`: the check's own start-up and its JSON, on the cheapest section (~10 s)."""
    report = gpu_check(tmp_path, "kernel_inject")
    assert list(report["sections"]) == ["kernel_inject"] and report["ok"], json.dumps(report, indent=1)[:4000]
    refused = report["sections"]["kernel_inject"]["refused"]
    assert len(refused) == 1 and refused[0].startswith("error: --replace_with_kernel_inject")


@pytest.mark.slow
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
def test_smoke_loading_and_engine(tmp_path):
    sections = gpu_check(tmp_path, "loading,engine")["sections"]
    engine = sections["engine"]["runs"]
    assert [r["kernel_inject"] for r in engine] == [False, True] and engine[0]["rows"] and engine[1]["skipped"]
    loading = sections["loading"]
    assert loading["ok"] and loading["tokens_identical"]
    assert {r["mode"] for r in loading["rows"]} == {"single", "full", "shard-aware", "shard-aware-get-slice",
                                                   "pre-sharded"}
    assert all(r["logits_max_abs_diff_vs_single"] == 0.0 for r in loading["rows"])
