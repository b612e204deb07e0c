"""Metrics computed from per-example statistics, so that a streamed (and resumed) predict gets the same
numbers as one computed over the whole set in memory: each example's statistics are stored beside its
prediction, summed at the end, and turned into the score once.

    stats(predictions, references, token_counts) -> one JSON-able value per example (a prediction is a list of
        strings when an example has several generated sequences; token_counts are per example)
    add(totals, one example's stats) -> totals      compute(totals, n) -> {"bleu": ..., "gen_len": ...}
"""

from __future__ import annotations


class CorpusBleu:
    """sacrebleu's corpus BLEU (as `sacrebleu.corpus_bleu(predictions, [references]).score`) and the mean
    generated length, rounded to 4 digits as upstream's run_translation.py rounds them.

    Corpus BLEU is a function of the n-gram match counts summed over the sentences: sacrebleu itself computes
    it as `_compute_score_from_stats(sum of _extract_corpus_statistics(...))`, and those two methods are what
    is used here (tests/test_streaming.py checks the result equals `corpus_bleu` on fixed strings). Without
    references (data nobody has translated yet) only `gen_len` is reported."""

    def __init__(self):
        from sacrebleu.metrics import BLEU

        self.bleu = BLEU()

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("corpus BLEU needs one prediction per example; valid: num_return_sequences 1")
        bleu = (self.bleu._extract_corpus_statistics(predictions, [references]) if references is not None
                else [None] * len(predictions))
        return [{"bleu": [int(x) for x in b] if b is not None else None, "gen_len": int(n)}
                for b, n in zip(bleu, token_counts)]

    def add(self, totals: dict | None, stats: dict) -> dict:
        totals = totals or {"bleu": None, "gen_len": 0, "with_reference": 0}
        totals["gen_len"] += stats["gen_len"]
        if stats["bleu"] is not None:
            totals["with_reference"] += 1
            totals["bleu"] = stats["bleu"] if totals["bleu"] is None else [a + b for a, b in zip(totals["bleu"], stats["bleu"])]
        return totals

    def compute(self, totals: dict | None, n: int) -> dict:
        if not totals or not n:
            return {}
        out = {"gen_len": round(totals["gen_len"] / n, 4)}
        if totals["bleu"] is not None:
            if totals["with_reference"] != n:
                raise ValueError(f"{totals['with_reference']} of {n} examples have a reference: BLEU needs all or none")
            out["bleu"] = round(float(self.bleu._compute_score_from_stats(totals["bleu"]).score), 4)
        return out


class GeneratedTokens:
    """The number of generated tokens (not padding) over the whole set, as run_generation.py reports it."""

    def stats(self, predictions: list, references, token_counts: list[int]) -> list:
        return [int(n) for n in token_counts]

    def add(self, totals: int | None, stats: int) -> int:
        return (totals or 0) + stats

    def compute(self, totals: int | None, n: int) -> dict:
        return {"new_tokens": int(totals or 0)}
