"""Metrics computed from per-example statistics, so that a streamed (and resumed) predict gets the same
numbers as one computed over the whole set in memory: each example's statistics are stored beside its
prediction, summed at the end (ROUGE's are kept, in input order, for its bootstrap), and turned into the score
once. Each is computed by the package that upstream's `evaluate` script for it wraps (sacrebleu, rouge_score,
jiwer), as that script calls it.

    stats(predictions, references, token_counts) -> one JSON-able value per example (a prediction is a list of
        strings when an example has several generated sequences; token_counts are per example)
    add(totals, one example's stats) -> totals      compute(totals, n) -> {"bleu": ..., "gen_len": ...}
"""

from __future__ import annotations


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
            totals[self.key] = self._start(stats[self.key]) if old is None else self._sum(old, stats[self.key])
        return totals

    def _start(self, first):
        """The totals after the first example with a reference: its statistics themselves, unless overridden."""
        return first

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


class CorpusBleu(_SummedStatistics):
    """sacrebleu's corpus BLEU (as `sacrebleu.corpus_bleu(predictions, [references]).score`) and the mean
    generated length, rounded to 4 digits as upstream's run_translation.py rounds them.

    Corpus BLEU is a function of the n-gram match counts summed over the sentences: sacrebleu itself computes
    it as `_compute_score_from_stats(sum of _extract_corpus_statistics(...))`, and those two methods are what
    is used here (tests/test_streaming.py checks the result equals `corpus_bleu` on fixed strings). Without
    references (data nobody has translated yet) only `gen_len` is reported."""

    key, name = "bleu", "BLEU"

    def __init__(self):
        import logging

        from ..extras import optional_import

        self.bleu = optional_import("sacrebleu.metrics", "BLEU").BLEU()
        logging.getLogger(__name__).info("BLEU is computed with sacrebleu (what evaluate's sacrebleu script wraps) "
                                         "from per-example n-gram statistics")

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("corpus BLEU needs one prediction per example; valid: num_return_sequences 1")
        bleu = (self.bleu._extract_corpus_statistics(predictions, [references]) if references is not None
                else [None] * len(predictions))
        return [{"bleu": [int(x) for x in b] if b is not None else None, "gen_len": int(n)}
                for b, n in zip(bleu, token_counts)]

    def _sum(self, a: list, b: list) -> list:
        return [x + y for x, y in zip(a, b)]

    def _score(self, total: list, n: int) -> dict:
        return {"bleu": round(float(self.bleu._compute_score_from_stats(total).score), 4)}


class Rouge(_SummedStatistics):
    """ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures (x 100, rounded to 4 digits, as upstream's
    run_summarization.py reports them) and the mean generated length, computed by `rouge_score`, the package
    behind upstream's `evaluate.load("rouge")`, the way evaluate's rouge script calls it: a `RougeScorer` over
    the four types scores each (reference, prediction) pair, and a `BootstrapAggregator` given every example's
    scores in input order reports the `mid` F-measure of each type.

    Why not through `evaluate` itself: `evaluate.load("rouge")` fetches its script from the Hub, which a run
    here cannot reach, and a streamed or resumed predict keeps per-example statistics, which the script does
    not hand out (with `use_aggregator=False` it returns F-measures only; the aggregator resamples precision,
    recall and F-measure). So each example's statistics are its scores from `RougeScorer.score`, stored beside
    its prediction, and the aggregation runs once at the end. tests/test_summarization.py checks the result
    equals evaluate's rouge wherever that loads, and the package called in one go always.

    The bootstrap draws from numpy's global generator, which upstream leaves wherever the run left it (so its
    last digits differ between runs); here it is seeded with `seed` for the aggregation and restored after, so
    one process, tp N and a resumed run report the same numbers."""

    KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
    key, name = "rouge", "ROUGE"

    def __init__(self, use_stemmer: bool = True, seed: int = 42, split_sentences: bool = True):
        import logging

        from ..extras import optional_import

        rouge_scorer = optional_import("rouge_score.rouge_scorer", "ROUGE")
        self.scorer = rouge_scorer.RougeScorer(list(self.KEYS), use_stemmer=use_stemmer)
        self.seed = seed
        log = logging.getLogger(__name__)
        log.info("ROUGE is computed with rouge_score (what evaluate's rouge script wraps), per example, then its "
                 "bootstrap aggregator seeded with %d", seed)
        # ROUGE-Lsum scores sentence by sentence, one per line: upstream's run_summarization.py puts each sentence
        # nltk's punkt splitter finds on its own line first. punkt's data is a download nltk does not ship
        # (upstream fetches it at start); without it a text's own lines are its sentences, said in one line.
        self.sentences = None
        if split_sentences:
            nltk = optional_import("nltk", "ROUGE-Lsum")
            try:
                nltk.data.find("tokenizers/punkt_tab")
                self.sentences = nltk.sent_tokenize
            except LookupError:
                log.warning("rougeLsum: nltk's punkt sentence splitter is not installed (python -m nltk.downloader "
                            "punkt_tab), so each text's lines are its sentences")

    def scores(self, prediction: str, reference: str) -> dict[str, list[float]]:
        """One pair's [precision, recall, F-measure] per type, as `RougeScorer.score(target, prediction)` gives."""
        if self.sentences is not None:
            prediction, reference = ("\n".join(self.sentences(t.strip())) for t in (prediction, reference))
        return {k: [float(x) for x in v] for k, v in self.scorer.score(reference, prediction).items()}

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("ROUGE needs one prediction per example; valid: num_return_sequences 1")
        if references is None:
            return [{"rouge": None, "gen_len": int(n)} for n in token_counts]
        return [{"rouge": self.scores(p, r), "gen_len": int(n)} for p, r, n in zip(predictions, references, token_counts)]

    def _start(self, first: dict) -> list[dict]:
        return [first]

    def _sum(self, every: list[dict], one: dict) -> list[dict]:
        """Keeps every example's scores, in the order they are added (the caller's: input order), because the
        bootstrap's resamples depend on it; 12 floats an example."""
        every.append(one)
        return every

    def _score(self, every: list[dict], n: int) -> dict:
        import numpy as np

        from ..extras import optional_import

        scoring = optional_import("rouge_score.scoring", "ROUGE")

        aggregator = scoring.BootstrapAggregator()
        for example in every:
            aggregator.add_scores({k: scoring.Score(*v) for k, v in example.items()})
        state = np.random.get_state()
        np.random.seed(self.seed)
        try:
            result = aggregator.aggregate()
        finally:
            np.random.set_state(state)
        return {k: round(float(result[k].mid.fmeasure) * 100, 4) for k in self.KEYS}


class WordErrorRate(_SummedStatistics):
    """Word error rate x 100 as upstream's run_speech_recognition_seq2seq.py reports it (`100 * wer`) and the mean
    generated length, computed by `jiwer`, the package behind upstream's `evaluate.load("wer")`, the way
    evaluate's wer script calls it: per (reference, prediction) pair its substitutions + deletions + insertions
    and substitutions + deletions + hits (the reference's words), summed over the pairs, then divided. Those two
    counts are each example's statistics (`jiwer.process_words`, jiwer's default transform, as the script's
    `compute_measures`, which jiwer 4 renamed). evaluate's script itself is not loaded, for the reasons given
    under `Rouge`; tests/test_speech.py checks the result equals it wherever it loads, and `jiwer.wer` over the
    whole lists always."""

    key, name = "wer", "WER"

    def __init__(self):
        import logging

        logging.getLogger(__name__).info("WER is computed with jiwer (what evaluate's wer script wraps) from "
                                         "per-example error and reference-word counts")

    def stats(self, predictions: list[str], references: list[str] | None, token_counts: list[int]) -> list:
        if any(isinstance(p, list) for p in predictions):
            raise ValueError("WER needs one prediction per example; valid: num_return_sequences 1")
        if references is None:
            return [{"wer": None, "gen_len": int(n)} for n in token_counts]
        return [{"wer": list(word_errors(p, r)), "gen_len": int(n)} for p, r, n in zip(predictions, references, token_counts)]

    def _sum(self, a: list, b: list) -> list:
        return [a[0] + b[0], a[1] + b[1]]

    def _score(self, total: list, n: int) -> dict:
        errors, words = total
        if not words:
            raise ValueError("WER needs at least one reference word; the references are all empty")
        return {"wer": round(100 * errors / words, 4)}


def word_errors(prediction: str, reference: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words) of one pair, by jiwer's minimal alignment."""
    from ..extras import optional_import

    out = optional_import("jiwer", "WER").process_words(reference, prediction)
    return out.substitutions + out.deletions + out.insertions, out.substitutions + out.deletions + out.hits
