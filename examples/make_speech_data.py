#!/usr/bin/env python
"""Generate the embedded speech-recognition data set: numbers read aloud by espeak-ng, with a manifest.

Each clip is one number between 1 and 999 in English words (num2words), spoken by espeak-ng (`-v en -s 200`),
kept at espeak-ng's own rate (22.05 kHz, 16-bit mono FLAC) so that the example's resampling to the model's 16 kHz
runs on the embedded data too; numbers spoken in over 2 s are drawn again. espeak-ng is Debian's `espeak-ng`
package (`apt-get install espeak-ng`); the clips were made with version 1.51.

Writes `<output_dir>/{validation,test}.jsonl` manifests (`{"audio": "audio/....flac", "text": "..."}`, paths
relative to the manifest, as upstream's local-file `audio` column) and the FLAC files beside them.

    python examples/make_speech_data.py --output_dir examples/data/numspeech
"""

import argparse
import io
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import soundfile
from num2words import num2words

MAX_SECONDS = 2.0  # tests/conftest.py's Whisper-style models read 2 s windows
SPLITS = (("validation", 29), ("test", 37))  # not multiples of a batch size


def spoken(text: str, voice: tuple[str, ...] = ("-s", "200")):
    """(samples, rate) of `text` read by espeak-ng (`voice`: its options, speed 200 words a minute by default)."""
    wav = subprocess.run(["espeak-ng", "-v", "en", *voice, "--stdout", text], check=True,
                         capture_output=True, timeout=60).stdout
    return soundfile.read(io.BytesIO(wav), dtype="int16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "data" / "numspeech"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("error: espeak-ng is not installed; valid: Debian's espeak-ng package (apt-get install espeak-ng)")
    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    numbers = rng.sample(range(1, 1000), 999)
    for name, size in SPLITS:
        rows = []
        while len(rows) < size:
            text = num2words(numbers.pop(), lang="en")
            audio, rate = spoken(text)
            if len(audio) > MAX_SECONDS * rate:
                continue
            path = Path("audio") / f"{name}-{len(rows):03d}.flac"
            soundfile.write(out / path, audio, rate, subtype="PCM_16", format="FLAC")
            rows.append({"audio": str(path), "text": text})
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {size} clips -> {out / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
