#!/usr/bin/env python
"""Train the embedded default speech model: a small Whisper-style model that transcribes English numbers read
aloud by espeak-ng (the embedded set, `examples/data/numspeech`), with the embedded translation model's word-level
tokenizer and a Whisper feature extractor of 2 s windows and 40 mel bins.

    python examples/train_default_speech.py        # 2 minutes on 2 CPU cores; needs espeak-ng

Training clips are spoken here, not committed: every number from 1 to 999 that is not in the validation or test
set, each read at several speeds and pitches (`make_speech_data.spoken` with espeak-ng's `-s` and `-p`). Writes
the model, tokenizer, feature extractor and generation config to `examples/models/whisper-numspeech` (the default
`--model_name_or_path` of `examples/run_speech_recognition_seq2seq.py`).
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch
from datasets import Dataset
from make_speech_data import MAX_SECONDS, spoken
from num2words import num2words
from run_speech_recognition_seq2seq import read_clip
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from ds_inference_integration.predict.metrics import WordErrorRate

HERE = Path(__file__).parent
VOICES = [(s, p) for s in (150, 200, 250) for p in (35, 50, 65)]  # espeak-ng's speed (words/min) and pitch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(HERE / "data" / "numspeech"))
    parser.add_argument("--tokenizer", default=str(HERE / "models" / "t5-num2words-en-ro"))
    parser.add_argument("--output_dir", default=str(HERE / "models" / "whisper-numspeech"))
    parser.add_argument("--voices", type=int, default=4, help="readings of each training number")
    parser.add_argument("--epochs", type=float, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    rng = random.Random(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    extractor = WhisperFeatureExtractor(feature_size=40, sampling_rate=16000, hop_length=160, chunk_length=2, n_fft=400)
    rate = extractor.sampling_rate
    data_dir = Path(args.data_dir)
    held = {split: [json.loads(line) for line in open(data_dir / f"{split}.jsonl")] for split in ("validation", "test")}
    held_out = {r["text"] for rows in held.values() for r in rows}

    features, texts = [], []
    for n in range(1, 1000):
        text = num2words(n, lang="en")
        if text in held_out:
            continue
        for speed, pitch in rng.sample(VOICES, args.voices):
            audio, source_rate = spoken(text, ("-s", str(speed), "-p", str(pitch)))
            if len(audio) > MAX_SECONDS * source_rate:
                continue
            with tempfile.NamedTemporaryFile(suffix=".wav") as f:  # through the example's own reader and resampler
                soundfile.write(f.name, audio, source_rate, subtype="PCM_16")
                samples = read_clip(Path(f.name), rate)
            features.append(extractor(samples, sampling_rate=rate).input_features[0])
            texts.append(text)
    print(f"{len(texts)} training clips spoken in {time.perf_counter() - start:.0f} s")

    def encode(rows):
        return {"input_features": np.stack(rows["input_features"]).astype(np.float32),
                "labels": tokenizer(rows["text"])["input_ids"]}

    train = Dataset.from_dict({"input_features": features, "text": texts})

    def collate(rows):
        width = max(len(r["labels"]) for r in rows)
        return {"input_features": torch.tensor(np.stack([r["input_features"] for r in rows]), dtype=torch.float32),
                "labels": torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])}

    train = train.map(encode, batched=True, remove_columns=["text"])
    config = WhisperConfig(vocab_size=(len(tokenizer) + 7) // 8 * 8, d_model=128, encoder_layers=3, decoder_layers=3,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                           decoder_ffn_dim=512, num_mel_bins=40, max_source_positions=100, max_target_positions=64,
                           pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                           suppress_tokens=None, begin_suppress_tokens=None, dropout=0.0)
    model = WhisperForConditionalGeneration(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    targs = Seq2SeqTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="numspeech_train_"), per_device_train_batch_size=32, learning_rate=1e-3,
        warmup_steps=100, num_train_epochs=args.epochs, lr_scheduler_type="linear", logging_steps=50,
        save_strategy="no", report_to=[], seed=args.seed, use_cpu=True, remove_unused_columns=False,
    )
    Seq2SeqTrainer(model=model, args=targs, train_dataset=train, data_collator=collate).train()

    model.generation_config = GenerationConfig(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, max_length=32)
    model.eval()
    rows = held["test"]
    batch = [extractor(read_clip(data_dir / r["audio"], rate), sampling_rate=rate).input_features[0] for r in rows]
    with torch.no_grad():
        out = model.generate(input_features=torch.tensor(np.stack(batch)), max_length=32)
    preds = [p.strip() for p in tokenizer.batch_decode(out, skip_special_tokens=True)]
    # references through the tokenizer, as the example decodes its labels ("fifty-five" comes back "fifty - five")
    refs = [r.strip() for r in tokenizer.batch_decode(tokenizer([r["text"] for r in rows]).input_ids,
                                                      skip_special_tokens=True)]
    wer = WordErrorRate().corpus(preds, refs, [0] * len(rows))["wer"]
    minutes = (time.perf_counter() - start) / 60
    print(f"test WER {wer} on {len(rows)} clips, {minutes:.1f} minutes; e.g. {preds[:3]}")

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    extractor.save_pretrained(args.output_dir)
    with open(Path(args.output_dir) / "training_summary.json", "w") as f:
        json.dump({"test_wer": wer, "test_clips": len(rows), "training_clips": len(texts), "epochs": args.epochs,
                   "seed": args.seed, "minutes": round(minutes, 1), "script": "examples/train_default_speech.py"},
                  f, indent=2)


if __name__ == "__main__":
    main()
