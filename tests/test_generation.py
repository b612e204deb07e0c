"""Decoder-only batched generation through the Trainer path (examples/run_generation.py): left
padding, prompts stripped, outputs in input order; tp 2 equals one process; length grouping."""

import json
import statistics

import numpy as np
import pytest

from conftest import EXAMPLES, assert_ok, run_example, run_in_process
from ds_inference_integration.predict.length_grouping import padding_fraction, unsort

RUN_GENERATION = EXAMPLES / "run_generation.py"
PROMPTS = EXAMPLES / "data" / "prompts.txt"
ARGS = ["--max_new_tokens", "12", "--per_device_eval_batch_size", "8", "--report_to", "none"]


def test_padding_fraction_and_unsort():
    assert padding_fraction([2, 2, 4, 4], 2) == 0.0
    assert padding_fraction([2, 4, 2, 4], 2) == 1 - 12 / 16
    rows = np.array([[30], [31], [10], [11], [20], [21]])  # 2 rows per example, produced in order [3, 1, 2]
    assert unsort(rows, [2, 0, 1])[:, 0].tolist() == [10, 11, 20, 21, 30, 31]


def test_prompts_have_very_different_lengths():
    lengths = [len(p.split()) for p in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert max(lengths) >= 2 * min(lengths) and lengths != sorted(lengths)


@pytest.mark.launched
def test_tp2_generation_equals_single_process_and_grouping_keeps_order(tmp_path):
    single = run_in_process(ARGS, tmp_path / "single", script=RUN_GENERATION)
    grouped = run_in_process([*ARGS, "--group_by_length"], tmp_path / "grouped", script=RUN_GENERATION)
    tp = run_example([*ARGS, "--deepspeed_inference"], tmp_path / "tp", nprocs=2, script=RUN_GENERATION,
                     launcher="torchrun")
    for run in (single, grouped, tp):
        assert_ok(run)
    prompts = PROMPTS.read_text(encoding="utf-8").splitlines()
    assert len(single.predictions()) == len(prompts)
    assert tp.predictions() == single.predictions()
    assert grouped.predictions() == single.predictions()
    m = grouped.results("predict")
    assert m["predict_padding_fraction"] < m["predict_padding_fraction_unsorted"]
    assert tp.results("predict")["tp_size"] == 2
    rows = [json.loads(line) for line in (tmp_path / "single" / "generated_predictions.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert not any(r["prompt"] in r["generations"][0] for r in rows)  # prompts stripped from the outputs
    assert sum(bool(r["generations"][0]) for r in rows) >= 0.9 * len(rows)


def test_num_return_sequences_with_sampling(tmp_path):
    args = [*ARGS, "--do_sample", "--num_return_sequences", "2", "--max_prompts", "6", "--seed", "3"]
    run = run_in_process(args, tmp_path, script=RUN_GENERATION)
    assert len(run.predictions()) == 12
    rows = [json.loads(line) for line in (tmp_path / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["generations"]) == 2 for r in rows)


@pytest.mark.launched
def test_bench_generation_writes_table_json_and_a_png_that_opens(tmp_path):
    """The benchmark command on a small slice (in-process methods only; trainer_tp2 is exercised by the
    tp2 generation test above): one row per method x batch size, the table, and the plot."""
    import subprocess

    from PIL import Image

    from conftest import BIN

    proc = subprocess.run([str(BIN / "ds-inference"), "bench", "generation", "--methods",
                           "pipeline_per_sample,pipeline_batched,generate_loop,trainer,trainer_streaming",
                           "--batch-sizes", "1,8", "--max-prompts", "8", "--new-tokens", "4", "--repeats", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        ("pipeline_per_sample", None), ("pipeline_batched", 1), ("generate_loop", 1), ("trainer", 1),
        ("trainer_streaming", 1), ("pipeline_batched", 8), ("generate_loop", 8), ("trainer", 8),
        ("trainer_streaming", 8)]
    assert all(r["new_tokens"] == 8 * 4 and r["tokens_per_s"] > 0 and r["peak_rss_mb"][0] > 0 for r in rows)
    # every figure with the spread of its repeats, every ratio too
    for r in rows:
        sp = r["tokens_per_s_spread"]
        assert sp["n"] == 2 and sp["min"] <= sp["median"] <= sp["max"]
        assert r["tokens_per_s"] == round(statistics.median(r["tokens_per_s_repeats"]), 1)  # the median, as shown
    ratio = report["ratios"]["embedded"]["trainer_streaming_over_generate_loop_bs8"]
    assert ratio["n"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert "| embedded | generate_loop | 8 |" in (tmp_path / "bench.md").read_text()
    # readable: transformers' per-call warning (max_new_tokens beside the default max_length) once, not per call
    out = proc.stdout + proc.stderr
    assert out.count("seem to have been set") <= 2, out[-3000:]  # once for max_, once for min_new_tokens
    with Image.open(tmp_path / "bench.png") as png:
        assert png.size[0] > 300 and png.size[1] > 200


def test_bench_prompts_repeat_the_file_in_order(tmp_path):
    from ds_inference_integration.tools.bench import read_prompts

    (tmp_path / "p.txt").write_text("one\n\ntwo\nthree\n")
    assert read_prompts(tmp_path / "p.txt", 2) == ["one", "two"]
    assert read_prompts(tmp_path / "p.txt", 7) == ["one", "two", "three", "one", "two", "three", "one"]


@pytest.mark.slow  # one tp-2 launch of the bench's paired worker (~30 s): `make test-all` runs it
@pytest.mark.launched
def test_bench_generation_pairs_the_tp2_trainer_path_with_the_bare_loop_in_the_same_ranks(tmp_path):
    import subprocess

    from conftest import BIN

    proc = subprocess.run([str(BIN / "ds-inference"), "bench", "generation", "--methods", "trainer_streaming_tp2",
                           "--batch-sizes", "8", "--max-prompts", "10", "--new-tokens", "3", "--repeats", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"trainer_streaming_tp2", "generate_loop_tp2_paired"}
    assert all(r["new_tokens"] == 10 * 3 and len(r["peak_rss_mb"]) == 2 and len(r["tokens_per_s_repeats"]) == 2
               for r in rows.values())
    ratio = report["ratios"]["embedded"]["trainer_streaming_tp2_over_generate_loop_tp2_paired_bs8"]
    assert ratio["n"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


# make test-all's, all three: in make test, `policy check` shows each family at tp 2 against the unsharded model
# (test_policies_tp.py's test_the_2026_families_match_the_unsharded_model: greedy, beam and sampled ids) and
# test_tp2_generation_equals_single_process_and_grouping_keeps_order this example at tp 2 (lfm2 here cost 15 CPU-s
# of a suite over its 10 minutes, 2026-12-06)
@pytest.mark.parametrize("name", [pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                  pytest.param("lfm2", marks=pytest.mark.slow),
                                  pytest.param("gpt_oss", marks=pytest.mark.slow)])
@pytest.mark.launched
def test_the_2026_families_predict_at_tp2_as_one_process_through_the_example(name, tmp_path):
    """A dense-first MoE, a convolution hybrid (its mixers kept whole) and transposed experts with biases and
    attention sinks, each through run_generation.py with a derived policy (checked numerically at start) at tp 2
    against one process: the same generations."""
    import shutil

    import torch

    from ds_inference_integration.load.skeleton import model_class_for
    from ds_inference_integration.tools.architecture_zoo import ZOO

    default = EXAMPLES / "models" / "gpt2-num2words-en-ro"
    config = ZOO[name]()
    config.vocab_size = 72  # the embedded tokenizer's
    torch.manual_seed(0)
    model_dir = tmp_path / name
    model_class_for(config).from_config(config).save_pretrained(model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / f, model_dir / f)
    args = [*ARGS, "--model_name_or_path", str(model_dir), "--max_prompts", "12"]
    single = run_in_process(args, tmp_path / "single", script=RUN_GENERATION)
    tp = run_example([*args, "--deepspeed_inference"], tmp_path / "tp", nprocs=2, script=RUN_GENERATION)
    assert_ok(single)
    assert_ok(tp)
    assert tp.predictions() == single.predictions() and len(single.predictions()) == 12
    assert "checked numerically" in tp.output, tp.output[-2000:]
