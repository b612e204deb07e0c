#!/usr/bin/env python
"""Train the embedded decoder-only default: a small GPT-2 that continues "<English number words> ="
with the Romanian number words, on the same synthetic data as the translation model.

    python examples/train_default_lm.py        # a few minutes on 2 CPU cores

Writes `examples/models/gpt2-num2words-en-ro` (the default `--model_name_or_path` of
`examples/run_generation.py`) and `examples/data/prompts.txt` (held-out prompts of very different lengths).
"""

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
from datasets import load_dataset
from train_default_model import build_tokenizer
from transformers import (
    DataCollatorForLanguageModeling,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

HERE = Path(__file__).parent
SEPARATOR = " ="


def write_prompts(train_file: str, seed: int) -> list[dict]:
    """40 prompts of very different lengths (10 numbers from each of 1-99, 100-9,999, 10,000-99,999 and
    100,000-999,999, none seen in training), shuffled, to examples/data/prompts.txt."""
    from num2words import num2words

    seen = {json.loads(line)["translation"]["en"] for line in open(train_file, encoding="utf-8")}
    rng = random.Random(seed)
    picked = []
    for low, high in ((1, 99), (100, 9_999), (10_000, 99_999), (100_000, 999_999)):
        numbers = [n for n in rng.sample(range(low, high + 1), 60) if num2words(n, lang="en") not in seen][:10]
        picked += [{"en": num2words(n, lang="en"), "ro": num2words(n, lang="ro")} for n in numbers]
    rng.shuffle(picked)
    (HERE / "data" / "prompts.txt").write_text("".join(t["en"] + SEPARATOR + "\n" for t in picked), encoding="utf-8")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(HERE / "data" / "num2words"))
    parser.add_argument("--output_dir", default=str(HERE / "models" / "gpt2-num2words-en-ro"))
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts_only", action="store_true", help="only (re)write examples/data/prompts.txt")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.prompts_only:
        write_prompts(f"{args.data_dir}/train.json", args.seed)
        return

    files = {s: f"{args.data_dir}/{s}.json" for s in ("train", "validation", "test")}
    tokenizer = build_tokenizer([files["train"]], extra=SEPARATOR)
    tokenizer._tokenizer.post_processor = None  # no </s> after prompts; training text adds it explicitly
    tokenizer.padding_side = "right"  # training: positions count from 0 (generation pads left, with a mask)
    config = GPT2Config(vocab_size=(len(tokenizer) + 7) // 8 * 8, n_embd=128, n_layer=4, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel(config)
    raw = load_dataset("json", data_files=files)

    def tokenize(batch):
        texts = [f"{t['en']}{SEPARATOR} {t['ro']} </s>" for t in batch["translation"]]
        return tokenizer(texts, max_length=64, truncation=True)

    data = raw.map(tokenize, batched=True, remove_columns=["translation"])
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="num2words_lm_"), per_device_train_batch_size=64,
                              learning_rate=2e-3, warmup_steps=100, num_train_epochs=args.epochs, logging_steps=100,
                              save_strategy="no", report_to=[], seed=args.seed, use_cpu=True)
    Trainer(model=model, args=targs, train_dataset=data["train"],
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=1, pad_token_id=0, max_new_tokens=24)
    tokenizer.padding_side = "left"
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)

    picked = write_prompts(files["train"], args.seed)
    prompts = [t["en"] + SEPARATOR for t in picked]
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    exact = sum(p.strip() == t["ro"] for p, t in zip(texts, picked)) / len(picked)
    print(f"exact match on {len(picked)} held-out prompts: {exact:.1%}")
    with open(Path(args.output_dir) / "training_summary.json", "w") as f:
        json.dump({"exact_match_heldout_prompts": exact, "prompts": len(picked), "epochs": args.epochs,
                   "script": "examples/train_default_lm.py"}, f, indent=2)


if __name__ == "__main__":
    main()
