#!/usr/bin/env python
"""Train the embedded default model: a 1.4M-parameter T5 that translates English number words
into Romanian number words, with a word-level tokenizer built from the training data.

    python examples/make_num2words_data.py        # data, if not there yet
    python examples/train_default_model.py        # ~10 minutes on 2 CPU cores

Writes the model, tokenizer and generation config to `examples/models/t5-num2words-en-ro`
(the default `--model_name_or_path` of `examples/run_translation.py`).
"""

import argparse
import json
import re
import tempfile
from pathlib import Path

import sacrebleu
import torch
from datasets import load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    DataCollatorForSeq2Seq,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

HERE = Path(__file__).parent
PREFIX = "translate English to Romanian: "
SPECIALS = ["<pad>", "</s>", "<unk>"]
WORDS = re.compile(r"\w+|[^\w\s]+")


def build_tokenizer(files: list[str], extra: str = PREFIX) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over every word in `files` plus the words of `extra` (the T5 task prefix)."""
    words = set(WORDS.findall(extra))
    for path in files:
        for line in open(path, encoding="utf-8"):
            for text in json.loads(line)["translation"].values():
                words.update(WORDS.findall(text))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(HERE / "data" / "num2words"))
    parser.add_argument("--output_dir", default=str(HERE / "models" / "t5-num2words-en-ro"))
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    files = {s: f"{args.data_dir}/{s}.json" for s in ("train", "validation", "test")}
    tokenizer = build_tokenizer([files["train"]])
    vocab_size = (len(tokenizer) + 7) // 8 * 8
    config = T5Config(
        vocab_size=vocab_size, d_model=128, d_kv=32, d_ff=512, num_layers=3, num_decoder_layers=3,
        num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        feed_forward_proj="relu", tie_word_embeddings=True,
    )
    model = T5ForConditionalGeneration(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M, vocab {len(tokenizer)}")

    raw = load_dataset("json", data_files=files)

    def preprocess(batch):
        src = [PREFIX + t["en"] for t in batch["translation"]]
        tgt = [t["ro"] for t in batch["translation"]]
        enc = tokenizer(src, max_length=64, truncation=True)
        enc["labels"] = tokenizer(text_target=tgt, max_length=64, truncation=True)["input_ids"]
        return enc

    data = raw.map(preprocess, batched=True, remove_columns=["translation"])
    targs = Seq2SeqTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="num2words_train_"), per_device_train_batch_size=64,
        per_device_eval_batch_size=64, learning_rate=2e-3, warmup_steps=100, num_train_epochs=args.epochs,
        lr_scheduler_type="linear", logging_steps=100, save_strategy="no", report_to=[],
        predict_with_generate=True, generation_max_length=40, seed=args.seed, use_cpu=True,
    )
    trainer = Seq2SeqTrainer(
        model=model, args=targs, train_dataset=data["train"],
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer,
    )
    trainer.train()

    model.generation_config = GenerationConfig(
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, max_length=40
    )
    out = trainer.predict(data["test"], max_length=40, num_beams=1)
    preds = tokenizer.batch_decode(out.predictions[: len(data["test"])], skip_special_tokens=True)
    refs = [t["ro"] for t in raw["test"]["translation"]]
    bleu = sacrebleu.corpus_bleu(preds, [refs]).score
    print(f"test BLEU {bleu:.2f} on {len(refs)} examples")

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    with open(Path(args.output_dir) / "training_summary.json", "w") as f:
        json.dump({"test_bleu": round(bleu, 2), "test_examples": len(refs), "epochs": args.epochs,
                   "seed": args.seed, "script": "examples/train_default_model.py"}, f, indent=2)


if __name__ == "__main__":
    main()
