#!/usr/bin/env python
"""Generate the embedded summarization data set (a synthetic task in the embedded tokenizer's words).

Each document lists between 2 and 40 numbers in English words, separated by colons; its summary is the first and
the last of them. json-lines files in upstream `run_summarization.py`'s column format (`document`, `summary`,
as XSum), with disjoint numbers per split. The longest documents run past 128 tokens, so a run with
`--max_source_length 128` truncates some of them.

    python examples/make_summarization_data.py --output_dir examples/data/numsum
"""

import argparse
import json
import random
from pathlib import Path

from num2words import num2words

SPLITS = (("train", 400), ("validation", 29), ("test", 37))  # 29 and 37: not multiples of a batch size


def example(rng: random.Random, numbers: list[int]) -> dict:
    words = [num2words(n, lang="en") for n in numbers]
    return {"document": " : ".join(words), "summary": f"{words[0]} : {words[-1]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "data" / "numsum"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pool = rng.sample(range(1_000_000), 40_000)
    start = 0
    for name, size in SPLITS:
        with open(out / f"{name}.json", "w", encoding="utf-8") as f:
            for _ in range(size):
                k = rng.choice([2, 3, 4, 6, 8, 12, 40])
                f.write(json.dumps(example(rng, pool[start:start + k])) + "\n")
                start += k
        print(f"{name}: {size} documents -> {out / (name + '.json')}")


if __name__ == "__main__":
    main()
