#!/usr/bin/env python
"""Speech recognition evaluation/prediction in the shape of Hugging Face's
`examples/pytorch/speech-recognition/run_speech_recognition_seq2seq.py` (Whisper, Speech2Text, a wav2vec2
encoder with a text decoder), plus `--deepspeed_inference`.

Audio comes from local files listed in a manifest (json-lines or CSV; an `audio` column of paths, absolute or
relative to the manifest, and a `text` column), read with soundfile, mixed down to mono and resampled to the
feature extractor's rate, then turned into what the model reads by the model's own feature extractor, as upstream
does. Every clip is checked before the model loads: a missing or unreadable file, an empty clip, or a sampling
rate that cannot be resampled ends in one `error:` line naming the file. Metric: WER x 100
(`ds_inference_integration.predict.metrics.WordErrorRate`) and the mean generated length. With no data or model
arguments it uses the embedded clips (`examples/data/numspeech`, numbers read by espeak-ng, made by
`make_speech_data.py`) and the embedded model trained on such clips (`train_default_speech.py`). Single process:

    python examples/run_speech_recognition_seq2seq.py --output_dir out --do_predict --predict_with_generate

Tensor parallel over 2 ranks: the same command under `torchrun --nproc_per_node 2` (or `deepspeed --num_gpus 2`)
with `--deepspeed_inference` added.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path

import numpy as np
import torch
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoModelForSpeechSeq2Seq,
    AutoTokenizer,
    Seq2SeqTrainingArguments,
    set_seed,
)

from ds_inference_integration import (
    DeepSpeedInferenceArguments,
    DeepSpeedInferenceSeq2SeqTrainer,
    InferenceArgumentParser,
    InferenceSetupError,
)
from ds_inference_integration.load.loaders import check_model_kind, load_model
from ds_inference_integration.predict.metrics import WordErrorRate
from ds_inference_integration.predict.positions import check_lengths_fit

logger = logging.getLogger(__name__)
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "numspeech"
# examples/train_default_speech.py: a 1.5M-parameter Whisper-style model, WER 0 on the embedded test clips
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "models" / "whisper-numspeech")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={
        "help": "A speech encoder-decoder's directory (Whisper, Speech2Text, wav2vec2 + a decoder); default: the "
                "embedded model trained on the embedded clips"})
    feature_extractor_name: str | None = field(default=None, metadata={"help": "Feature extractor, if not the model's"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloaded models"})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)"})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code from the hub"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "Training manifest (json-lines or csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation manifest."})
    test_file: str | None = field(default=None, metadata={"help": "Test manifest."})
    audio_column_name: str = field(default="audio", metadata={"help": "Manifest column of audio file paths."})
    text_column_name: str = field(default="text", metadata={"help": "Manifest column of transcriptions."})
    max_duration_in_seconds: float = field(default=20.0, metadata={"help": "Longer clips are left out (a warning)."})
    min_duration_in_seconds: float = field(default=0.0, metadata={"help": "Shorter clips are left out (a warning)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set."})
    max_target_length: int = field(default=64, metadata={"help": "Max label tokens; also generate's max_length."})
    num_beams: int | None = field(default=1, metadata={"help": "Beams for evaluate/predict generation."})
    do_lower_case: bool = field(default=False, metadata={"help": "Lower-case the transcriptions."})
    language: str | None = field(default=None, metadata={
        "help": "The audio's language, for a multilingual Whisper ('french' or 'fr'); unset: it detects it"})
    task: str = field(default="transcribe", metadata={"help": "transcribe or translate (a multilingual Whisper)"})

    def __post_init__(self):
        if not (self.train_file or self.validation_file or self.test_file):
            self.validation_file, self.test_file = (str(DEFAULT_DATA / f"{s}.jsonl") for s in ("validation", "test"))
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and path.rsplit(".", 1)[-1] not in ("json", "jsonl", "csv"):
                raise InferenceSetupError(f"--{name} {path!r} must be a json, jsonl or csv manifest")


def audio_path(manifest: str, value) -> Path:
    if isinstance(value, dict):  # a datasets Audio-style {"path": ...} entry
        value = value.get("path")
    path = Path(str(value))
    return path if path.is_absolute() else Path(manifest).resolve().parent / path


def check_clip(path: Path, rate: int) -> float:
    """The clip's duration in seconds; one error naming the file if it cannot be used."""
    import soundfile

    if not path.is_file():
        raise InferenceSetupError(f"audio file {path} does not exist")
    try:
        info = soundfile.info(str(path))
    except Exception as e:  # soundfile raises its own LibsndfileError (a RuntimeError), or TypeError
        raise InferenceSetupError(f"audio file {path} cannot be read ({str(e).splitlines()[0]}); valid: wav, flac "
                                  "or ogg that soundfile reads") from None
    if info.frames == 0:
        raise InferenceSetupError(f"audio file {path} is empty (0 samples)")
    if info.samplerate < 1000 or (rate // gcd(rate, info.samplerate)) > 1000:
        raise InferenceSetupError(f"audio file {path} has a sampling rate of {info.samplerate} Hz, which cannot be "
                                  f"resampled to the feature extractor's {rate} Hz; valid: 1000 Hz or more")
    return info.frames / info.samplerate


def read_clip(path: Path, rate: int) -> np.ndarray:
    """Mono float32 samples at `rate` (polyphase resampling, as librosa's soxr-free path would)."""
    import soundfile
    from scipy.signal import resample_poly

    audio, source_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if source_rate != rate:
        g = gcd(rate, source_rate)
        audio = resample_poly(audio, rate // g, source_rate // g).astype(np.float32)
    return audio


def parse_args(argv: list[str]):
    parser = InferenceArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments,
                                      DeepSpeedInferenceArguments))
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(argv)


def main(argv: list[str]) -> None:
    model_args, data_args, training_args, inference_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    for lg in (logger, logging.getLogger("ds_inference_integration"), transformers.utils.logging.get_logger()):
        lg.setLevel(log_level)
    set_seed(training_args.seed)
    if training_args.do_train:
        raise InferenceSetupError("--do_train is not supported by this example; valid: --do_eval, --do_predict")
    hub = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token,
               trust_remote_code=model_args.trust_remote_code)
    config = AutoConfig.from_pretrained(model_args.model_name_or_path, **hub)
    try:
        feature_extractor = AutoFeatureExtractor.from_pretrained(
            model_args.feature_extractor_name or model_args.model_name_or_path, **hub)
    except OSError:  # transformers' message is three sentences about the Hub
        # a text model given here has none: name its kind (load_model would, later)
        check_model_kind(config, AutoModelForSpeechSeq2Seq, model_args.model_name_or_path)
        raise InferenceSetupError(f"{model_args.feature_extractor_name or model_args.model_name_or_path} has no "
                                  "feature extractor (preprocessor_config.json); valid: a speech model's directory, "
                                  "or --feature_extractor_name") from None
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path, **hub)
    rate = feature_extractor.sampling_rate
    # labels and the generated length past the decoder's positions are an IndexError in the forward
    check_lengths_fit(config, target={"--max_target_length": data_args.max_target_length,
                                      "--generation_max_length": training_args.generation_max_length})
    # what the model reads: log-mel frames (`input_features`: Whisper, Speech2Text) or the samples themselves
    # (`input_values`: a wav2vec2 encoder in a SpeechEncoderDecoderModel), as upstream's `model_input_name`
    input_name = feature_extractor.model_input_names[0]

    # Data: every clip checked before the model loads -----------------------------------------------------
    splits = {"validation": (data_args.validation_file, data_args.max_eval_samples, training_args.do_eval),
              "test": (data_args.test_file, data_args.max_predict_samples, training_args.do_predict)}
    datasets = {}
    for split, (manifest, limit, wanted) in splits.items():
        if not wanted:
            continue
        if manifest is None:
            raise InferenceSetupError(f"--{split}_file is needed for this split; valid: a json, jsonl or csv manifest")
        # the parser has checked the manifest as a file (missing, empty, not UTF-8, a malformed line)
        extension = manifest.split(".")[-1]
        ds = load_dataset("json" if extension == "jsonl" else extension, data_files={split: manifest},
                          cache_dir=model_args.cache_dir)[split]
        if len(ds) == 0:
            raise InferenceSetupError(f"the {split} manifest {manifest} lists no clips")
        for column in (data_args.audio_column_name, data_args.text_column_name):
            if column not in ds.column_names and not (column == data_args.text_column_name and split == "test"):
                raise InferenceSetupError(f"the {split} manifest has no column {column!r}; columns: "
                                          f"{', '.join(ds.column_names)}")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        paths = [audio_path(manifest, a) for a in ds[data_args.audio_column_name]]
        durations = [check_clip(p, rate) for p in paths]
        keep = [i for i, d in enumerate(durations)
                if data_args.min_duration_in_seconds <= d <= data_args.max_duration_in_seconds]
        if len(keep) < len(ds):
            logger.warning(f"{len(ds) - len(keep)} of {len(ds)} {split} clips are outside --min/--max_duration_in_seconds "
                           f"({data_args.min_duration_in_seconds}, {data_args.max_duration_in_seconds}) and were left out")
        if not keep:
            raise InferenceSetupError(f"no {split} clip is within the duration limits")
        window = getattr(feature_extractor, "n_samples", None)  # Whisper's: one fixed window, longer audio is cut
        longer = sum(durations[i] * rate > window for i in keep) if window else 0
        if longer:
            logger.warning(f"{longer} of {len(keep)} {split} clips are longer than the feature extractor's "
                           f"{window / rate:g} s window and are cut to it (as upstream's feature extractor cuts them)")
        datasets[split] = (ds.select(keep), [paths[i] for i in keep])

    def features(ds, paths):
        texts = ds[data_args.text_column_name] if data_args.text_column_name in ds.column_names else None
        rows = {input_name: [feature_extractor(read_clip(p, rate), sampling_rate=rate)[input_name][0] for p in paths]}
        if texts is not None:
            texts = [t.lower() if data_args.do_lower_case else t for t in texts]
            rows["labels"] = tokenizer(texts, max_length=data_args.max_target_length, truncation=True)["input_ids"]
        from datasets import Dataset

        return Dataset.from_dict(rows)

    data = {split: features(*parts) for split, parts in datasets.items()}
    if not data:
        logger.info("There is nothing to do. Please pass `do_eval` and/or `do_predict`.")
        return

    model = load_model(AutoModelForSpeechSeq2Seq, model_args.model_name_or_path, config=config,
                       inference_args=inference_args, training_args=training_args, **hub)
    # the parser has checked --language and --task against the model's generation config, before anything loaded
    if getattr(model.generation_config, "is_multilingual", False):  # as upstream: a multilingual Whisper's prefix
        if hasattr(tokenizer, "set_prefix_tokens"):  # tokens (a Whisper tokenizer's), in generate too
            tokenizer.set_prefix_tokens(language=data_args.language, task=data_args.task)
        model.generation_config.language = data_args.language
        model.generation_config.task = data_args.task
    else:
        model.generation_config.forced_decoder_ids = None  # a transcription task, no language tokens forced

    def collate(rows):
        # padded by the feature extractor, as upstream's DataCollatorSpeechSeq2SeqWithPadding does (Whisper's are
        # all one window long; other extractors give clips of different lengths and an attention mask)
        batch = dict(feature_extractor.pad([{input_name: r[input_name]} for r in rows], return_tensors="pt"))
        batch[input_name] = batch[input_name].to(torch.float32)
        if "labels" in rows[0]:
            width = max(len(r["labels"]) for r in rows)
            batch["labels"] = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        return batch

    wer = WordErrorRate()

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded = [p.strip() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [r.strip() for r in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        lens = [int(np.count_nonzero(p != tokenizer.pad_token_id)) for p in preds]
        return wer.corpus(decoded, refs, lens)

    training_args.remove_unused_columns = False
    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=training_args, processing_class=tokenizer, data_collator=collate,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
        inference_args=inference_args,
    )
    gen = {"max_length": training_args.generation_max_length or data_args.max_target_length,
           "num_beams": data_args.num_beams or training_args.generation_num_beams}
    if "validation" in data:
        metrics = trainer.evaluate(data["validation"], metric_key_prefix="eval", **gen)
        metrics["eval_samples"] = len(data["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if "test" in data:
        metrics = trainer.predict_to_file(data["test"], metric=wer, metric_key_prefix="predict", **gen)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)


if __name__ == "__main__":
    main(sys.argv[1:])
