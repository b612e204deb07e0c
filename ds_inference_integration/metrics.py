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


class _SummedStatistics:
    """A metric whose per-example statistics are summed (`key`: the statistics' name in each example's record;
    `_sum` adds two of them, `_score` turns the sum over n examples into the reported figures), with the mean
    generated length beside it; `corpus` gives the same numbers over a whole set in memory."""

    key = ""
    name = ""

    def add(self, totals: dict | None, stats: dict) -> dict:
        totals = totals or {self.key: None, "gen_len": 0, "with_reference": 0}
        totals["gen_len"] += stats["gen_len"]
        if stats[self.key] is not None:
            totals["with_reference"] += 1
            old = totals[self.key]
            totals[self.key] = stats[self.key] if old is None else self._sum(old, stats[self.key])
        return totals

    def compute(self, totals: dict | None, n: int) -> dict:
        if not totals or not n:
            return {}
        out = {}
        if totals[self.key] is not None:
            if totals["with_reference"] != n:
                raise ValueError(f"{totals['with_reference']} of {n} examples have a reference: {self.name} needs "
                                 "all or none")
            out = self._score(totals[self.key], n)
        out["gen_len"] = round(totals["gen_len"] / n, 4)
        return out

    def corpus(self, predictions: list[str], references: list[str], token_counts: list[int]) -> dict:
        """The same numbers over a whole set in memory (what `compute_metrics` of an evaluate call returns)."""
        totals = None
        for s in self.stats(predictions, references, token_counts):
            totals = self.add(totals, s)
        return self.compute(totals, len(predictions))


class Rouge(_SummedStatistics):
    """ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures (x 100, rounded to 4 digits, as upstream's
    run_summarization.py reports them) and the mean generated length.

    Upstream loads `evaluate.load("rouge")`, which wraps Google's `rouge_score` package. Neither is installable
    here (no network, and the project's package index has neither), so the same scores are computed here, by
    rouge_score's own rules: its tokenizer (lower case, every run of characters other than a-z and 0-9 a
    separator, Porter stemming of tokens longer than 3 with `use_stemmer`, which upstream passes), F-measure
    2PR / (P + R), the LCS for ROUGE-L, and for ROUGE-Lsum its summary-level union LCS over the newline-split
    sentences. Where `evaluate` and its rouge script load, they are used instead, per example
    (`use_aggregator=False`), with one log line saying which. Each example's four F-measures are its
    statistics; the corpus score is their mean (evaluate's bootstrap aggregator estimates the same mean from
    resamples, and so differs from it in the last digits)."""

    KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
    key, name = "rouge", "ROUGE"

    def __init__(self, use_stemmer: bool = True):
        import logging

        self.use_stemmer = use_stemmer
        self.stem = None
        if use_stemmer:
            from nltk.stem import porter  # what rouge_score stems with

            self.stem = porter.PorterStemmer().stem
        self.evaluate = None
        try:
            import evaluate

            self.evaluate = evaluate.load("rouge")
            how = "with evaluate's rouge metric"
        except Exception as e:  # not installed, or its script cannot be fetched offline
            how = f"locally by rouge_score's rules (evaluate's rouge could not be loaded: {type(e).__name__})"
        logging.getLogger(__name__).warning("ROUGE is computed %s", how)

    def tokens(self, text: str) -> list[str]:
        import re

        words = re.split(r"\s+", re.sub(r"[^a-z0-9]+", " ", text.lower()))
        if self.stem is not None:
            words = [self.stem(w) if len(w) > 3 else w for w in words]
        return [w for w in words if re.match(r"^[a-z0-9]+$", w)]

    def scores(self, prediction: str, reference: str) -> dict[str, float]:
        if self.evaluate is not None:
            out = self.evaluate.compute(predictions=[prediction], references=[reference], use_aggregator=False,
                                        use_stemmer=self.use_stemmer)
            return {k: float(out[k][0]) for k in self.KEYS}
        p, r = self.tokens(prediction), self.tokens(reference)
        out = {"rouge1": _ngram_f(p, r, 1), "rouge2": _ngram_f(p, r, 2)}
        out["rougeL"] = _f(*_lcs_hits(r, p, len(p), len(r)))
        ps = [self.tokens(s) for s in prediction.split("\n")]
        rs = [self.tokens(s) for s in reference.split("\n")]
        out["rougeLsum"] = _summary_lcs_f([s for s in rs if s], [s for s in ps if s])
        return out

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("ROUGE needs one prediction per example; valid: num_return_sequences 1")
        if references is None:
            return [{"rouge": None, "gen_len": int(n)} for n in token_counts]
        return [{"rouge": self.scores(p, r), "gen_len": int(n)} for p, r, n in zip(predictions, references, token_counts)]

    def _sum(self, a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in self.KEYS}

    def _score(self, total: dict, n: int) -> dict:
        return {k: round(total[k] / n * 100, 4) for k in self.KEYS}


def _f(hits: int, n_pred: int, n_ref: int) -> float:
    """rouge_score's F-measure of `hits` matched of `n_pred` predicted and `n_ref` reference units."""
    precision = hits / n_pred if n_pred else 0.0
    recall = hits / n_ref if n_ref else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def _ngram_f(pred: list[str], ref: list[str], n: int) -> float:
    from collections import Counter

    p = Counter(tuple(pred[i:i + n]) for i in range(len(pred) - n + 1))
    r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
    hits = sum(min(c, r[g]) for g, c in p.items())
    return _f(hits, sum(p.values()), sum(r.values()))


def _lcs_table(ref: list[str], can: list[str]) -> list[list[int]]:
    table = [[0] * (len(can) + 1) for _ in range(len(ref) + 1)]
    for i in range(1, len(ref) + 1):
        for j in range(1, len(can) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if ref[i - 1] == can[j - 1] else max(table[i - 1][j], table[i][j - 1])
    return table


def _lcs_hits(ref: list[str], can: list[str], n_pred: int, n_ref: int) -> tuple[int, int, int]:
    return _lcs_table(ref, can)[-1][-1] if ref and can else 0, n_pred, n_ref


def _lcs_indices(ref: list[str], can: list[str]) -> list[int]:
    """Positions in `ref` of one longest common subsequence, backtracked as rouge_score's _backtrack_norec."""
    table = _lcs_table(ref, can)
    i, j, found = len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            found.insert(0, i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return found


def _summary_lcs_f(ref_sents: list[list[str]], can_sents: list[list[str]]) -> float:
    """rouge_score's summary-level LCS (ROUGE-Lsum): for each reference sentence the union of its LCS with every
    candidate sentence, each token counted at most as often as it occurs on either side."""
    from collections import Counter

    m, n = sum(map(len, ref_sents)), sum(map(len, can_sents))
    if not m or not n:
        return 0.0
    ref_counts, can_counts = Counter(), Counter()
    for s in ref_sents:
        ref_counts.update(s)
    for s in can_sents:
        can_counts.update(s)
    hits = 0
    for ref in ref_sents:
        union = sorted(set().union(*[set(_lcs_indices(ref, c)) for c in can_sents]))
        for token in (ref[i] for i in union):
            if can_counts[token] > 0 and ref_counts[token] > 0:
                hits += 1
                can_counts[token] -= 1
                ref_counts[token] -= 1
    return _f(hits, n, m)


class WordErrorRate(_SummedStatistics):
    """Word error rate x 100 as upstream's run_speech_recognition_seq2seq.py reports it (`100 * wer`) and the mean
    generated length.

    Upstream loads `evaluate.load("wer")`, which wraps `jiwer`; neither is installable here. jiwer's corpus WER is
    (substitutions + deletions + insertions) / (substitutions + deletions + hits), summed over the sentence pairs,
    with words split on whitespace (its default transform strips and collapses spaces, nothing else). The errors
    of a pair are the word-level Levenshtein distance (jiwer's minimal alignment), and substitutions + deletions +
    hits is the reference's word count: so each example's statistics are (distance, reference words), summed."""

    key, name = "wer", "WER"

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("WER needs one prediction per example; valid: num_return_sequences 1")
        if references is None:
            return [{"wer": None, "gen_len": int(n)} for n in token_counts]
        return [{"wer": [word_edits(p, r), len(r.split())], "gen_len": int(n)}
                for p, r, n in zip(predictions, references, token_counts)]

    def _sum(self, a: list, b: list) -> list:
        return [a[0] + b[0], a[1] + b[1]]

    def _score(self, total: list, n: int) -> dict:
        errors, words = total
        if not words:
            raise ValueError("WER needs at least one reference word; the references are all empty")
        return {"wer": round(100 * errors / words, 4)}


def word_edits(prediction: str, reference: str) -> int:
    """Word-level Levenshtein distance: the fewest substitutions, deletions and insertions."""
    hyp, ref = prediction.split(), reference.split()
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]
