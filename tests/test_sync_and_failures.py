"""Data parallel x tensor parallel, deterministic sampling, the lock-step guard, a rank that dies or
raises, and bad input: never a hang, never a lost or duplicated prediction."""

import pytest
from conftest import TRANSLATE_ARGS, assert_ok, run_example

ODD = ["--do_predict", "--max_predict_samples", "37", "--per_device_eval_batch_size", "4", *TRANSLATE_ARGS]


@pytest.fixture(scope="module")
def single_odd(tmp_path_factory):
    run = run_example(ODD, tmp_path_factory.mktemp("single_odd"))
    assert_ok(run)
    return run


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_dp2_x_tp2_on_four_ranks(single_odd, tmp_path, launcher):
    run = run_example([*ODD, "--deepspeed_inference", "--tp_size", "2"], tmp_path, nprocs=4, launcher=launcher,
                      timeout=300)
    assert_ok(run)
    assert run.predictions() == single_odd.predictions() and len(run.predictions()) == 37
    results = run.results("predict")
    assert (results["tp_size"], results["dp_size"], results["predict_samples"]) == (2, 2, 37)
    assert "world 4 = tp 2 x dp 2 (rank 3)" in run.output
    assert 0 <= results["predict_lockstep_guard_seconds"] < results["predict_runtime"]


def test_sampling_with_a_seed_matches_single_process(tiny_models, tmp_path):
    args = ["--model_name_or_path", str(tiny_models["t5"]), "--do_predict", "--max_predict_samples", "24",
            "--per_device_eval_batch_size", "8", "--val_max_target_length", "12", *TRANSLATE_ARGS, "--seed", "7"]
    greedy = run_example(args, tmp_path / "greedy")
    sampled = run_example([*args, "--do_sample", "--top_k", "0"], tmp_path / "single")
    tp = run_example([*args, "--do_sample", "--top_k", "0", "--deepspeed_inference"], tmp_path / "tp", nprocs=2)
    for run in (greedy, sampled, tp):
        assert_ok(run)
    assert sampled.predictions() != greedy.predictions()  # it really sampled
    assert tp.predictions() == sampled.predictions()


FAULT_ARGS = [*ODD[:2], "203", *ODD[3:], "--deepspeed_inference", "--inference_timeout", "60"]


def _no_results(out) -> None:
    assert not (out / "predict_results.json").exists() and not (out / "generated_predictions.txt").exists()


def test_killed_rank_ends_the_run_within_the_timeout(tmp_path):
    run = run_example(FAULT_ARGS, tmp_path, nprocs=2, timeout=200, fault="kill:1:3")
    assert run.returncode != 0
    assert run.seconds < 60 + 30, run.seconds
    _no_results(tmp_path)


def test_rank_that_raises_takes_the_others_down_promptly(tmp_path):
    run = run_example(FAULT_ARGS, tmp_path, nprocs=2, timeout=200, fault="raise:1:3")
    assert run.returncode != 0
    assert "error: rank 1 failed: RuntimeError: injected fault on rank 1 at batch 3" in run.output
    assert run.seconds < 45, run.seconds  # well before the 60 s collective timeout
    _no_results(tmp_path)


def test_lockstep_guard_stops_mixed_inputs_on_every_rank(tmp_path):
    run = run_example(FAULT_ARGS, tmp_path, nprocs=2, timeout=200, fault="skew:1:2")
    assert run.returncode != 0
    errors = run.error_lines()
    assert any("[rank 0]" in e for e in errors) and any("[rank 1]" in e for e in errors), run.output[-2000:]
    assert all("lock-step guard: batch 2 differs between ranks 0 and 1 of TP group [0, 1]" in e for e in errors)
    assert run.seconds < 45, run.seconds
    _no_results(tmp_path)


# Bad input: one clear line and a non-zero exit on every rank -----------------------------------------

def _bad_files(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "nocol.json").write_text('{"text": "one"}\n')
    (tmp_path / "nolang.json").write_text('{"translation": {"en": "one", "fr": "un"}}\n')
    (tmp_path / "syntax.toml").write_text("model_types = [\n")
    (tmp_path / "schema.toml").write_text('model_types = ["t5"]\n[layers.T5Block]\nall_reduce = ["o"]\n')


# These checks run identically on every rank, so one process shows them (as a world of one); that every
# rank of a launched run prints its line and exits is shown by test_bad_setup_fails_fast_on_every_rank.
BAD_INPUT = {
    "tp_larger_than_world": (["--tp_size", "4"], "--tp_size 4 does not fit 1 rank(s): it must divide the world size; valid: 1"),
    "kernel_inject_on_cpu": (["--replace_with_kernel_inject"], "--replace_with_kernel_inject needs a GPU"),
    "policy_syntax": (["--injection_policy", "{tmp}/syntax.toml"], "syntax.toml: not valid TOML"),
    "empty_test_file": (["--test_file", "{tmp}/empty.json"], "empty.json' holds no examples"),
    "fp16_on_cpu": (["--inference_dtype", "fp16"], "--inference_dtype fp16 is not supported on CPU; valid on CPU: fp32, bf16"),
    "policy_schema": (["--injection_policy", "{tmp}/schema.toml"], "[layers.T5Block] must hold exactly: row_parallel"),
    "unknown_policy": (["--injection_policy", "t5-policy"], "--injection_policy 't5-policy' is not a file; valid: auto, autotp"),
    "missing_column": (["--test_file", "{tmp}/nocol.json"], "the test data has no 'translation' column; columns: ['text']"),
    "missing_language": (["--test_file", "{tmp}/nolang.json"], "no language 'ro' in 'translation'; languages there: ['en', 'fr']"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_clear_line(tmp_path, case):
    _bad_files(tmp_path)
    extra, expected = BAD_INPUT[case]
    args = ["--do_predict", *TRANSLATE_ARGS, "--deepspeed_inference", *(a.format(tmp=tmp_path) for a in extra)]
    run = run_example(args, tmp_path / "out", timeout=120)
    assert run.returncode == 2, run.output[-2000:]
    errors = run.error_lines()
    assert sorted(e.rsplit(" [rank ", 1)[1] for e in errors) == ["0]"], run.output[-2000:]
    assert all(expected in e for e in errors), errors
    assert "Traceback" not in run.output


def test_long_sources_are_truncated_with_one_warning(tmp_path):
    run = run_example(["--do_predict", "--max_predict_samples", "10", *TRANSLATE_ARGS, "--max_source_length", "12"],
                      tmp_path)
    assert_ok(run)
    assert run.output.count("of 10 test sources are longer than --max_source_length 12 tokens and were truncated") == 1
    assert len(run.predictions()) == 10
