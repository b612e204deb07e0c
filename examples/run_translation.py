#!/usr/bin/env python
"""Translation evaluation/prediction in the shape of Hugging Face's
`examples/pytorch/translation/run_translation.py`, plus `--deepspeed_inference`.

With no model or data arguments it uses the embedded default: a small T5 that translates English
number words into Romanian (`examples/models/t5-num2words-en-ro`) and its data
(`examples/data/num2words`). Single process:

    python examples/run_translation.py --output_dir out --do_predict --predict_with_generate \
        --source_lang en --target_lang ro --source_prefix 'translate English to Romanian: '

Tensor parallel over 2 ranks (CPU ranks when there is no GPU): the same command under
`deepspeed --num_gpus 2` with `--deepspeed_inference` added.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sacrebleu
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainingArguments,
    default_data_collator,
    set_seed,
)

from ds_inference_integration import (
    DeepSpeedInferenceArguments,
    DeepSpeedInferenceSeq2SeqTrainer,
    InferenceArgumentParser,
    InferenceSetupError,
)
from ds_inference_integration.load.loaders import load_model
from ds_inference_integration.predict.metrics import CorpusBleu
from ds_inference_integration.predict.positions import check_lengths_fit

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = str(HERE / "models" / "t5-num2words-en-ro")
DEFAULT_DATA = HERE / "data" / "num2words"


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "Path to a model directory or a hub id. Default: the embedded num2words T5."},
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloaded models"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers-backed) tokenizer"})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)"})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code from the hub"})


@dataclass
class DataTrainingArguments:
    source_lang: str = field(default=None, metadata={"help": "Source language id for translation."})
    target_lang: str = field(default=None, metadata={"help": "Target language id for translation."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    train_file: str | None = field(default=None, metadata={"help": "json-lines training file."})
    validation_file: str | None = field(default=None, metadata={"help": "json-lines validation file."})
    test_file: str | None = field(default=None, metadata={"help": "json-lines test file."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Overwrite the cached data sets"})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Preprocessing processes."})
    max_source_length: int | None = field(default=1024, metadata={"help": "Max source tokens; longer is truncated."})
    max_target_length: int | None = field(default=128, metadata={"help": "Max target tokens; longer is truncated."})
    val_max_target_length: int | None = field(
        default=None, metadata={"help": "Max target tokens for evaluation; also generate's max_length."}
    )
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every sample to the max length."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set."})
    num_beams: int | None = field(default=1, metadata={"help": "Beams for evaluate/predict generation."})
    ignore_pad_token_for_loss: bool = field(default=True, metadata={"help": "Ignore padded label tokens in the loss."})
    source_prefix: str | None = field(default=None, metadata={"help": "Prefix for every source text (T5)."})
    forced_bos_token: str | None = field(default=None, metadata={"help": "Token forced first after the decoder start (mBART)."})

    def __post_init__(self):
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            self.train_file, self.validation_file, self.test_file = (
                str(DEFAULT_DATA / f"{s}.json") for s in ("train", "validation", "test")
            )
        if self.source_lang is None or self.target_lang is None:
            raise InferenceSetupError("--source_lang and --target_lang are required (e.g. --source_lang en --target_lang ro)")
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and path.rsplit(".", 1)[-1] not in ("json", "jsonl"):
                raise InferenceSetupError(f"--{name} {path!r} must be a json or jsonl file")
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


def parse_args(argv: list[str]):
    parser = InferenceArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments,
                                      DeepSpeedInferenceArguments))
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(argv)


def main(argv: list[str]) -> None:
    model_args, data_args, training_args, inference_args = parse_args(argv)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    for lg in (logger, logging.getLogger("ds_inference_integration"), transformers.utils.logging.get_logger()):
        lg.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, "
        f"world size: {training_args.world_size}, deepspeed_inference: {inference_args.deepspeed_inference}"
    )
    set_seed(training_args.seed)

    # Data: the parser has checked each --{split}_file (missing, empty, not UTF-8, a malformed line, the languages of
    # its 'translation' column) on every rank, before anything loaded: one line naming the file
    if data_args.dataset_name is not None:
        raw_datasets = load_dataset(
            data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir,
            token=model_args.token,
        )
    else:
        data_files = {}
        for split in ("train", "validation", "test"):
            if getattr(data_args, f"{split}_file") is not None:
                data_files[split] = getattr(data_args, f"{split}_file")
                extension = data_files[split].split(".")[-1]
        raw_datasets = load_dataset("json" if extension == "jsonl" else extension, data_files=data_files,
                                    cache_dir=model_args.cache_dir, token=model_args.token)

    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir,
        revision=model_args.model_revision, token=model_args.token, trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir,
        use_fast=model_args.use_fast_tokenizer, revision=model_args.model_revision, token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    # Under --deepspeed_inference each rank reads only its shard where the checkpoint allows (--loading); the
    # policy and head counts were checked by the parser
    model = load_model(
        AutoModelForSeq2SeqLM, model_args.model_name_or_path, config=config, inference_args=inference_args,
        training_args=training_args, cache_dir=model_args.cache_dir, revision=model_args.model_revision,
        token=model_args.token, trust_remote_code=model_args.trust_remote_code,
    )
    if model.config.decoder_start_token_id is None:
        raise InferenceSetupError("the model config has no decoder_start_token_id; set it in config.json")
    # upstream refuses a --max_source_length beyond the positions of a model with absolute ones
    check_lengths_fit(model.config, source={"--max_source_length": data_args.max_source_length})

    prefix = data_args.source_prefix if data_args.source_prefix is not None else ""
    if training_args.do_train:
        column_names = raw_datasets["train"].column_names
    elif training_args.do_eval:
        column_names = raw_datasets["validation"].column_names
    elif training_args.do_predict:
        column_names = raw_datasets["test"].column_names
    else:
        logger.info("There is nothing to do. Please pass `do_train`, `do_eval` and/or `do_predict`.")
        return

    if hasattr(tokenizer, "lang_code_to_id"):  # mBART-style multilingual tokenizers
        tokenizer.src_lang, tokenizer.tgt_lang = data_args.source_lang, data_args.target_lang
        forced_bos_token_id = (
            tokenizer.lang_code_to_id[data_args.forced_bos_token] if data_args.forced_bos_token is not None else None
        )
        model.config.forced_bos_token_id = forced_bos_token_id
    elif data_args.forced_bos_token is not None:
        model.config.forced_bos_token_id = tokenizer.convert_tokens_to_ids(data_args.forced_bos_token)

    source_lang, target_lang = data_args.source_lang.split("_")[0], data_args.target_lang.split("_")[0]
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess_function(examples, max_target_length):
        inputs = [ex[source_lang] for ex in examples["translation"]]
        inputs = [prefix + inp for inp in inputs]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding=padding, truncation=True)
        if all(target_lang in ex for ex in examples["translation"]):
            targets = [ex[target_lang] for ex in examples["translation"]]
            labels = tokenizer(text_target=targets, max_length=max_target_length, padding=padding, truncation=True)
            if padding == "max_length" and data_args.ignore_pad_token_for_loss:
                labels["input_ids"] = [
                    [(t if t != tokenizer.pad_token_id else -100) for t in label] for label in labels["input_ids"]
                ]
            model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    def prepare(split: str, max_samples: int | None, max_target_length: int):
        if split not in raw_datasets:
            raise InferenceSetupError(f"{split!r} split missing: pass --{split}_file or a dataset that has it")
        ds = raw_datasets[split]
        if max_samples is not None:
            ds = ds.select(range(min(len(ds), max_samples)))
        with training_args.main_process_first(desc=f"{split} dataset map pre-processing"):
            ds = ds.map(
                preprocess_function, batched=True, num_proc=data_args.preprocessing_num_workers,
                remove_columns=column_names, load_from_cache_file=not data_args.overwrite_cache,
                fn_kwargs={"max_target_length": max_target_length}, desc=f"Running tokenizer on {split} dataset",
            )
        return ds

    train_dataset = prepare("train", data_args.max_train_samples, data_args.max_target_length) if training_args.do_train else None
    eval_dataset = (prepare("validation", data_args.max_eval_samples, data_args.val_max_target_length)
                    if training_args.do_eval else None)
    predict_dataset = (prepare("test", data_args.max_predict_samples, data_args.val_max_target_length)
                       if training_args.do_predict else None)

    label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        data_collator = DataCollatorForSeq2Seq(
            tokenizer, model=model, label_pad_token_id=label_pad_token_id,
            pad_to_multiple_of=8 if training_args.fp16 else None,
        )

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded_preds = [p.strip() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = [label.strip() for label in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        result = {"bleu": sacrebleu.corpus_bleu(decoded_preds, [decoded_labels]).score}
        prediction_lens = [np.count_nonzero(pred != tokenizer.pad_token_id) for pred in preds]
        result["gen_len"] = np.mean(prediction_lens)
        return {k: round(float(v), 4) for k, v in result.items()}

    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
        inference_args=inference_args,
    )

    if training_args.do_train:
        train_result = trainer.train()
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    max_length = training_args.generation_max_length or data_args.val_max_target_length
    num_beams = data_args.num_beams if data_args.num_beams is not None else training_args.generation_num_beams
    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(max_length=max_length, num_beams=num_beams, metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        # Streamed: each batch's predictions reach disk as it finishes, and re-running this command after a
        # crash continues where it stopped (--overwrite_output_dir starts afresh). Predictions first, metrics
        # last, each file atomically: metrics on disk always describe written predictions.
        metrics = trainer.predict_to_file(predict_dataset, metric=CorpusBleu(), metric_key_prefix="predict",
                                          max_length=max_length, num_beams=num_beams)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)


if __name__ == "__main__":
    main(sys.argv[1:])
