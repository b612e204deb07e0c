#!/usr/bin/env python
"""Generate the embedded English -> Romanian number-words translation data set.

Writes train/validation/test json-lines files in the upstream `run_translation.py` format
(`{"translation": {"en": ..., "ro": ...}}`) from `num2words`, with disjoint numbers per split.

    python examples/make_num2words_data.py --output_dir examples/data/num2words
"""

import argparse
import json
import random
from pathlib import Path

from num2words import num2words

SPLITS = (("train", 22000), ("validation", 500), ("test", 203))  # 203: not a multiple of 8


def pair(n: int) -> dict:
    return {"translation": {"en": num2words(n, lang="en"), "ro": num2words(n, lang="ro")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "data" / "num2words"))
    parser.add_argument("--max_number", type=int, default=999_999)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    total = sum(size for _, size in SPLITS)
    numbers = rng.sample(range(args.max_number + 1), total)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    for name, size in SPLITS:
        with open(out / f"{name}.json", "w", encoding="utf-8") as f:
            for n in numbers[start : start + size]:
                f.write(json.dumps(pair(n), ensure_ascii=False) + "\n")
        start += size
        print(f"{name}: {size} pairs -> {out / (name + '.json')}")


if __name__ == "__main__":
    main()
