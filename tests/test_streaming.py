"""Streamed, resumable predict (predict/streaming.py, predict/metrics.py, `predict_to_file`) in one process: the same
predictions and metrics as the in-memory path, a crash resumed without generating anything twice, a resume
of a different run refused, data without references. The multi-rank kills are in test_resume_tp.py."""

import json
import re

import numpy as np
import pytest
import sacrebleu
import torch

from conftest import save_tiny_model
from ds_inference_integration.errors import InferenceSetupError
from ds_inference_integration.predict.metrics import CorpusBleu
from ds_inference_integration.predict.streaming import (
    PartWriter,
    complete_length,
    merge_parts,
    part_path,
    read_records,
    replica_batches,
)

WORDS = ["one hundred", "seven", "twenty two", "nine thousand", "forty", "three", "eleven", "sixty five", "two",
         "eight hundred and one", "fifty", "twelve", "six", "thirty three"]


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    return save_tiny_model("t5", tmp_path_factory.mktemp("tiny") / "t5")


def make_trainer(model_dir, output_dir, labels=True, sources=WORDS, **args):
    """A trainer on a tiny random T5, and data whose references are near its greedy predictions (every other one
    changed), so that BLEU is neither 0 nor 100 and a wrong sum of statistics would show."""
    from datasets import Dataset
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from ds_inference_integration import DeepSpeedInferenceSeq2SeqTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    columns = dict(tok(list(sources)))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    if labels:
        with torch.no_grad():
            greedy = model.generate(**tok(list(sources), return_tensors="pt", padding=True), max_new_tokens=6)
        texts = tok.batch_decode(greedy, skip_special_tokens=True)
        refs = [t if i % 2 else " ".join(t.split()[:-1] + ["seven"]) for i, t in enumerate(texts)]
        columns["labels"] = tok(text_target=refs)["input_ids"]
    training_args = Seq2SeqTrainingArguments(output_dir=str(output_dir), predict_with_generate=True, report_to="none",
                                             **{"per_device_eval_batch_size": 4, "seed": 3, **args})
    trainer = DeepSpeedInferenceSeq2SeqTrainer(model=model, args=training_args, processing_class=tok,
                                               data_collator=DataCollatorForSeq2Seq(tok, model=model))
    return trainer, Dataset.from_dict(columns), tok


def in_memory(trainer, data, tok, **gen):
    """Today's path, as upstream's run_translation.py does it: predict, decode, corpus BLEU, gen_len."""
    out = trainer.predict(data, **gen)
    preds = np.where(out.predictions != -100, out.predictions, tok.pad_token_id)
    lines = [p.strip() for p in tok.batch_decode(preds, skip_special_tokens=True, clean_up_tokenization_spaces=True)]
    metrics = {"gen_len": round(float(np.mean([np.count_nonzero(p != tok.pad_token_id) for p in preds])), 4)}
    if out.label_ids is not None:
        labels = np.where(out.label_ids != -100, out.label_ids, tok.pad_token_id)
        refs = [x.strip() for x in tok.batch_decode(labels, skip_special_tokens=True)]
        hyps = [x.strip() for x in tok.batch_decode(preds, skip_special_tokens=True)]
        metrics["bleu"] = round(float(sacrebleu.corpus_bleu(hyps, [refs]).score), 4)
    return lines, metrics


def test_streamed_bleu_is_corpus_bleu_on_fixed_strings():
    hyps = ["the cat sat on the mat", "a b c d", "", "hello there general kenobi", "x y z", "one two three four five"]
    refs = ["the cat is on the mat", "a b c d", "nothing", "hello there", "x y", "one two three four six"]
    metric = CorpusBleu()
    totals = None
    for s in metric.stats(hyps[:4], refs[:4], [6, 4, 0, 4]) + metric.stats(hyps[4:], refs[4:], [3, 5]):
        totals = metric.add(totals, s)
    got = metric.compute(totals, len(hyps))
    assert got["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 4) and 0 < got["bleu"] < 100
    assert got["gen_len"] == round(22 / 6, 4)
    assert metric.compute(metric.add(None, metric.stats(["a"], None, [1])[0]), 1) == {"gen_len": 1.0}


def test_streamed_bleu_equals_evaluates_sacrebleu_where_it_loads():
    """The other path: evaluate's own sacrebleu script, as upstream's run_translation.py calls it, where it can be
    loaded (from the Hub or its cache; no run here reaches the Hub, so here this is skipped and the test above,
    against sacrebleu itself, stands for it)."""
    evaluate = pytest.importorskip("evaluate")
    try:
        metric = evaluate.load("sacrebleu")
    except Exception as e:
        pytest.skip(f"evaluate's sacrebleu script cannot be loaded here ({type(e).__name__})")
    hyps = ["the cat sat on the mat", "a b c d", "hello there general kenobi"]
    refs = ["the cat is on the mat", "a b c d", "hello there"]
    theirs = metric.compute(predictions=hyps, references=[[r] for r in refs])["score"]
    assert CorpusBleu().corpus(hyps, refs, [6, 4, 4])["bleu"] == round(theirs, 4)


@pytest.mark.parametrize("n, batch, dp", [(1, 4, 1), (14, 4, 1), (14, 4, 2), (14, 4, 3), (5, 8, 2), (203, 16, 2)])
def test_the_replicas_cover_every_example_once(n, batch, dp):
    seen = [p for r in range(dp) for b in replica_batches(n, batch, dp, r) for p in b]
    assert sorted(seen) == list(range(n))
    for r in range(dp):  # each replica's batches are in order: a part on disk is a prefix of them
        flat = [p for b in replica_batches(n, batch, dp, r) for p in b]
        assert flat == sorted(flat)


def test_a_line_cut_short_by_a_crash_is_dropped_and_merge_checks_every_example(tmp_path):
    path = part_path(tmp_path, 0)
    writer = PartWriter(path)
    writer.write([{"i": 0, "p": "a"}, {"i": 1, "p": "b"}])
    writer.close()
    with open(path, "ab") as f:
        f.write(b'{"i": 2, "p": "c')  # killed mid-line
    assert complete_length(path)[0] == 2 and [r["i"] for _, r in read_records(path)] == [0, 1]
    writer = PartWriter(path)  # reopened by the resumed run: the cut line is gone
    writer.write([{"i": 2, "p": "c"}])
    writer.close()
    assert [r["p"] for _, r in read_records(path)] == ["a", "b", "c"]
    merge_parts(tmp_path, 1, 3, tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "a\nb\nc\n"
    with pytest.raises(RuntimeError, match="1 of 4 examples have no prediction"):
        merge_parts(tmp_path, 1, 4, tmp_path / "out4.txt")
    assert not (tmp_path / "out4.txt").exists()
    PartWriter(part_path(tmp_path, 1)).write([{"i": 1, "p": "again"}])
    with pytest.raises(RuntimeError, match="example 1 is duplicated"):
        merge_parts(tmp_path, 2, 3, tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "a\nb\nc\n"  # the earlier good file stays whole


@pytest.mark.parametrize("gen", [{"max_new_tokens": 6}, {"num_beams": 3, "max_new_tokens": 6},
                                 {"do_sample": True, "top_k": 0, "max_new_tokens": 6}], ids=["greedy", "beam", "sample"])
def test_streamed_predictions_and_metrics_equal_the_in_memory_path(tiny_t5, tmp_path, gen):
    trainer, data, tok = make_trainer(tiny_t5, tmp_path)
    lines, want = in_memory(trainer, data, tok, **gen)
    got = trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    assert (tmp_path / "generated_predictions.txt").read_text().splitlines() == lines
    assert {k: got[f"predict_{k}"] for k in want} == want and 0 < want["bleu"] < 100, want
    assert got["predict_samples"] == got["predict_generated_samples"] == len(WORDS)
    assert not (tmp_path / "predict_parts").exists()  # merged, then removed


def test_a_crash_is_resumed_without_generating_anything_twice(tiny_t5, tmp_path, monkeypatch, caplog):
    gen = {"do_sample": True, "top_k": 0, "max_new_tokens": 6}  # sampling: the seeds must follow the batches too
    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "whole")
    want = trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    whole = (tmp_path / "whole" / "generated_predictions.txt").read_bytes()

    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "crash")
    original = type(trainer).prediction_step
    calls = []

    def crash_at_third_batch(self, *args, **kwargs):
        calls.append(self.loop.batch_index + 1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "prediction_step", crash_at_third_batch)
    with pytest.raises(RuntimeError, match="killed"):
        trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    parts = tmp_path / "crash" / "predict_parts"
    assert complete_length(part_path(parts, 0))[0] == 8 and not (tmp_path / "crash" / "generated_predictions.txt").exists()
    with open(part_path(parts, 0), "ab") as f:
        f.write(b'{"i": 8, "p": "half')  # and the crash cut a line short
    monkeypatch.setattr(type(trainer), "prediction_step", original)
    calls.clear()
    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "crash")  # the same command again
    monkeypatch.setattr("ds_inference_integration.predict.streaming.PROGRESS_EVERY_SECONDS", 0.0)  # a line per batch
    caplog.clear()
    with caplog.at_level("INFO", logger="ds_inference_integration.predict.streaming"):
        got = trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    assert f"resumed: 8 of {len(WORDS)} examples already done" in caplog.text
    # one progress line for the whole job, counting from what was already done
    progress = re.findall(r"predict progress: (\d+) of (\d+) examples \(([\d.]+)%\), ([\d.]+) examples/s, (\S+)",
                          caplog.text)
    assert [(int(d), int(t)) for d, t, *_ in progress] == [(12, 14), (14, 14), (14, 14)], caplog.text
    assert progress[0][2] == "85.7" and float(progress[0][3]) > 0 and progress[-1][4] == "0"
    assert (tmp_path / "crash" / "generated_predictions.txt").read_bytes() == whole
    assert got["predict_generated_samples"] == len(WORDS) - 8 and got["predict_samples"] == len(WORDS)
    assert {k: got[k] for k in ("predict_bleu", "predict_gen_len")} == {k: want[k] for k in ("predict_bleu", "predict_gen_len")}


@pytest.mark.parametrize("moment", ["writing_the_merged_file", "after_the_rename"])
def test_a_crash_during_the_merge_loses_nothing_and_generates_nothing_again(tiny_t5, tmp_path, monkeypatch, moment):
    """Killed while the merged file is written (the temporary file is left behind, as a SIGKILL leaves it), or
    after it is renamed into place but before the parts are removed: the same call again merges the same parts
    into the same file, generating nothing."""
    import contextlib
    import os

    from ds_inference_integration.predict import streaming

    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "whole")
    want = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    whole = (tmp_path / "whole" / "generated_predictions.txt").read_bytes()
    out = tmp_path / "crash"
    trainer, data, _ = make_trainer(tiny_t5, out)
    original = streaming.atomic_path

    @contextlib.contextmanager
    def killed_while_writing(path):
        with original(path) as tmp:
            yield tmp
            os.link(tmp, f"{tmp}.left")  # what a SIGKILL here leaves: a temporary file, no rename
            raise KeyboardInterrupt("killed")

    def killed_after_rename(path, *a, **k):
        raise KeyboardInterrupt("killed")

    if moment == "writing_the_merged_file":
        monkeypatch.setattr(streaming, "atomic_path", killed_while_writing)
    else:
        monkeypatch.setattr(streaming.shutil, "rmtree", killed_after_rename)
    with pytest.raises(KeyboardInterrupt):
        trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    assert (out / "generated_predictions.txt").exists() == (moment == "after_the_rename")
    monkeypatch.undo()
    trainer, data, _ = make_trainer(tiny_t5, out)  # the same command again
    got = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    assert (out / "generated_predictions.txt").read_bytes() == whole
    assert got["predict_generated_samples"] == 0 and got["predict_resumed_samples"] == len(WORDS)
    assert {k: got[k] for k in ("predict_bleu", "predict_gen_len")} == {k: want[k] for k in ("predict_bleu", "predict_gen_len")}
    assert not (out / "predict_parts").exists()


def identity_before_generating(trainer, data, monkeypatch, **gen):
    """The run's identity as predict_to_file computes it, before anything is generated."""
    identity = None

    def keep(parts_dir, ident, fresh):
        nonlocal identity
        identity = ident
        raise RuntimeError("stop before generating")

    monkeypatch.setattr("ds_inference_integration.predict.streaming.open_run", keep)
    with pytest.raises(RuntimeError, match="stop before generating"):
        trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    monkeypatch.undo()
    return identity


def test_a_resume_with_other_settings_or_data_is_refused_and_fresh_starts_over(tiny_t5, tmp_path, monkeypatch):
    trainer, data, _ = make_trainer(tiny_t5, tmp_path)
    (tmp_path / "predict_parts").mkdir()
    from ds_inference_integration.predict.streaming import open_run

    identity = identity_before_generating(trainer, data, monkeypatch, num_beams=1, max_new_tokens=6)
    open_run(tmp_path / "predict_parts", identity, fresh=True)
    with pytest.raises(InferenceSetupError, match=r"different predict run \(generation.kwargs.num_beams: 1 -> 4\); "
                                                  r"re-run the same command to resume it, or pass --overwrite_output_dir"):
        trainer.predict_to_file(data, metric=CorpusBleu(), num_beams=4, max_new_tokens=6)
    other, other_data, _ = make_trainer(tiny_t5, tmp_path, sources=WORDS[:-1])
    with pytest.raises(InferenceSetupError, match=r"data.examples: 14 -> 13"):
        other.predict_to_file(other_data, metric=CorpusBleu(), num_beams=1, max_new_tokens=6)
    got = trainer.predict_to_file(data, metric=CorpusBleu(), num_beams=4, max_new_tokens=6, fresh=True)
    assert got["predict_generated_samples"] == len(WORDS)


def test_overwrite_output_dir_starts_a_streamed_predict_afresh_from_the_parser(tiny_t5, tmp_path, monkeypatch):
    """transformers 5 dropped --overwrite_output_dir; InferenceArgumentParser keeps it on the training arguments, as 4
    had it, and `predict_to_file` starts afresh by it (the examples passed `fresh=` from the parser's record of it)."""
    from transformers import Seq2SeqTrainingArguments

    from ds_inference_integration import InferenceArgumentParser
    from ds_inference_integration.predict.streaming import open_run

    def parse(*flags):
        return InferenceArgumentParser((Seq2SeqTrainingArguments,)).parse_args_into_dataclasses(
            args=["--output_dir", str(tmp_path / "args"), *flags])[0]

    assert parse("--overwrite_output_dir").overwrite_output_dir is True
    assert parse().overwrite_output_dir is False
    trainer, data, _ = make_trainer(tiny_t5, tmp_path)
    (tmp_path / "predict_parts").mkdir()
    identity = identity_before_generating(trainer, data, monkeypatch, num_beams=1, max_new_tokens=6)
    open_run(tmp_path / "predict_parts", identity, fresh=True)  # another run's parts
    with pytest.raises(InferenceSetupError, match="or pass --overwrite_output_dir"):
        trainer.predict_to_file(data, metric=CorpusBleu(), num_beams=4, max_new_tokens=6)
    trainer.args.overwrite_output_dir = True
    got = trainer.predict_to_file(data, metric=CorpusBleu(), num_beams=4, max_new_tokens=6)
    assert got["predict_generated_samples"] == len(WORDS)


def test_a_resume_with_another_model_or_layout_is_refused_naming_what_differs(tiny_t5, tmp_path, monkeypatch):
    """Parts written by one run are continued only by the same run: another model (other weights and config at
    another path), another batch size, or another tp / dp layout is refused in one line naming the field."""
    import dataclasses

    from ds_inference_integration.predict.streaming import open_run

    trainer, data, _ = make_trainer(tiny_t5, tmp_path)
    identity = identity_before_generating(trainer, data, monkeypatch, num_beams=1, max_new_tokens=6)
    parts = tmp_path / "predict_parts"
    open_run(parts, identity, fresh=True)  # parts of this run, as a crash would leave them
    other_model = save_tiny_model("t5", tmp_path / "other_t5", d_ff=64)
    other, other_data, _ = make_trainer(other_model, tmp_path)
    with pytest.raises(InferenceSetupError, match=r"different predict run \(model\.name_or_path: '.*/t5' -> "
                                                  r"'.*/other_t5'; model\.config_sha256: "):
        other.predict_to_file(other_data, metric=CorpusBleu(), num_beams=1, max_new_tokens=6)
    wider, wider_data, _ = make_trainer(tiny_t5, tmp_path, per_device_eval_batch_size=8)
    with pytest.raises(InferenceSetupError, match=r"different predict run \(layout\.batch_size: 4 -> 8\)"):
        wider.predict_to_file(wider_data, metric=CorpusBleu(), num_beams=1, max_new_tokens=6)
    sharded = dataclasses.replace(identity, layout={**identity.layout, "tp_size": 2, "dp_size": 2})
    with pytest.raises(InferenceSetupError, match=r"\(layout\.tp_size: 1 -> 2; layout\.dp_size: 1 -> 2\)"):
        open_run(parts, sharded, fresh=False)
    assert open_run(parts, identity, fresh=False)  # the same run continues


def test_data_without_references_predicts_with_upstreams_collator(tiny_t5, tmp_path):
    """transformers 5.24's DataCollatorForSeq2Seq gives `labels: None` without references, and upstream's
    prediction_step then runs the model without decoder inputs ("You must specify exactly one of input_ids or
    inputs_embeds"). Both predict paths must work, and report no BLEU."""
    trainer, data, tok = make_trainer(tiny_t5, tmp_path, labels=False)
    assert "labels" not in data.column_names
    batch = trainer.data_collator([data[0], data[1]])
    assert "labels" in batch and batch["labels"] is None  # the collator's own behaviour, as reported
    out = trainer.predict(data, max_new_tokens=6)
    assert out.predictions.shape[0] == len(WORDS) and out.label_ids is None
    got = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    assert "predict_bleu" not in got and got["predict_gen_len"] > 0
    lines = (tmp_path / "generated_predictions.txt").read_text().splitlines()
    preds = np.where(out.predictions != -100, out.predictions, tok.pad_token_id)
    assert lines == [p.strip() for p in tok.batch_decode(preds, skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=True)]
    assert json.loads(json.dumps(got)) == got  # metrics are plain numbers


def test_length_grouped_predictions_come_back_in_input_order(tiny_t5, tmp_path):
    trainer, data, tok = make_trainer(tiny_t5, tmp_path, train_sampling_strategy="group_by_length")
    lines, want = in_memory(trainer, data, tok, max_new_tokens=6)  # in memory: sorted, then put back in order
    got = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    assert (tmp_path / "generated_predictions.txt").read_text().splitlines() == lines
    assert {k: got[f"predict_{k}"] for k in want} == want
    assert got["predict_padding_fraction"] < got["predict_padding_fraction_unsorted"]


def test_the_example_predicts_a_file_with_only_the_source_side(tmp_path):
    """Bulk jobs translate what nobody has translated yet: predictions, no BLEU, instead of a failure."""
    from conftest import DATA, TRANSLATE_ARGS, run_in_process

    rows = [json.loads(line) for line in (DATA / "test.json").read_text().splitlines()[:10]]
    (tmp_path / "src.json").write_text("".join(json.dumps({"translation": {"en": r["translation"]["en"]}}) + "\n"
                                               for r in rows))
    args = ["--do_predict", "--per_device_eval_batch_size", "4", *TRANSLATE_ARGS]
    bare = run_in_process([*args, "--test_file", str(tmp_path / "src.json")], tmp_path / "bare")
    full = run_in_process([*args, "--test_file", str(DATA / "test.json"), "--max_predict_samples", "10"],
                          tmp_path / "full")
    assert bare.predictions() == full.predictions() and len(bare.predictions()) == 10
    assert "predict_bleu" not in bare.results("predict") and "predict_bleu" in full.results("predict")


def test_a_run_identity_is_the_same_before_and_after_an_earlier_generate_in_the_process(tiny_t5, tmp_path, monkeypatch):
    """transformers fills its defaults into the model's generation_config at the first generate; an eval before
    predict (`--do_eval --do_predict`) must not make the predict run's identity differ from a `--do_predict` run's."""
    trainer, data, _ = make_trainer(tiny_t5, tmp_path)
    before = identity_before_generating(trainer, data, monkeypatch, num_beams=1, max_new_tokens=6)
    trainer.predict(data, num_beams=1, max_new_tokens=6)  # any earlier generate in this process
    after = identity_before_generating(trainer, data, monkeypatch, num_beams=1, max_new_tokens=6)
    assert after.generation == before.generation and after == before
    assert before.generation["generation_config"]["num_beams"] == 1  # effective values, defaults filled in


def _crashed_run(model_dir, out, monkeypatch, at_batch: int = 3, **gen):
    """A predict_to_file killed when its `at_batch`-th batch starts, as a SIGKILL leaves it: the parts on disk."""
    trainer, data, _ = make_trainer(model_dir, out)
    original = type(trainer).prediction_step
    calls = []

    def crash(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at_batch:
            raise KeyboardInterrupt("killed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "prediction_step", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.predict_to_file(data, metric=CorpusBleu(), **gen)
    monkeypatch.undo()
    return out / "predict_parts" / "part-dp0.jsonl"


def _swap_indices(lines):
    a, b = json.loads(lines[3][9:]), json.loads(lines[4][9:])
    a["i"], b["i"] = b["i"], a["i"]
    return lines[:3] + [_line(a), _line(b)] + lines[5:]


def _line(record) -> bytes:
    from ds_inference_integration.predict.streaming import encode_record

    return encode_record(record)


DAMAGE = {
    # (a) two lines' indices swapped (their checksums made right again, as a careful hand edit would)
    "indices_swapped": (_swap_indices, 3),
    # (b) the last line cut mid-record, its newline kept
    "last_line_cut_newline_kept": (lambda lines: lines[:-1] + [lines[-1][:len(lines[-1]) // 2] + b"\n"], 7),
    # (c) one line's index changed to a later example's (checksum made right again)
    "index_changed_to_a_later_example": (lambda lines: lines[:5] + [_line({**json.loads(lines[5][9:]), "i": 12})]
                                         + lines[6:], 5),
    # a prediction edited by hand, checksum left as it was
    "prediction_edited": (lambda lines: lines[:2] + [lines[2].replace(b'"p": "', b'"p": "x')] + lines[3:], 2),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_parts_are_cut_back_to_their_valid_prefix_and_the_resume_is_byte_identical(tiny_t5, tmp_path,
                                                                                           monkeypatch, damage):
    """A killed run's part, damaged by hand, then the same command again: every line from the first one that is not
    whole (cut, checksum wrong) or carries another index than the replica's next example is generated again, and
    the predictions end byte for byte as an uninterrupted run's. (Before: a swapped or re-numbered line was merged
    as it stood, exit 0 with predictions out of place; a cut line with its newline was a JSONDecodeError.)"""
    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "whole")
    want = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    whole = (tmp_path / "whole" / "generated_predictions.txt").read_bytes()
    part = _crashed_run(tiny_t5, tmp_path / "crash", monkeypatch, at_batch=3, max_new_tokens=6)
    lines = part.read_bytes().splitlines(keepends=True)
    assert len(lines) == 8
    damage_fn, kept = DAMAGE[damage]
    part.write_bytes(b"".join(damage_fn(lines)))
    trainer, data, _ = make_trainer(tiny_t5, tmp_path / "crash")  # the same command again
    got = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    assert (tmp_path / "crash" / "generated_predictions.txt").read_bytes() == whole
    assert got["predict_resumed_samples"] == kept and got["predict_generated_samples"] == len(WORDS) - kept
    assert {k: got[k] for k in ("predict_bleu", "predict_gen_len")} == {k: want[k] for k in ("predict_bleu", "predict_gen_len")}


def test_a_checkpoint_replaced_by_another_of_the_same_size_is_not_resumed(tiny_t5, tmp_path, monkeypatch):
    """Killed half-way; the checkpoint at the same path is replaced by another of the same architecture and byte
    size (a later training checkpoint); the same command: refused in one line naming the weights (before: the
    identity held the files' sizes only, so the old model's parts were resumed and merged with the new one's)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_t5, model_dir)
    _crashed_run(model_dir, tmp_path / "out", monkeypatch, at_batch=2, max_new_tokens=6)
    newer = save_tiny_model("t5", tmp_path / "newer", initializer_factor=4.0)
    for f in newer.glob("*.safetensors"):
        assert f.stat().st_size == (model_dir / f.name).stat().st_size
        shutil.copy(f, model_dir / f.name)
    trainer, data, _ = make_trainer(model_dir, tmp_path / "out")
    with pytest.raises(InferenceSetupError, match=r"^\S+predict_parts holds the parts of a different predict run "
                                                  r"\(model\.weight_files\.model\.safetensors: '\d+:\w+' -> "):
        trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6)
    fresh = trainer.predict_to_file(data, metric=CorpusBleu(), max_new_tokens=6, fresh=True)
    assert fresh["predict_generated_samples"] == len(WORDS)


def test_a_large_weight_file_is_fingerprinted_by_samples_of_its_contents(tmp_path, monkeypatch):
    from ds_inference_integration.predict import streaming

    monkeypatch.setattr(streaming, "SAMPLED_ABOVE", 1000)
    monkeypatch.setattr(streaming, "SAMPLE_BYTES", 16)
    path = tmp_path / "model.safetensors"
    data = bytearray(range(256)) * 40
    path.write_bytes(data)
    before = streaming.weights_fingerprint(path)
    assert before.startswith(f"{len(data)}:")
    trained = bytearray(data)
    for k in range(0, len(trained), 64):  # training further changes every weight, the size unchanged
        trained[k] ^= 1
    path.write_bytes(trained)
    assert streaming.weights_fingerprint(path) != before
    path.write_bytes(data)  # the same contents again (copied back, a new mtime): the same fingerprint
    assert streaming.weights_fingerprint(path) == before
