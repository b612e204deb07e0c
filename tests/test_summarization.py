"""examples/run_summarization.py: ROUGE computed by rouge_score's rules (fixed strings, in this process), and the
example at tp 2 and at dp 2 x tp 2 (torchrun, 2 and 4 CPU ranks) against its single-process run through main()
in this process, on the embedded synthetic set (batch 8; some documents longer than --max_source_length)."""

import json

import pytest

from conftest import EXAMPLES, assert_ok, load_example, run_example, run_in_process
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.metrics import Rouge

RUN_SUMMARIZATION = EXAMPLES / "run_summarization.py"


# ROUGE ---------------------------------------------------------------------------------------------

def test_rouge_on_rouge_scores_own_example():
    """rouge_score's README: score(target='The quick brown fox jumps over the lazy dog', prediction='The quick
    brown dog jumps on the log.') gives rouge1 P 0.75 R 0.6667 F 0.7059 and rougeL P 0.625 R 0.5556 F 0.5882."""
    got = Rouge(use_stemmer=False).scores("The quick brown dog jumps on the log.",
                                          "The quick brown fox jumps over the lazy dog")
    assert round(got["rouge1"], 4) == 0.7059 and round(got["rougeL"], 4) == 0.5882


def test_rouge_n_l_and_lsum_by_hand():
    rouge = Rouge(use_stemmer=False)
    got = rouge.scores("a b c\nd e", "a c\nd f e")
    # unigrams 4 of 5 each way; bigrams: only (c, d) of 4; LCS a c d e; per sentence: {a, c} and {d, e}
    assert got == pytest.approx({"rouge1": 0.8, "rouge2": 0.25, "rougeL": 0.8, "rougeLsum": 0.8})
    # ROUGE-Lsum takes the union of each reference sentence's LCS with every candidate sentence; the same
    # token is counted no more often than it occurs: "a b" vs "b a\na b" -> reference "b a" meets both lines
    assert rouge.scores("a b\nb a", "b a")["rougeLsum"] == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert rouge.scores("", "a b") == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "rougeLsum": 0.0}


def test_rouge_tokenizes_and_stems_as_rouge_score():
    rouge = Rouge()
    assert rouge.tokens("Running, RUNS; ran: 3-D!") == ["run", "run", "ran", "3", "d"]  # Porter, longer than 3
    assert Rouge(use_stemmer=False).tokens("Running, ăla x") == ["running", "la", "x"]  # only a-z and 0-9 count


def test_streamed_rouge_equals_the_corpus_computed_at_once():
    """Per-example statistics summed over parts in any order give the in-memory corpus numbers."""
    rouge = Rouge()
    preds, refs, lens = ["one two : three", "four", "five six"], ["one : three", "four five", "six"], [4, 1, 2]
    whole = rouge.corpus(preds, refs, lens)
    totals = None
    for s in reversed(rouge.stats(preds, refs, lens)):
        totals = rouge.add(totals, json.loads(json.dumps(s)))  # through JSON, as the parts store them
    assert rouge.compute(totals, 3) == whole and set(whole) == {"rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len"}
    assert rouge.compute(rouge.add(None, rouge.stats(["x"], None, [1])[0]), 1) == {"gen_len": 1.0}  # no references


# The example -------------------------------------------------------------------------------------

ARGS = ["--do_predict", "--do_eval", "--predict_with_generate", "--per_device_eval_batch_size", "8",
        "--max_source_length", "128", "--val_max_target_length", "16", "--source_prefix", "summarize: ",
        "--report_to", "none"]


def test_bad_columns_and_data_end_in_one_line_before_the_model_loads(tiny_models, tmp_path):
    main = load_example("run_summarization").main
    base = ["--model_name_or_path", str(tiny_models["t5"]), "--output_dir", str(tmp_path / "out"), *ARGS]
    with pytest.raises(InferenceSetupError, match=r"^--text_column 'article' is not a column of the validation data; "
                                                  r"columns: document, summary$"):
        main([*base, "--text_column", "article"])
    empty = tmp_path / "empty.json"
    empty.write_text('{"document": "one", "summary": "one"}\n{"document": " ", "summary": "two"}\n')
    with pytest.raises(InferenceSetupError, match=r"^1 of 2 test examples have an empty 'document'"):
        main([*base[:-len(ARGS)], "--do_predict", "--predict_with_generate", "--test_file", str(empty)])
    with pytest.raises(InferenceSetupError, match=r"--test_file 'x.txt' must be a json, jsonl or csv file"):
        main([*base, "--test_file", "x.txt"])
    bart = ["--model_name_or_path", str(tiny_models["bart"]), "--output_dir", str(tmp_path / "out"), *ARGS]
    with pytest.raises(InferenceSetupError, match=r"^--max_source_length 128 is longer than the model's 64 positions; "
                                                  r"valid: at most 64$"):
        main(bart)


# `make test-all`'s, to keep `make test` under 10 minutes: the summarization path is the translation path's (the
# Trainer, predict_to_file) with another metric and data, and both are checked in this process above and by the
# translation tests under launchers; the speech example's launched test stays in `make test`. 21 test and 6
# validation documents (of 37 and 29) are not multiples of the batch size; BART is a second family, at tp 2.
@pytest.mark.parametrize("kind, limits", [
    pytest.param("t5", ["--max_predict_samples", "21", "--max_eval_samples", "6"], marks=pytest.mark.slow, id="t5"),
    pytest.param("t5", [], marks=pytest.mark.slow, id="t5-whole"),
    pytest.param("bart", [], marks=pytest.mark.slow, id="bart-whole")])
def test_summarization_at_tp2_and_dp2_x_tp2_equals_one_process(tiny_models, tmp_path, kind, limits):
    args = ["--model_name_or_path", str(tiny_models[kind]), *ARGS, *limits]
    n = 21 if limits else 37
    if kind == "bart":  # 64 positions
        args[args.index("--max_source_length") + 1] = "64"
    ref = run_in_process(args, tmp_path / "single", script=RUN_SUMMARIZATION)
    assert len(ref.predictions()) == n and len(set(ref.predictions())) > 5  # the inputs matter to the outputs
    want_eval, want = ref.results("eval"), ref.results("predict")
    assert want["predict_rouge1"] > 0 and want["predict_samples"] == n
    layouts = (("tp2", [], 2), ("dp2_tp2", ["--tp_size", "2"], 4))
    for name, extra, nprocs in layouts[:1] if kind == "bart" else layouts:  # BART: a second family, at tp 2
        run = run_example([*args, "--deepspeed_inference", *extra], tmp_path / name, nprocs=nprocs,
                          script=RUN_SUMMARIZATION, timeout=300)
        assert_ok(run)
        assert run.predictions() == ref.predictions(), name  # line for line
        got, got_eval = run.results("predict"), run.results("eval")
        for key in ("predict_rouge1", "predict_rouge2", "predict_rougeL", "predict_rougeLsum", "predict_gen_len"):
            assert got[key] == want[key], (name, key)
        for key in ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum", "eval_gen_len"):
            assert got_eval[key] == want_eval[key], (name, key)
        assert (got["tp_size"], got["dp_size"]) == (2, nprocs // 2)
        limit = args[args.index("--max_source_length") + 1]
        assert f"of {n} test sources are longer than --max_source_length {limit} tokens and were truncated" in run.output
