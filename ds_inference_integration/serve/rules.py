"""The rules each row of a served batch keeps inside transformers' `generate`, on every rank alike: its own minimum,
end (EOS unless `ignore_eos`, its stop ids and strings, its `max_new_tokens`) and sampling (temperature, top-k,
top-p, its own seeded generator); a row from which no token can be taken ends alone with why; a beam batch's guard,
stop strings and cancelled requests; the generation config every row starts from, and which failures end the replica
(`fatal`). `serve/engine.py` and `serve/steps.py` run them."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from .sampling import apply_draw, apply_scores
from .wire import BatchKey


class Refused(Exception):
    """A batch that cannot go on because of what a request asked (every token masked) or what the model gave (scores
    that are not finite): raised alike on every rank, answered with `status` for that request; the replica goes on."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def unusable(scores: torch.Tensor, produced: int) -> list[tuple[int, str] | None]:
    """Per row of `scores` (after every mask), why no token can be taken from it, or None: scores that are NaN or
    +infinity (the model's; a half-precision overflow: no token is right, and a draw from them fails), or every token
    masked (the request's own rules: stop ids held back by min_tokens, suppressed or bad words covering the
    vocabulary; greedy took token 0 then, and a draw failed)."""
    broken = (torch.isnan(scores) | torch.isposinf(scores)).any(-1).tolist()
    empty = torch.isneginf(scores).all(-1).tolist()
    where = f"at new token {produced + 1}"
    return [(500, f"the model's scores are not finite {where} (NaN or infinity: a half-precision overflow?)") if b
            else (400, f"every token is masked {where}: the request's rules (stop_token_ids with min_tokens, "
                       "suppress_tokens, bad_words_ids, no_repeat_ngram_size) leave nothing to generate; valid: rules "
                       "that leave a token") if e else None for b, e in zip(broken, empty)]


def sample(scores: torch.Tensor, row, generator: torch.Generator) -> int:
    """One token of a sampled row, as generate samples it (temperature, top-k, top-p, a draw from the row's own
    generator). Where the temperature is so small that scores / temperature overflows a float (1e-40: transformers'
    own warper then fails on NaN), the tokens of the highest score are the draw's only candidates, which is the limit
    the distribution tends to; everywhere else the arithmetic is generate's, so a seeded row equals
    `run_generation.py --do_sample` in one process."""
    logits = scores.float() / row.temperature
    if not torch.isfinite(logits.max()):
        logits = torch.where(scores == scores.max(), 0.0, -float("inf"))
    logits = apply_draw(logits, row)  # the rules' own (`sampling.RULES`), after the temperature
    top_k = row.top_k or 0
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    top_p = row.top_p
    if top_p < 1.0:
        ordered, index = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, index, drop), -float("inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


class RowRules:
    """A logits processor for per-row rules: EOS held back until a row's `min_tokens`, then, for a sampled row
    (temperature > 0), a draw (`sample`), written back as a one-hot score so that generate's greedy step takes it.
    Greedy rows pass through unchanged. A row from which no token can be taken (`unusable`) is marked failed, with
    why, and given a filler token that RowStops drops as it ends the row: the other rows go on."""

    def __init__(self, rows: list, start: int, eos: list[int], device, finished: list | None = None):
        self.rows, self.start, self.eos = rows, start, eos
        self.finished = finished if finished is not None else [None] * len(rows)  # RowStops' lengths: rows that ended
        self.failed: dict[int, tuple[int, str]] = {}
        self.generators = []
        for row in rows:
            g = None
            if row.temperature > 0:
                g = torch.Generator(device=device)
                g.manual_seed(int(row.seed))
            self.generators.append(g)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        produced = input_ids.shape[1] - self.start
        scores = scores.clone()
        for i, row in enumerate(self.rows):
            if produced > 0:
                apply_scores(scores[i], input_ids[i, self.start:], row)  # the rules' own (`sampling.RULES`)
            if produced < row.min_tokens:  # EOS and the row's stop tokens wait for its minimum (vLLM's rule)
                held = [*self.eos, *row.stop_token_ids]
                if held:
                    scores[i, held] = -float("inf")
        verdicts = unusable(scores, produced)
        for i, row in enumerate(self.rows):
            if self.finished[i] is not None or i in self.failed:
                continue
            if verdicts[i] is not None:
                self.failed[i] = verdicts[i]
                scores[i] = 0.0  # any token: the row ends at this step and the token is not kept
                continue
            if self.generators[i] is not None:
                choice = sample(scores[i], row, self.generators[i])
                scores[i] = -float("inf")
                scores[i, choice] = 0.0
        return scores


class BeamGuard:
    """The last logits processor of a beam batch: a request whose every beam has nothing to take (`unusable`), or
    whose scores are not finite, ends the batch with `Refused` on every rank (generate cannot drop one request)."""

    def __init__(self, num_beams: int, start: int):
        self.num_beams, self.start = num_beams, start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        verdicts = unusable(scores, input_ids.shape[1] - self.start)
        for r in range(len(verdicts) // self.num_beams):
            beams = verdicts[r * self.num_beams:(r + 1) * self.num_beams]
            broken = next((v for v in beams if v is not None and v[0] == 500), None)
            if broken or all(v is not None for v in beams):
                status, why = broken or beams[0]
                raise Refused(status, f"prompt {r}: {why}")
        return scores


class RowStops:
    """A stopping criterion with each row's own end: EOS (unless `ignore_eos`, and not before `min_tokens`), its
    `max_new_tokens`, its stop strings; a row RowRules failed (its filler token dropped) and a row whose client left
    (`control`) end too. `report(step, tokens, finished, failed)` is called after every step on the leader (the new
    token of each row still running, the rows that finished now with their reason and new tokens, the rows that
    failed now with status and why), each keyed by the row's place in the batch."""

    def __init__(self, rows: list, start: int, eos: list[int], tokenizer, report=None, control=None):
        self.rows, self.start, self.eos, self.tokenizer, self.report = rows, start, set(eos), tokenizer, report
        self.control = control
        self.lengths: list[int | None] = [None] * len(rows)
        self.reasons: list[str | None] = [None] * len(rows)
        self.rules: RowRules | None = None  # set by run_batch: the rows it failed

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.start:]
        produced = new.shape[1]
        cancelled = self.control.step([row.id for row in self.rows]) if self.control is not None else None
        done = torch.zeros(len(self.rows), dtype=torch.bool, device=input_ids.device)
        tokens, finished, failed = {}, {}, {}
        for i, row in enumerate(self.rows):
            if self.lengths[i] is not None:
                done[i] = True
                continue
            if self.rules is not None and i in self.rules.failed:
                self.lengths[i], self.reasons[i] = produced - 1, "error"
                failed[i] = list(self.rules.failed[i])
                done[i] = True
                continue
            if cancelled is not None and cancelled[i]:
                self.lengths[i], self.reasons[i] = produced - 1, "cancelled"
                done[i] = True
                continue
            last = int(new[i, -1])
            tokens[i] = last
            reason = row_end(row, last, produced, self.eos, lambda i=i: self.tokenizer.decode(
                new[i], skip_special_tokens=True))
            if reason:
                self.lengths[i], self.reasons[i] = produced, reason
                finished[i] = (reason, new[i].tolist())
                done[i] = True
        if self.report is not None:
            self.report(produced, tokens, finished, failed)
        return done


def row_end(row, last: int, produced: int, eos: set[int], text) -> str | None:
    """Why a row ends with its new token `last`, its `produced`-th: "stop" (EOS unless `ignore_eos`, or one of its
    stop ids, neither before `min_tokens`; one of its stop strings in its new text, `text()`), "length" (its
    `max_new_tokens`), or None. Both engines end rows by it."""
    if last in eos and not row.ignore_eos and produced >= row.min_tokens:
        return "stop"
    if last in row.stop_token_ids and produced >= row.min_tokens:
        return "stop"
    if row.stop and any(s in text() for s in row.stop):
        return "stop"
    if produced >= row.max_new_tokens:
        return "length"
    return None


class BeamSteps:
    """A beam batch's stopping criterion for what generate's own rules do not know: a request whose client left
    (`control`) has every candidate of its beams end now, so beam search drops it (and stops once every request is
    done or gone); a candidate whose new text holds one of the batch's stop strings ends as a finished hypothesis,
    as transformers' StopStringCriteria would end it, which fails on the embedded models' word-level tokenizers
    ("ValueError: substring not found" in its vocabulary cleaning, before the first token; found by the serve fuzz)."""

    def __init__(self, ids: list[int], control, stops: tuple[str, ...], start: int, tokenizer):
        self.ids, self.control, self.stops, self.start, self.tokenizer = ids, control, stops, start, tokenizer

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.control is not None:
            cancelled = self.control.step(self.ids).to(input_ids.device)
            done |= cancelled.repeat_interleave(input_ids.shape[0] // len(self.ids))
        if self.stops:
            texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
            done |= torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)
        return done


def generation_config(model, key: BatchKey, max_new_tokens: int | None, pad_token_id: int | None):
    """The generation config rows of `key` are generated with: the model's own, /generate's settings, the key's beam
    settings and penalties, and none of generate's own sampling or ending for greedy and sampled rows (`RowRules`
    and `RowStops` keep each row's)."""
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.update(**{name: json.loads(value) for name, value in key.generate})  # /generate's (GENERATE_PASSED)
    config.num_beams = key.num_beams
    config.num_return_sequences = key.num_return_sequences
    config.do_sample = False  # sampling is per row, in RowRules
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.min_new_tokens = None
    config.min_length = 0
    if key.repetition_penalty is not None:
        config.repetition_penalty = key.repetition_penalty
    if key.length_penalty is not None:
        config.length_penalty = key.length_penalty
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    if key.num_beams == 1:
        config.eos_token_id = None  # RowStops ends each row at EOS itself (`_without` keeps generate from refilling it)
    elif key.min_tokens:
        config.min_new_tokens = key.min_tokens
    config.temperature, config.top_k, config.top_p = 1.0, None, 1.0  # no warpers: RowRules samples
    # a key/value cache whatever the checkpoint's config says: `"use_cache": false` (saved by a training run, as
    # the embedded GPT-2's and T5's were) made generate run every step over the whole sequence (28 ms a step for 16
    # rows of 96 tokens, 2-layer GPT-2 of width 128, against about 2 with the cache; the same tokens)
    config.use_cache = True
    return config


def with_defaults(model, config):
    """`config` with what generate fills before it runs (`_prepare_generation_config`, transformers 5): the model's
    own generation config, then transformers' defaults, into each field still None (length_penalty 1.0,
    early_stopping False...). The step engine builds generate's processors and beam search from it."""
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**model.generation_config._get_default_generation_params(), defaults_only=True)
    return config


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def fatal(error: BaseException) -> bool:
    """Whether a failure during a batch leaves this rank untrusted, so that the replica must end (the front then
    answers 503 and exits for a supervisor to restart it): a collective or a connection that broke (the ranks may
    no longer be in step), inputs that differed between ranks, a device error (CUDA's poison the context for every
    later call). Anything else (an exception in generate or our rules, an overflow, an allocation that failed) is
    that batch's failure, answered to its requests, and the replica goes on."""
    from ..errors import LockstepError  # (errors imports nothing of serve)

    return (not isinstance(error, Exception)
            or isinstance(error, (dist.DistError, ConnectionError, TimeoutError, EOFError, LockstepError,
                                  torch.AcceleratorError))
            or "CUDA error" in str(error))


def own_failure(error: Exception) -> tuple[int, str]:
    """(status, why) of a failure that is its rows' own: a `Refused` row's status and words, else a 500 naming the
    exception in one line; a `fatal` one is raised again (it ends the replica)."""
    from ..errors import first_line

    if fatal(error):
        raise error
    if isinstance(error, Refused):
        return error.status, str(error)
    return 500, f"generate failed: {type(error).__name__}: {first_line(error)}"[:300]
