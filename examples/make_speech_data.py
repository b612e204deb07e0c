#!/usr/bin/env python
"""Generate the embedded speech-recognition data set: number words "read aloud" as tones, with a manifest.

There is no text-to-speech engine here (no espeak-ng), so each word of the embedded tokenizer's vocabulary gets
its own sound: 0.1 s of two sine tones whose pitches are drawn from the word (a fixed seed), with a short fade,
then 0.02 s of silence. A clip is the sound of each word of one number written in English words, at 16 kHz,
16-bit mono wav, under 1 s. It is a stand-in that a Whisper-style model can read, not speech.

Writes `<output_dir>/{validation,test}.jsonl` manifests (`{"audio": "wav/....wav", "text": "..."}`, paths
relative to the manifest, as upstream's local-file `audio` column) and the wav files beside them.

    python examples/make_speech_data.py --output_dir examples/data/numspeech
"""

import argparse
import json
import random
import re
import zlib
from pathlib import Path

import numpy as np
import soundfile
from num2words import num2words

RATE = 16_000
WORD_SECONDS, GAP_SECONDS = 0.1, 0.02
SPLITS = (("validation", 29), ("test", 37))  # not multiples of a batch size
WORDS = re.compile(r"\w+|[^\w\s]+")


def word_sound(word: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(word.encode()))
    low, high = rng.uniform(200, 900), rng.uniform(1000, 3500)
    t = np.arange(int(WORD_SECONDS * RATE)) / RATE
    tone = 0.4 * np.sin(2 * np.pi * low * t) + 0.3 * np.sin(2 * np.pi * high * t)
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    return np.concatenate([tone * fade, np.zeros(int(GAP_SECONDS * RATE))])


def clip(text: str) -> np.ndarray:
    return np.concatenate([word_sound(w) for w in WORDS.findall(text)]).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "data" / "numspeech"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    (out / "wav").mkdir(parents=True, exist_ok=True)
    numbers = rng.sample(range(1, 1000), sum(n for _, n in SPLITS))
    for name, size in SPLITS:
        rows = []
        for n in numbers[:size]:
            text = num2words(n, lang="en")
            audio = clip(text)
            while len(audio) > RATE:  # under one second: Whisper-style models here read 1 s windows
                n = rng.randrange(1, 100)
                text, audio = num2words(n, lang="en"), clip(num2words(n, lang="en"))
            path = Path("wav") / f"{name}-{len(rows):03d}.wav"
            soundfile.write(out / path, audio, RATE, subtype="PCM_16")
            rows.append({"audio": str(path), "text": text})
        numbers = numbers[size:]
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {size} clips -> {out / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
