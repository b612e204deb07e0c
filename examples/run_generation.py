#!/usr/bin/env python
"""Batched text generation for decoder-only (and encoder-decoder) models through the Trainer's
predict path, with `--deepspeed_inference` tensor parallelism.

Prompts come from a text file (one per line) or a json-lines file (`--prompt_column`). They are
tokenized once, left-padded per batch with an attention mask (a pad token is added when the
tokenizer has none), generated in real batches, and written in input order with the prompts
stripped: `generated_predictions.txt` (one line per output) and `generated_predictions.jsonl`.

    python examples/run_generation.py --output_dir out --max_new_tokens 24
    deepspeed --num_gpus 2 examples/run_generation.py --output_dir out --deepspeed_inference
"""

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorWithPadding,
    Seq2SeqTrainingArguments,
)

from ds_inference_integration import (
    DeepSpeedInferenceArguments,
    DeepSpeedInferenceSeq2SeqTrainer,
    InferenceArgumentParser,
    InferenceSetupError,
)
from ds_inference_integration.load.loaders import load_model
from ds_inference_integration.predict.data_files import check_data_file
from ds_inference_integration.predict.metrics import GeneratedTokens
from ds_inference_integration.run.files import atomic_path
from ds_inference_integration.run.memory import memory_mb

logger = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


@dataclass
class GenerationArguments:
    model_name_or_path: str = field(default=str(HERE / "models" / "gpt2-num2words-en-ro"),
                                    metadata={"help": "Model directory. Default: the embedded num2words GPT-2."})
    prompts_file: str = field(default=str(HERE / "data" / "prompts.txt"),
                              metadata={"help": "Text file (one prompt per line) or json-lines file."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompt in a json-lines file."})
    max_prompts: int | None = field(default=None, metadata={"help": "Use only the first N prompts."})
    max_new_tokens: int = field(default=24, metadata={"help": "Tokens to generate per output."})
    min_new_tokens: int | None = field(default=None, metadata={"help": "Generate at least this many tokens."})
    do_sample: bool = field(default=False, metadata={"help": "Sample (seeded by --seed) instead of greedy/beam."})
    temperature: float | None = field(default=None, metadata={"help": "Sampling temperature."})
    top_k: int | None = field(default=None, metadata={"help": "Sampling: keep the k most likely tokens."})
    top_p: float | None = field(default=None, metadata={"help": "Sampling: nucleus probability mass."})
    num_beams: int = field(default=1, metadata={"help": "Beam search width."})
    num_return_sequences: int = field(default=1, metadata={"help": "Outputs per prompt."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run the model's own code (its auto_map)"})


def read_prompts(path: str, column: str, limit: int | None) -> list[str]:
    p = Path(path)
    if p.suffix in (".json", ".jsonl"):
        check_data_file(path, "--prompts_file", "prompts")  # missing, not UTF-8, a malformed line: one line
    elif not p.is_file():
        raise InferenceSetupError(f"--prompts_file {path!r} does not exist")
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise InferenceSetupError(f"--prompts_file {path!r} holds a byte that is not UTF-8 at byte {e.start}; valid: "
                                  "a UTF-8 text file") from None
    if p.suffix in (".json", ".jsonl"):
        rows = [json.loads(line) for line in lines]
        missing = [i for i, r in enumerate(rows) if column not in r]
        if missing:
            raise InferenceSetupError(f"--prompts_file {path!r}: line {missing[0] + 1} has no {column!r} column; "
                                      f"columns there: {sorted(rows[missing[0]])}")
        lines = [str(r[column]) for r in rows]
    if limit is not None:
        lines = lines[:limit]
    if not lines:
        raise InferenceSetupError(f"--prompts_file {path!r} holds no prompts")
    return lines


def peak_rss_mb_per_rank() -> list[float]:
    """This process's peak resident memory, gathered from every rank."""
    import torch.distributed as dist

    mine = round(memory_mb("VmHWM"), 1)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def main(argv: list[str]) -> None:
    parser = InferenceArgumentParser((GenerationArguments, Seq2SeqTrainingArguments, DeepSpeedInferenceArguments))
    if len(argv) == 1 and argv[0].endswith(".json"):
        gen_args, training_args, inference_args = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    else:
        gen_args, training_args, inference_args = parser.parse_args_into_dataclasses(argv)
    training_args.predict_with_generate = True
    training_args.remove_unused_columns = False
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    for lg in (logger, logging.getLogger("ds_inference_integration")):
        lg.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    prompts = read_prompts(gen_args.prompts_file, gen_args.prompt_column, gen_args.max_prompts)
    trust = gen_args.trust_remote_code
    config = AutoConfig.from_pretrained(gen_args.model_name_or_path, trust_remote_code=trust)

    tokenizer = AutoTokenizer.from_pretrained(gen_args.model_name_or_path, trust_remote_code=trust)
    tokenizer.padding_side = "left"  # decoder-only batching: new tokens follow every prompt directly
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict(dict(tokenizer(prompts)))
    model_cls = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = load_model(model_cls, gen_args.model_name_or_path, config=config, inference_args=inference_args,
                       training_args=training_args, trust_remote_code=trust)
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=training_args, processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer), inference_args=inference_args,
    )
    gen_kwargs = {k: v for k, v in (("temperature", gen_args.temperature), ("top_k", gen_args.top_k),
                                    ("top_p", gen_args.top_p), ("min_new_tokens", gen_args.min_new_tokens))
                  if v is not None}
    # Streamed: each batch's outputs reach disk as it finishes, and re-running this command after a crash
    # continues where it stopped. Predictions first, metrics last, each file atomically.
    metrics = trainer.predict_to_file(dataset, metric=GeneratedTokens(), metric_key_prefix="predict",
                                      max_new_tokens=gen_args.max_new_tokens, do_sample=gen_args.do_sample,
                                      num_beams=gen_args.num_beams, num_return_sequences=gen_args.num_return_sequences,
                                      **gen_kwargs)
    k = gen_args.num_return_sequences
    new_tokens = metrics.pop("predict_new_tokens")
    metrics.update({"predict_outputs": len(prompts) * k,
                    "predict_peak_rss_mb_per_rank": ", ".join(map(str, peak_rss_mb_per_rank())),
                    "predict_new_tokens": new_tokens,
                    "predict_new_tokens_per_second": round(new_tokens / metrics["predict_runtime"], 2)})
    if trainer.is_world_process_zero():  # the prompts beside their outputs, read back from the merged file
        out = Path(training_args.output_dir)
        with open(out / "generated_predictions.txt", encoding="utf-8") as f, \
                atomic_path(out / "generated_predictions.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as w:
            for prompt in prompts:
                w.write(json.dumps({"prompt": prompt, "generations": [f.readline().rstrip("\n") for _ in range(k)]},
                                   ensure_ascii=False) + "\n")
    trainer.log_metrics("predict", metrics)
    trainer.save_metrics("predict", metrics)


if __name__ == "__main__":
    main(sys.argv[1:])
