"""examples/run_speech_recognition_seq2seq.py: WER by jiwer's rules (fixed strings), bad audio refused in one line
naming the file before the model loads (in this process), and the example at tp 2 and at dp 2 x tp 2 (torchrun, 2
and 4 CPU ranks) against its single-process run, on the embedded synthetic clips (37 test clips, batch 8) and a
tiny random Whisper-style model."""

import json

import numpy as np
import pytest

from conftest import EXAMPLES, assert_ok, load_example, run_example, run_in_process, save_tiny_whisper
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.metrics import WordErrorRate, word_edits

RUN_SPEECH = EXAMPLES / "run_speech_recognition_seq2seq.py"
DATA = EXAMPLES / "data" / "numspeech"


def test_wer_as_jiwer_computes_it():
    """jiwer's README: wer(["hello world", "i like monthy python"], ["hello duck", "i like python"]) = 2 / 6."""
    got = WordErrorRate().corpus(["hello duck", "i like python"], ["hello world", "i like monthy python"], [2, 3])
    assert got == {"wer": round(100 * 2 / 6, 4), "gen_len": 2.5}
    assert [word_edits(h, r) for h, r in (("a b c", "a b c"), ("a x c", "a b c"), ("a c", "a b c"), ("a b b c", "a b c"),
                                          ("", "a b"), ("  a   b ", "a b"))] == [0, 1, 1, 1, 2, 0]
    totals = None
    for s in WordErrorRate().stats(["a", "b c"], ["a d", "b c"], [1, 2]):
        totals = WordErrorRate().add(totals, json.loads(json.dumps(s)))  # through JSON, as the parts store them
    assert WordErrorRate().compute(totals, 2)["wer"] == 25.0


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return save_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny_whisper")


def test_bad_audio_ends_in_one_line_naming_the_file_before_the_model_loads(whisper, tmp_path, monkeypatch):
    import soundfile

    example = load_example("run_speech_recognition_seq2seq")
    monkeypatch.setattr(example, "load_model", lambda *a, **k: pytest.fail("the model loaded before the data check"))
    clips = {"missing.wav": None, "not_audio.wav": b"this is text", "empty.wav": np.zeros(0, dtype=np.float32),
             "rate500.wav": np.zeros(400, dtype=np.float32)}
    for name, content in clips.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif content is not None:
            soundfile.write(tmp_path / name, content, 500 if "500" in name else 16000)
    expected = {"missing.wav": "does not exist", "not_audio.wav": "cannot be read", "empty.wav": "is empty (0 samples)",
                "rate500.wav": "has a sampling rate of 500 Hz, which cannot be resampled to the feature extractor's "
                               "16000 Hz; valid: 1000 Hz or more"}
    for name, why in expected.items():
        manifest = tmp_path / f"{name}.jsonl"
        manifest.write_text(json.dumps({"audio": name, "text": "one"}) + "\n")
        with pytest.raises(InferenceSetupError, match=f"^audio file {tmp_path / name} " + why.replace("(", r"\(")
                           .replace(")", r"\)").replace(".", r"\.")):
            example.main(["--model_name_or_path", str(whisper), "--output_dir", str(tmp_path / "out"), "--do_predict",
                          "--predict_with_generate", "--test_file", str(manifest)])
    # 8 kHz is resampled to the extractor's 16 kHz: twice the samples
    soundfile.write(tmp_path / "rate8k.wav", np.sin(np.arange(800) / 5).astype(np.float32), 8000)
    assert len(example.read_clip(tmp_path / "rate8k.wav", 16000)) == 1600


ARGS = ["--do_eval", "--do_predict", "--predict_with_generate", "--per_device_eval_batch_size", "8",
        "--generation_max_length", "12", "--report_to", "none"]


# 21 test and 6 validation clips (of 37 and 29): not multiples of the batch size; the whole sets: `make test-all`
@pytest.mark.parametrize("limits", [["--max_predict_samples", "21", "--max_eval_samples", "6"],
                                    pytest.param([], marks=pytest.mark.slow, id="whole")], ids=["21", "whole"])
def test_speech_recognition_at_tp2_and_dp2_x_tp2_equals_one_process(whisper, tmp_path, limits):
    args = ["--model_name_or_path", str(whisper), *ARGS, *limits]
    ref = run_in_process(args, tmp_path / "single", script=RUN_SPEECH)
    n, n_eval = (21, 6) if limits else (37, 29)
    assert len(ref.predictions()) == n and len(set(ref.predictions())) > 5  # the audio matters to the outputs
    want, want_eval = ref.results("predict"), ref.results("eval")
    assert want["predict_wer"] > 0 and want_eval["eval_samples"] == n_eval
    layouts = (("tp2", [], 2), ("dp2_tp2", ["--tp_size", "2"], 4))
    for name, extra, nprocs in layouts if not limits else layouts[1:]:  # make test: dp 2 x tp 2 (4 ranks) only
        run = run_example([*args, "--deepspeed_inference", *extra], tmp_path / name, nprocs=nprocs, script=RUN_SPEECH,
                          timeout=300)
        assert_ok(run)
        assert run.predictions() == ref.predictions(), name  # line for line
        got, got_eval = run.results("predict"), run.results("eval")
        assert (got["predict_wer"], got["predict_gen_len"]) == (want["predict_wer"], want["predict_gen_len"]), name
        assert (got_eval["eval_wer"], got_eval["eval_gen_len"]) == (want_eval["eval_wer"], want_eval["eval_gen_len"])
        assert (got["tp_size"], got["dp_size"]) == (2, nprocs // 2)
