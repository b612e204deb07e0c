"""How a row's next token is chosen, in one place: the sampling parameters a row carries from the HTTP body to the
sampler, and the rules that read them.

`SamplingParams` is the part of a row's record that says it (`wire.RowSpec` extends it, so the front's `protocol.Row`
and every rank's row hold one): the draw's temperature (0: greedy), top-k, top-p and seed (`rules.sample`), and each
rule's own fields. A rule (`Rule`, listed in `RULES`) names the request fields it reads with their range, whether it
can change a greedy row's token, whether beam search serves it, and what it does:

- `scores`: on every row where it is active, on the scores after generate's own processors and before the draw
  (OpenAI's presence and frequency penalties);
- `draw`: on a sampled row's logits after its temperature, before top-k and top-p (vLLM's order for its min-p).

The step engine takes a greedy row's token from every plain row's logits at once (`steps.StepEngine._plain`), without
their rules: a rule that can change a greedy row (`greedy = True`) sends the rows it is active on the per-row way, and
one that cannot (a `draw` rule: a greedy row does not draw) is skipped for greedy rows by construction. The request's
fields reach the rows through `rule_values` (declared body fields or vLLM's extensions) and `checked` (each in its
range, refused with beams where the rule does not serve them); a field a rule reads is served, not refused as
`protocol.NOT_SERVED`. A new rule is a field of `SamplingParams`, a `Rule` in `RULES`, and its test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch is imported where a rule runs: the wire's records (wire.RowSpec) are read by the front, whose commands import
# no torch before their ranks do (tests/test_layout.py)
if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token the row has generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the row has generated the token
    min_p: float = 0.0  # vLLM's: a sampled row draws only tokens at least min_p x the likeliest's probability


@dataclass(frozen=True)
class Field:
    """A request field a rule reads: its range, inclusive, and how the error line says it (0 is its neutral value)."""

    name: str
    low: float
    high: float
    valid: str


class Rule:
    fields: tuple[Field, ...] = ()
    greedy = False  # whether it can change a greedy row's token
    beams = False  # whether beam search serves it

    def active(self, params: SamplingParams) -> bool:
        return any(getattr(params, f.name) for f in self.fields)

    def scores(self, scores: torch.Tensor, new: torch.Tensor, params: SamplingParams) -> None:
        """On one row's scores (`[vocab]`), in place, given the row's new tokens so far."""

    def draw(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """On a sampled row's logits after its temperature (`[vocab]`, float32): the logits to draw from."""
        return logits


class Penalties(Rule):
    """OpenAI's presence and frequency penalties, as vLLM applies them: each token the row has generated loses
    `presence_penalty` once and `frequency_penalty` per time it was generated (the prompt's tokens are not counted),
    after generate's own processors (the repetition penalty among them). Not with beams: generate's beam scores have
    no such rule."""

    fields = (Field("presence_penalty", -2.0, 2.0, "-2 to 2 (0: none)"),
              Field("frequency_penalty", -2.0, 2.0, "-2 to 2 (0: none)"))
    greedy = True

    def scores(self, scores, new, params):
        import torch

        if new.numel():
            counts = torch.bincount(new, minlength=scores.shape[-1])[:scores.shape[-1]].to(scores.dtype)
            scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)


class MinP(Rule):
    """vLLM's `min_p`: a sampled row draws only from the tokens whose probability (after its temperature) is at least
    `min_p` times the likeliest token's, before top-k and top-p as vLLM applies it (transformers' own min-p warper
    runs after them: the same draw where neither is set). A greedy row's token is the likeliest, which min-p never
    removes. Not with beams: it would remove candidates generate's beam search keeps."""

    fields = (Field("min_p", 0.0, 1.0, "0 to 1 (0: none)"),)

    def draw(self, logits, params):
        probs = logits.softmax(-1)
        return logits.masked_fill(probs < params.min_p * probs.max(), -float("inf"))


RULES: tuple[Rule, ...] = (Penalties(), MinP())
FIELDS: dict[str, Field] = {f.name: f for rule in RULES for f in rule.fields}


def rule_values(body) -> dict:
    """The rules' fields a request body gives (a pydantic body: declared fields, or vLLM's extensions), unchecked."""
    extra = body.model_extra or {}
    found = {}
    for name in FIELDS:
        value = getattr(body, name) if name in type(body).model_fields else extra.get(name)
        if value is not None:
            found[name] = value
    return found


def checked(values: dict, beams: bool, error) -> dict:
    """`values` ({field: value}) as the rows take them (floats), each in its range, and refused with beam search where
    its rule does not serve beams and it is not neutral; a problem raises `error(400, line, field)`."""
    out = {}
    for name, value in values.items():
        f = FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not f.low <= value <= f.high:
            raise error(400, f"{name} {value!r:.60} is out of range; valid: {f.valid}", name)
        out[name] = float(value)
    for rule in RULES:
        for f in rule.fields:
            if beams and not rule.beams and out.get(f.name):
                raise error(400, f"{f.name} {out[f.name]} with beam search: beams are scored by generate's own rules; "
                                 "valid: 0, or num_beams 1 (repetition_penalty is served with beams)", f.name)
    return out


def changes_greedy(params: SamplingParams) -> bool:
    """Whether a rule active on this row can change its token where it is greedy (its token is then not simply the
    highest logit)."""
    return any(rule.greedy and rule.active(params) for rule in RULES)


def apply_scores(scores: torch.Tensor, new: torch.Tensor, params: SamplingParams) -> None:
    """Every active rule's `scores` on one row's scores, in place."""
    for rule in RULES:
        if rule.active(params):
            rule.scores(scores, new, params)


def apply_draw(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Every active rule's `draw` on a sampled row's logits after its temperature."""
    for rule in RULES:
        if rule.active(params):
            logits = rule.draw(logits, params)
    return logits
