"""predict/positions.py: sources and targets longer than an encoder-decoder's learned positions end in one line naming the
flag and the limit (they were an IndexError in the forward: LED's decoder, found by the summarization example)."""

import pytest
import transformers as tr

from ds_inference_integration import InferenceSetupError
from ds_inference_integration.predict.positions import check_lengths_fit, decoder_positions


def test_each_family_s_decoder_positions():
    assert decoder_positions(tr.LEDConfig(max_encoder_position_embeddings=512, max_decoder_position_embeddings=64)) == 64
    assert decoder_positions(tr.BartConfig(max_position_embeddings=96)) == 96
    assert decoder_positions(tr.WhisperConfig(max_target_positions=48)) == 48
    assert decoder_positions(tr.Speech2TextConfig(max_target_positions=40)) == 40
    assert decoder_positions(tr.T5Config()) is None  # relative positions: no limit
    composite = tr.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(
        tr.Wav2Vec2Config(), tr.BartConfig(max_position_embeddings=32, is_decoder=True, add_cross_attention=True))
    assert decoder_positions(composite) == 32


def test_a_target_or_source_beyond_the_positions_is_one_line():
    led = tr.LEDConfig(max_encoder_position_embeddings=512, max_decoder_position_embeddings=64)
    with pytest.raises(InferenceSetupError, match=r"^--val_max_target_length 128 is longer than the model's 64 "
                                                  r"decoder positions; valid: at most 64$"):
        check_lengths_fit(led, source={"--max_source_length": 512}, target={"--val_max_target_length": 128})
    with pytest.raises(InferenceSetupError, match=r"^--max_source_length 1024 is longer than the model's 512 positions"):
        check_lengths_fit(led, source={"--max_source_length": 1024})
    check_lengths_fit(led, source={"--max_source_length": 512}, target={"--val_max_target_length": 64,
                                                                      "--generation_max_length": None})
    check_lengths_fit(tr.T5Config(), source={"--max_source_length": 10_000}, target={"--val_max_target_length": 10_000})


def test_the_trainer_checks_sources_and_generation_lengths_against_the_positions(tmp_path):
    """A user's script with the README's changes and upstream's defaults (run_translation.py's --max_source_length
    1,024) on a model of 64 positions: predict, evaluate and predict_to_file failed with an IndexError in the forward
    (a traceback per rank); now one line naming the count and the limit, before any batch runs. The generation
    length a caller sets is checked too; the model's own generation_config is not (generation may end earlier)."""
    from datasets import Dataset
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from conftest import save_tiny_model
    from ds_inference_integration import DeepSpeedInferenceArguments, DeepSpeedInferenceSeq2SeqTrainer

    model_dir = save_tiny_model("bart", tmp_path / "bart")  # 64 positions
    tok = AutoTokenizer.from_pretrained(model_dir)
    long = Dataset.from_dict(tok(["one two three " * 30, "seven"]))
    short = Dataset.from_dict({**tok(["seven", "two"]), "labels": tok(text_target=["seven", "two"])["input_ids"]})
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4,
                                                   predict_with_generate=True, report_to="none"),
        processing_class=tok, data_collator=DataCollatorForSeq2Seq(tok, model=model),
        inference_args=DeepSpeedInferenceArguments(deepspeed_inference=True))
    sources = r"^1 of 2 sources are longer than the model's 64 positions \(the longest has 91 tokens\); valid: sources " \
              r"of at most 64 tokens \(upstream's examples: --max_source_length 64\)$"
    with pytest.raises(InferenceSetupError, match=sources):
        trainer.predict(long, max_new_tokens=4)
    with pytest.raises(InferenceSetupError, match=sources):
        trainer.predict_to_file(long, max_new_tokens=4)
    with pytest.raises(InferenceSetupError, match=sources):
        trainer.evaluate(long)
    with pytest.raises(InferenceSetupError, match=r"^max_length 100 is longer than the model's 64 decoder positions; "
                                                  r"valid: at most 64$"):
        trainer.predict(short, max_length=100)
    with pytest.raises(InferenceSetupError, match=r"^max_new_tokens 64 is longer than the model's 64 decoder "
                                                  r"positions; valid: at most 63$"):
        trainer.evaluate(short, max_new_tokens=64)
    assert trainer.predict(short, max_length=64).predictions.shape[0] == 2
    assert "eval_loss" in trainer.evaluate(short, max_new_tokens=63)


def test_the_trainer_checks_sources_without_the_flag_too(tmp_path):
    """The examples leave the sources to the Trainer (upstream's run_translation.py defaults to --max_source_length
    1,024; the flag alone cannot be refused): in one process, without --deepspeed_inference, a source past a model's
    64 positions was an IndexError in the forward; now the same one line as under the flag."""
    from datasets import Dataset
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from conftest import save_tiny_model
    from ds_inference_integration import DeepSpeedInferenceSeq2SeqTrainer

    model_dir = save_tiny_model("bart", tmp_path / "bart")  # 64 positions
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4,
                                                   predict_with_generate=True, report_to="none"),
        processing_class=tok, data_collator=DataCollatorForSeq2Seq(tok, model=model))
    with pytest.raises(InferenceSetupError, match=r"^1 of 2 sources are longer than the model's 64 positions"):
        trainer.predict(Dataset.from_dict(tok(["one two three " * 30, "seven"])), max_new_tokens=4)


def test_the_translation_example_refuses_a_max_source_length_past_the_positions_as_upstream(tmp_path):
    """upstream's run_translation.py refuses a --max_source_length beyond a model's absolute positions (before its
    data is tokenized); the example does the same, in one line, where it checked the tokenized sources before."""
    from conftest import TRANSLATE_ARGS, load_example, save_tiny_model

    bart = save_tiny_model("bart", tmp_path / "bart")  # 64 positions
    main = load_example("run_translation").main
    args = ["--model_name_or_path", str(bart), "--output_dir", str(tmp_path / "out"), "--do_predict",
            "--max_predict_samples", "4", "--val_max_target_length", "16", *TRANSLATE_ARGS]
    with pytest.raises(InferenceSetupError, match=r"^--max_source_length 1024 is longer than the model's 64 positions; "
                                                  r"valid: at most 64$"):
        main(args)
    main([*args, "--max_source_length", "64"])
    assert len((tmp_path / "out" / "generated_predictions.txt").read_text().splitlines()) == 4
