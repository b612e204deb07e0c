"""What clients send and get back: the request bodies of the OpenAI-compatible routes and of `/generate`
(pydantic models, so that a wrong type is one 400 line naming the field), the checks a body's values need
against the served model (positions, limits, what cannot be combined), and the conversion of a checked request
into rows for the batcher.

Defaults as the clients people use expect them: fields OpenAI's API and vLLM's server accept are accepted
(unknown fields too, as vLLM does: benchmarks send extensions); `ignore_eos`, `min_tokens`, `stop_token_ids` and
OpenAI's presence and frequency penalties (vLLM's arithmetic, greedy and sampled rows) are honoured; `logprobs`,
`echo` and the fields in `NOT_SERVED` are refused in one line rather than ignored.
Greedy or sampled follows the request's `temperature` (0: greedy) and, where it gives none, the model's
generation config (greedy for the embedded models), as vLLM's `--generation-config auto` does."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, fields
from typing import Any

import pydantic  # DeepSpeed's own dependency (its config classes), so installed wherever the plugin is

from .sampling import FIELDS, checked
from .wire import BatchKey, RowSpec  # noqa: F401 - BatchKey: what plan_rows returns, named here for the routes


class ServeError(Exception):
    """An answer other than 200, as OpenAI's API gives it: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry: bool | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry = status, message, param, code, retry

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code}}


class _Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(_Body):
    """The generation fields the completion routes share (OpenAI's, and vLLM's extensions benchmarks send)."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: int | bool | None = None
    echo: bool = False
    user: str | None = None


class CompletionRequest(Sampling):
    # a string, strings, token ids, or lists of token ids: checked by `prompts()`, in Python, which lets the event
    # loop in while it reads a long list (pydantic's union took 0.73 s for 2 million ids, holding the lock)
    prompt: Any


class ChatMessage(_Body):
    role: str
    content: str | list[dict] | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    top_logprobs: int | None = None


class TokenizeRequest(_Body):
    """vLLM's `POST /tokenize`: a prompt (special tokens added unless told otherwise) or chat messages (through the
    chat template, its generation prompt added unless told otherwise; no special tokens added on top)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's `POST /detokenize`: token ids to their text."""

    model: str | None = None
    tokens: list[int]


class GenerateParameters(_Body):
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    num_beams: int = 1
    num_return_sequences: int = 1
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    ignore_eos: bool = False


class GenerateRequest(_Body):
    inputs: str | list[str]
    parameters: GenerateParameters = pydantic.Field(default_factory=GenerateParameters)
    stream: bool = False


def one_line(error) -> tuple[str, str | None]:
    """A pydantic ValidationError (or FastAPI's RequestValidationError) as one line naming the field, and the
    field's path (OpenAI's `param`)."""
    errors = error.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(error)}
    if first.get("type") == "json_invalid":  # FastAPI's location is the character, not a field
        where = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"the body is not valid JSON ({where}); valid: a JSON object", None
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    if not loc and first.get("type") == "missing":
        return "the body is empty; valid: a JSON object", None
    # a union's alternatives each add their type name to the location: keep the field's own path
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "list", "function-after")]
    where = ".".join(loc) or "body"
    value = first.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {value!r:.60})"
    return f"{where}: {first.get('msg', 'invalid')}{shown}", (where if loc else None)


# Fields of OpenAI's API and vLLM's that change what comes back, which this server does not do: given any value but
# their neutral ones they are refused in one line, not ignored (a client relying on `logit_bias` or `stop_token_ids`
# would otherwise get other text with a 200). Unknown fields are still accepted, as vLLM accepts them.
NOT_SERVED: dict[str, tuple] = {
    "suffix": (None, ""), "logit_bias": (None, {}),
    "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "n_beams": (None,), "prompt_embeds": (None,),
}


# generate settings /generate passes on (through the batch's generation config: rows batched together share them),
# with the type each must have: the logits processors generate builds from its config, which run before each row's
# own sampling. The explicit fields of GenerateParameters are the rest; generate's sampling warpers (typical_p, min_p,
# ...) are not here, because a row samples in the server's own per-row processor (serve/engine.py RowRules), after.
_TokenId = pydantic.NonNegativeInt
GENERATE_PASSED: dict[str, object] = {
    "no_repeat_ngram_size": pydantic.NonNegativeInt, "encoder_no_repeat_ngram_size": pydantic.NonNegativeInt,
    "bad_words_ids": list[pydantic.conlist(_TokenId, min_length=1)], "encoder_repetition_penalty": pydantic.PositiveFloat,
    "early_stopping": bool, "forced_bos_token_id": _TokenId, "forced_eos_token_id": _TokenId | list[_TokenId],
    "suppress_tokens": list[_TokenId], "begin_suppress_tokens": list[_TokenId],
    "exponential_decay_length_penalty": tuple[pydantic.NonNegativeInt, pydantic.PositiveFloat],
    "renormalize_logits": bool, "remove_invalid_values": bool}
_TOKEN_FIELDS = ("bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
                 "begin_suppress_tokens")
# what TGI's clients send that would change the answer: refused unless neutral (`details` is always answered)
GENERATE_NOT_SERVED: dict[str, tuple] = {"return_full_text": (None, False), "watermark": (None, False),
                                         "best_of": (None, 1), "top_n_tokens": (None, 0), "truncate": (None,),
                                         "decoder_input_details": (None, False)}


def _neutral(value, neutrals: tuple) -> bool:
    """Whether `value` is one of a not-served field's neutral values (of the same type: 0 is not False)."""
    return any(value == v and type(value) is type(v) or value is v for v in neutrals)


MAX_LOGPROBS = 20  # top tokens a token's log probability may come with (vLLM's default --max-logprobs)

PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _token_id(value) -> bool:
    return type(value) is int  # not a bool, not a float


def completion_prompts(value) -> list[str] | list[list[int]]:
    """/v1/completions' `prompt` as texts or token-id lists, checked in Python (see CompletionRequest)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ServeError(400, f"prompt {_shown(value)} is not a prompt; valid: {PROMPT_FORMS}", "prompt")
    if all(isinstance(p, str) for p in value):
        return value
    if all(_token_id(t) for t in value):
        return [value]
    for i, p in enumerate(value):
        if not isinstance(p, list) or not p or not all(_token_id(t) for t in p):
            bad = next((t for t in p if not _token_id(t)), None) if isinstance(p, list) and p else p
            raise ServeError(400, f"prompt.{i}: {_shown(bad)} in a list of prompts; valid: {PROMPT_FORMS}", "prompt")
    return value


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_count(prompts: int, n: int, beams: bool, limits: "ModelLimits", names: dict | None = None) -> None:
    """A request's rows (prompts x n, or one per prompt with beams) within --max_batch_size: checked before any prompt
    is tokenized (400,000 prompts took the front 18.6 s and 2.4 GB to tokenize before this refused them)."""
    names = names or {}
    rows = prompts * (1 if beams else n)
    if rows > limits.max_batch_size:
        raise ServeError(400, f"{prompts} prompt(s) x {names.get('n', 'n')} {n} = {rows} sequences; valid: at most "
                         f"{limits.max_batch_size} (--max_batch_size) per request", "n" if n > 1 else "prompt")


def outside_vocabulary(ids, vocab_size: int | None) -> list[int]:
    """The token ids of `ids` that name no token of a `vocab_size` vocabulary (negative ones included)."""
    return [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]


def _token_ids(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [t for v in value for t in _token_ids(v)] if isinstance(value, (list, tuple)) else []


def generate_settings(parameters, generation_config, vocab_size: int | None = None) -> dict:
    """The generate settings of a /generate request beyond its explicit fields, checked: one of GENERATE_PASSED, of
    its type, token ids in the vocabulary, and valid for generate with the request's beams (generate's own strict
    check); or one 400 line naming it."""
    from transformers import GenerationConfig

    passed, defaults = {}, GenerationConfig()
    for name, value in (parameters.model_extra or {}).items():
        neutral = GENERATE_NOT_SERVED.get(name)
        if neutral is not None and not _neutral(value, neutral):
            raise ServeError(400, f"parameters.{name} {value!r:.60} is not served here; valid: leave it out",
                             f"parameters.{name}")
        if name in GENERATE_PASSED:
            try:
                value = pydantic.TypeAdapter(GENERATE_PASSED[name]).validate_python(value, strict=False)
            except pydantic.ValidationError as e:
                raise ServeError(400, f"parameters.{name} {value!r:.60}: {one_line(e)[0].split(': ', 1)[-1]}",
                                 f"parameters.{name}") from None
            bad = outside_vocabulary(_token_ids(value), vocab_size) if name in _TOKEN_FIELDS else []
            if bad:
                raise ServeError(400, f"parameters.{name}: token id {bad[0]} is not in the vocabulary; valid: 0 to "
                                      f"{vocab_size - 1}", f"parameters.{name}")
            passed[name] = list(value) if isinstance(value, tuple) else value
        elif hasattr(defaults, name) and value is not None:
            raise ServeError(400, f"parameters.{name} is not served here; valid: the explicit parameters, or one of "
                                  f"{', '.join(GENERATE_PASSED)}", f"parameters.{name}")
    if passed:
        try:
            config = GenerationConfig(**{**generation_config.to_dict(), **passed, "num_beams": parameters.num_beams})
            config.validate(strict=True)
        except Exception as e:  # noqa: BLE001 - generate's own check, in its words
            raise ServeError(400, f"parameters: generate refuses {sorted(passed)}: {' '.join(str(e).split())[:200]}",
                             "parameters") from None
    return passed


def check_not_served(body) -> None:
    """A field this server does not do, given a value that would change the answer: one 400 line naming it (a field a
    sampling rule reads is served: `sampling.FIELDS`)."""
    for name, value in (body.model_extra or {}).items():
        neutral = NOT_SERVED.get(name) if name not in FIELDS else None
        if neutral is not None and not _neutral(value, neutral):
            shown = ", ".join("null" if v is None else repr(v) for v in neutral)
            raise ServeError(400, f"{name} {value!r:.60} is not served here; valid: leave it out ({shown})", name)
    if body.best_of is not None and body.best_of != body.n and not body.use_beam_search:
        raise ServeError(400, f"best_of {body.best_of} (the best of several samples by log probability) is not served; "
                              f"valid: best_of null or equal to n ({body.n}), or use_beam_search true", "best_of")


@dataclass
class Row(RowSpec):
    """One sequence to generate, as the front keeps it: what the engine gets (`RowSpec`: a prompt and its own rules)
    and what comes back as it runs."""

    prompt_index: int = 0  # which prompt of its request
    # how its text is made (the front's alone): vLLM's `skip_special_tokens` and `include_stop_str_in_output`
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    echo: bool = False  # the prompt's text (and tokens, with logprobs) before the completion's
    prompt_text: str | None = None  # the prompt as the client sent it (a string), for `echo`
    # filled as it runs
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[tuple] = field(default_factory=list)  # per new token, where asked (`wire.RowOutput.logprobs`)
    prompt_token_logprobs: list[tuple] | None = None  # per prompt token after the first (`echo` with `logprobs`)
    sequences: list[list[int]] | None = None  # beams: num_return_sequences of them
    finish: list[str] | None = None

    def slot_tokens(self) -> int:
        """The tokens this row holds in a replica whose rows keep slots of their own (the step engine pads no row to
        another): its prompt and new tokens, what `--max_batch_tokens` counts of the rows running together there, as
        TGI's `max_batch_total_tokens` counts them. A beam request's row counts once, as `plan_rows` counts it, so
        that a request it lets in fits an idle replica."""
        return len(self.prompt_ids) + self.max_new_tokens

    def spec(self, row_id: int) -> RowSpec:
        """What the engine needs of this row, under the id the front gives it for this admission."""
        given = {f.name: getattr(self, f.name) for f in fields(RowSpec)}
        return RowSpec(**{**given, "id": row_id, "prompt_ids": tuple(self.prompt_ids)})


@dataclass
class ModelLimits:
    """What the served model allows: its positions, capped by `--max_model_len` (prompt + new tokens, or the encoder's
    and the decoder's), the requests' limits from the command line, its vocabulary."""

    encoder_decoder: bool
    max_positions: int  # decoder-only: prompt + new tokens; encoder-decoder: new tokens (+1 start)
    max_source_positions: int | None  # encoder-decoder: the prompt
    max_n: int
    max_batch_size: int
    default_max_tokens: int
    model_greedy: bool = True
    vocab_size: int | None = None  # the tokenizer's: token ids a request may name
    why: str = "the model's positions"  # where max_positions comes from, for the messages
    max_batch_tokens: int | None = None  # --max_batch_tokens: no batch, so no request, pads to more
    max_model_len: int | None = None  # as resolved (settings.model_limits), for /v1/models


# float32 is what generate scores in: a factor beyond this (length_penalty's length ** penalty, the exponential decay
# length penalty's factor ** steps) leaves beam scores with no digit of their own (or overflows them: 1000 made
# Python's `**` overflow in transformers' beam search, and the rank ended). At 1e30, a penalty of 14 at 128 tokens.
POWER_LIMIT = 1e30


def _power(name: str, param: str, base: float, exponent: float, valid: str) -> None:
    """One 400 line if base ** exponent (base > 1) is past POWER_LIMIT either way."""
    if base > 1 and abs(exponent) * math.log(base) > math.log(POWER_LIMIT):
        raise ServeError(400, f"{name} is too large for the scores' arithmetic ({base:g} ** {exponent:g} is past "
                              f"{POWER_LIMIT:g}); valid: {valid}", param)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise ServeError(400, "stop: an empty stop string would end every output at once; valid: non-empty strings",
                         "stop")
    if len(stops) > 4:
        raise ServeError(400, f"stop: {len(stops)} stop strings; valid: up to 4", "stop")
    return stops


def _range(name: str, value, low, high=None, valid: str = "") -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        raise ServeError(400, f"{name} {value} is out of range; valid: {valid}", name)


def _stop_token_ids(ids, vocab_size: int | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ServeError(400, f"stop_token_ids {ids!r:.60} is not a list of token ids; valid: a list of integers",
                         "stop_token_ids")
    bad = outside_vocabulary(ids, vocab_size)
    if bad:
        valid = f"0 to {vocab_size - 1}" if vocab_size is not None else "0 or more"
        raise ServeError(400, f"stop_token_ids: token id {bad[0]} is not in the vocabulary; valid: {valid}",
                         "stop_token_ids")
    return tuple(ids)


def check_length(i: int, length: int, max_tokens: int, limits: ModelLimits, name: str = "max_tokens") -> None:
    """Prompt `i` of `length` tokens with `max_tokens` new ones, against the positions (and --max_model_len)."""
    if not length:
        raise ServeError(400, f"prompt {i} is empty after tokenization; valid: text with at least one token", "prompt")
    why = f" ({limits.why})"
    if limits.encoder_decoder:
        if limits.max_source_positions is not None and length > limits.max_source_positions:
            raise ServeError(400, f"prompt {i} has {length} tokens; valid: at most {limits.max_source_positions}{why}",
                             "prompt")
        if max_tokens + 1 > limits.max_positions:
            raise ServeError(400, f"{name} {max_tokens} is past the {limits.max_positions} decoder positions{why}; "
                             f"valid: 1 to {limits.max_positions - 1}", name)
    elif length + max_tokens > limits.max_positions:
        if length >= limits.max_positions:
            raise ServeError(400, f"prompt {i} has {length} tokens; valid: fewer than {limits.max_positions}{why}",
                             "prompt")
        raise ServeError(400, f"{name} {max_tokens} with a {length}-token prompt is past {limits.max_positions} "
                         f"positions{why}; valid: 1 to {limits.max_positions - length}", name)


@dataclass(kw_only=True)
class Asked:
    """What one request asks, read once from its body by its route (`app.Api.asked_openai`: OpenAI's fields and vLLM's
    extensions; `app.Api.asked_generate`: /generate's parameters), as the body gives it (None: not given), for
    `plan_rows` to check and turn into rows, whose records carry the sampling part (`sampling.SamplingParams`) to the
    sampler unchanged. `sampling`: the sampling rules' fields the body gives (`sampling.rule_values`); `generate`:
    generate's own settings (/generate's processors, a target language's forced first token); `names`: the body's
    own names of max_tokens, n, min_tokens and num_beams, for the error lines."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: Any = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    num_beams: int = 1
    stream: bool = False
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    do_sample: bool | None = None
    stop_token_ids: Any = None
    generate: dict | None = None
    sampling: dict | None = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    logprobs: Any = None
    echo: bool = False
    names: dict | None = None


def plan_rows(prompts: list[list[int]], asked: Asked, limits: ModelLimits) -> tuple[BatchKey, list[Row]]:
    """The rows of one request (a prompt x n, or one row per prompt under beam search, which returns n
    sequences of it), checked against the model and the server's limits; every problem is one ServeError."""
    a = asked
    names = {"max_tokens": "max_tokens", "n": "n", "min_tokens": "min_tokens", "num_beams": "num_beams",
             **(a.names or {})}
    max_tokens, temperature, top_p, top_k, n, seed = a.max_tokens, a.temperature, a.top_p, a.top_k, a.n, a.seed
    min_tokens, num_beams, stream, logprobs, echo = a.min_tokens, a.num_beams, a.stream, a.logprobs, a.echo
    repetition_penalty, length_penalty, do_sample, generate = (a.repetition_penalty, a.length_penalty, a.do_sample,
                                                               a.generate)
    ignore_eos, skip_special_tokens, include_stop_str_in_output = (a.ignore_eos, a.skip_special_tokens,
                                                                   a.include_stop_str_in_output)
    if not prompts:
        raise ServeError(400, "prompt: empty; valid: a string, a list of strings, or token ids", "prompt")
    _range(names["n"], n, 1, limits.max_n, f"1 to {limits.max_n} (--max_n)")
    _range(names["num_beams"], num_beams, 1, 16, "1 (greedy or sampling) to 16 beams")
    _range("temperature", temperature, 0.0, 100.0, "0 (greedy) to 100")
    _range("top_p", top_p, 1e-6, 1.0, "above 0, up to 1")
    _range("top_k", top_k, -1, None, "-1 or 0 (all tokens), or a positive count")
    _range(names["min_tokens"], min_tokens, 0, None, "0 or more")
    _range("repetition_penalty", repetition_penalty, 1e-6, None, "a positive number (1: none)")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    _range(names["max_tokens"], max_tokens, 1, None, "1 or more new tokens")
    if min_tokens > max_tokens:
        raise ServeError(400, f"{names['min_tokens']} {min_tokens} is more than {names['max_tokens']} {max_tokens}; "
                         f"valid: at most {names['max_tokens']}", names["min_tokens"])
    stops = _stops(a.stop)
    for name, value in (("skip_special_tokens", skip_special_tokens),
                        ("include_stop_str_in_output", include_stop_str_in_output)):
        if value is not None and not isinstance(value, bool):
            raise ServeError(400, f"{name} {value!r:.60} is not a boolean; valid: true or false", name)
    beams = num_beams > 1
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise ServeError(400, f"logprobs {logprobs!r:.60} is out of range; valid: 0 to {MAX_LOGPROBS} (the top "
                                  "tokens given with each token's), or null", "logprobs")
        if beams:
            raise ServeError(400, f"logprobs with {names['num_beams']} {num_beams}: a beam's tokens have no one "
                                  f"distribution; valid: num_beams 1, or logprobs null", "logprobs")
    if echo and limits.encoder_decoder:
        raise ServeError(400, "echo with an encoder-decoder model: its prompt is the encoder's, not text its "
                              "completion continues; valid: echo false", "echo")
    if echo and stream:
        raise ServeError(400, "echo with stream is not served yet; valid: stream false, or echo false", "echo")
    if beams and stream:
        raise ServeError(400, f"stream with {names['num_beams']} {num_beams}: beam search picks its outputs at the end, "
                         "so it cannot stream; valid: stream false, or num_beams 1", "stream")
    if beams and n > num_beams:
        raise ServeError(400, f"{names['n']} {n} is more than {names['num_beams']} {num_beams}: beam search returns "
                         f"at most one sequence per beam; valid: 1 to {num_beams}", names["n"])
    sampled = (temperature > 0) if temperature is not None else (do_sample if do_sample is not None
                                                                  else not limits.model_greedy)
    if do_sample is False:
        sampled = False
    if beams and sampled and temperature is not None and temperature > 0:
        raise ServeError(400, "sampling with beam search is not served; valid: num_beams 1 to sample, or "
                         "temperature 0 with beams", "temperature")
    stop_ids = _stop_token_ids(a.stop_token_ids, limits.vocab_size)
    if beams and stop_ids:
        raise ServeError(400, "stop_token_ids with beam search: beams share generate's own end; valid: num_beams 1",
                         "stop_token_ids")
    rules = checked(a.sampling or {}, beams, ServeError)
    if beams and ignore_eos:
        raise ServeError(400, "ignore_eos with beam search: beams end at EOS by design; valid: num_beams 1",
                         "ignore_eos")
    check_count(len(prompts), n, beams, limits, names)
    if beams and length_penalty is not None:
        bound = math.log(POWER_LIMIT) / math.log(max_tokens + 1)
        _power("length_penalty", "length_penalty", max_tokens + 1, length_penalty,
               f"-{bound:.1f} to {bound:.1f} with {names['max_tokens']} {max_tokens}")
    decay = (generate or {}).get("exponential_decay_length_penalty")
    if decay is not None and decay[1] > 1:
        _power("parameters.exponential_decay_length_penalty's factor", "parameters.exponential_decay_length_penalty",
               decay[1], max_tokens,
               f"a factor up to {POWER_LIMIT ** (1 / max_tokens):.4g} with {names['max_tokens']} {max_tokens}")
    for i, ids in enumerate(prompts):
        check_length(i, len(ids), max_tokens, limits, names["max_tokens"])
    rows, width = len(prompts) * (1 if beams else n), max(len(ids) for ids in prompts) + max_tokens
    if limits.max_batch_tokens and rows * width > limits.max_batch_tokens:  # a batch of its own would be past it
        raise ServeError(400, f"{rows} sequence(s) x ({width - max_tokens} prompt + {max_tokens} new tokens) = "
                              f"{rows * width} padded tokens; valid: at most {limits.max_batch_tokens} "
                              "(--max_batch_tokens)", names["max_tokens"])
    key = BatchKey(num_beams=num_beams, num_return_sequences=n if beams else 1,
                   max_new_tokens=max_tokens if beams else 0, stop=stops if beams else (),
                   min_tokens=min_tokens if beams else 0, repetition_penalty=repetition_penalty,
                   length_penalty=length_penalty if beams else None,
                   generate=tuple(sorted((k, json.dumps(v)) for k, v in (generate or {}).items())))
    temp = 0.0
    if sampled and not beams:
        temp = temperature if temperature is not None else 1.0
    base = seed if seed is not None else random.getrandbits(62)
    rows = []
    for p, ids in enumerate(prompts):
        for j in range(1 if beams else n):
            rows.append(Row(prompt_ids=list(ids), max_new_tokens=max_tokens, temperature=temp,
                            top_p=top_p if top_p is not None else 1.0, top_k=max(top_k or 0, 0),
                            seed=(base + j) % 2**63, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop=stops, stop_token_ids=stop_ids, **rules, prompt_index=p,
                            skip_special_tokens=skip_special_tokens is not False,
                            include_stop_str_in_output=bool(include_stop_str_in_output),
                            logprobs=-1 if logprobs is None else logprobs,
                            prompt_logprobs=bool(echo) and logprobs is not None, echo=bool(echo)))
    return key, rows
