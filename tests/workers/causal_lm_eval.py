"""A user's own script: a causal LM's eval loss (perplexity) and logits through the plain `Trainer`, as upstream's
run_clm.py --do_eval computes them; `DeepSpeedInferenceTrainer` and the parser are the only changes.

usage: MODEL_DIR=... causal_lm_eval.py --output_dir OUT [TrainingArguments and flag family]; writes, on the first
process, OUT/result.json and OUT/logits.npy."""

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

from ds_inference_integration import DeepSpeedInferenceArguments, DeepSpeedInferenceTrainer, InferenceArgumentParser

EXAMPLES, LENGTH = 13, 16  # 13 = 3 batches of 4 and one of 1: the replicas' last batches differ in size


def main(argv: list[str]) -> None:
    model_dir = os.environ["MODEL_DIR"]
    training_args, inference_args = InferenceArgumentParser((TrainingArguments, DeepSpeedInferenceArguments)
                                                            ).parse_args_into_dataclasses(argv)
    if os.environ.get("METRIC_PACKAGE"):  # as upstream's scripts load their metric (evaluate.load -> sacrebleu)
        importlib.import_module(os.environ["METRIC_PACKAGE"])
    ids = torch.randint(3, 60, (EXAMPLES, LENGTH), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * LENGTH] * EXAMPLES, "labels": ids})
    trainer = DeepSpeedInferenceTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=training_args,
                                        eval_dataset=data, data_collator=default_data_collator,
                                        inference_args=inference_args)
    metrics = trainer.evaluate()
    predicted = trainer.predict(data)
    if trainer.is_world_process_zero():
        out = Path(training_args.output_dir)
        logits = predicted.predictions
        if logits is not None:
            np.save(out / "logits.npy", logits[0] if isinstance(logits, tuple) else logits)
        (out / "result.json").write_text(json.dumps({"eval_loss": metrics["eval_loss"],
                                                     "test_loss": predicted.metrics["test_loss"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
