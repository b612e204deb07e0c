"""`ds-inference serve MODEL_DIR --tp_size T [--dp_size R]`: the HTTP front (FastAPI on uvicorn).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (OpenAI's, with SSE streams ending in a usage chunk
with empty `choices` and `data: [DONE]`), `GET /v1/models`, `POST /generate` (any generate setting: beams,
num_return_sequences; encoder-decoders text in, text out), vLLM's `POST /tokenize`, `POST /detokenize` and `GET
/tokenizer_info` (the model's tokenizer for clients without a copy of it), `GET /health` (200 ready; 503 loading, draining or
broken: Kubernetes' readiness probe), `GET /live` (200 while the process runs: liveness), `GET /metrics`.
Every answer other than 200 is OpenAI's error body with a one-line message; a 503 a retry cannot help carries
`x-should-retry: false` (the openai SDK otherwise retries it twice)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pydantic

from ..errors import InferenceSetupError
from ..extras import optional_import
from ..run.collector import collector_paused
from . import bodies
from .asgi import CountStatuses, LimitBodies, Uvicorn, error_response
from .batching import Job, Queue
from .protocol import (
    Asked,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ModelLimits,
    ServeError,
    TokenizeRequest,
    check_count,
    check_not_served,
    completion_prompts,
    generate_settings,
    one_line,
    outside_vocabulary,
    plan_rows,
)
from .sampling import rule_values
from .server import Server
from .settings import engine_settings
from .text import Offsets, Texts, context_of, join_parts, template_reads_parts

fastapi = optional_import("fastapi", "ds-inference serve")
responses = optional_import("fastapi.responses", "ds-inference serve")
fastapi_exceptions = optional_import("fastapi.exceptions", "ds-inference serve")
uvicorn = optional_import("uvicorn", "ds-inference serve")

logger = logging.getLogger("ds_inference_integration.serve")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _finish_reason(row, texts: Texts, tokens) -> str:
    reason = (row.finish or ["length"])[0]
    return "stop" if texts.final(tokens)[1] else reason


class Api:
    """The routes, over one Server."""

    def __init__(self, server: Server, tokenizer, model_id: str, limits: ModelLimits, api_key: str | None,
                 generation_config):
        self.server, self.tokenizer, self.model_id, self.limits = server, tokenizer, model_id, limits
        self.api_key, self.generation_config = api_key, generation_config
        self.created = int(time.time())
        self.reads_parts = template_reads_parts(getattr(tokenizer, "chat_template", None))
        # a multilingual tokenizer's language codes (`target_language`): its special tokens beyond the usual ones
        # (transformers 5's `extra_special_tokens`, 4's `additional_special_tokens`) or its language maps' keys
        self.language_codes: list[str] = []
        for name in ("extra_special_tokens", "additional_special_tokens", "lang_code_to_id", "lang_token_to_id"):
            self.language_codes += [t for t in getattr(tokenizer, name, None) or ()
                                    if isinstance(t, str) and t not in self.language_codes]
        # decoding, checking and tokenizing a body: off the event loop, so /live and every stream go on meanwhile
        # (a 10 MB prompt held the loop for 11 s); a few at once, the rest wait their turn
        self.workers = ThreadPoolExecutor(4, thread_name_prefix="ds-inference-body")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.workers, _paused, fn, args)

    async def read(self, request, model: type[pydantic.BaseModel]):
        """The request's body as `model`, decoded and checked off the event loop (serve/bodies.py); one 400 line
        otherwise."""
        raw = await request.body()

        def parse():
            value = bodies.decode(raw)
            try:
                return model.model_validate(value)
            except pydantic.ValidationError as e:
                error = ServeError(400, *one_line(e))
            bodies.release(value)
            raise error

        return await self.off_loop(parse)

    def context(self, row) -> list[int]:
        return context_of(row, self.limits.encoder_decoder)

    def texts(self, row) -> Texts:
        return Texts(self.tokenizer, row.stop, self.context(row), row.skip_special_tokens,
                     row.include_stop_str_in_output)

    # ----- helpers
    def check_key(self, request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise ServeError(401, "missing or wrong API key; valid: the header `Authorization: Bearer KEY` with "
                                  "the server's --api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ServeError(404, f"model {model!r} is not served here; valid: {self.model_id!r}", "model",
                             "model_not_found")

    def tokenize(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Texts to token ids (as one batch: the fast tokenizers let other threads run meanwhile); token ids checked
        against the vocabulary as far as a prompt can be long (a longer one is refused for its length)."""
        if all(isinstance(p, str) for p in prompts):
            return [list(ids) for ids in self.tokenizer(prompts)["input_ids"]] if prompts else []
        vocab, longest = len(self.tokenizer), max(self.limits.max_positions, self.limits.max_source_positions or 0)
        for i, p in enumerate(prompts):
            bad = outside_vocabulary(p[:longest + 1], vocab)
            if bad:
                raise ServeError(400, f"prompt {i}: token id {bad[0]} is not in the vocabulary; valid: 0 to {vocab - 1}",
                                 "prompt")
        return [list(p) for p in prompts]

    @staticmethod
    def unsupported(body, chat: bool) -> None:
        if chat and (body.logprobs not in (None, False, 0) or getattr(body, "top_logprobs", None)):
            raise ServeError(400, "logprobs are not served on chat completions yet (they are on /v1/completions); "
                                  "valid: leave logprobs out (null)", "logprobs")
        if chat and body.echo:
            raise ServeError(400, "echo is not served on chat completions; valid: echo false", "echo")
        check_not_served(body)

    @staticmethod
    def openai_beams(body) -> int:
        """An OpenAI-style body's beam count (1: greedy or sampling): our `num_beams`, or vLLM's `use_beam_search`
        with `best_of` beams (at least n)."""
        num_beams = (body.model_extra or {}).get("num_beams")
        if body.use_beam_search:
            if body.best_of is not None and body.best_of < body.n:  # vLLM's rule: best_of beams, n of them returned
                raise ServeError(400, f"best_of {body.best_of} is less than n {body.n} with use_beam_search; valid: "
                                      f"best_of null or {body.n} to 16", "best_of")
            num_beams = body.best_of or max(body.n, 2)
        if num_beams is not None and (not isinstance(num_beams, int) or isinstance(num_beams, bool)):
            raise ServeError(400, f"num_beams {num_beams!r} is not an integer; valid: 1 to 16", "num_beams")
        return num_beams or 1

    def target_language(self, lang) -> dict:
        """A request's `target_lang` (a multilingual encoder-decoder's output language) as the generate setting that
        makes it: the decoder forced to start with the language's token, as the model's tokenizer names it (the code
        itself, NLLB's `fra_Latn` and mBART-50's `fr_XX`, or M2M100's `__fr__`); {} without one. Rows of different
        languages have different keys, and the step engine runs rows of any keys in one step."""
        if lang is None:
            return {}
        codes = self.language_codes
        if not self.limits.encoder_decoder or not codes:
            raise ServeError(400, f"target_lang {lang!r:.40}: model {self.model_id!r} has no language codes (a "
                                  "multilingual encoder-decoder's, as NLLB's or M2M100's); valid: leave it out",
                             "target_lang")
        found = next((name for name in (lang, f"__{lang}__") if isinstance(lang, str) and name in codes), None)
        if found is None:
            shown = ", ".join(codes[:6]) + (", ..." if len(codes) > 6 else "")
            raise ServeError(400, f"target_lang {lang!r:.40} is not one of this model's language codes; valid: "
                                  f"{shown}", "target_lang")
        return {"forced_bos_token_id": self.tokenizer.convert_tokens_to_ids(found)}

    def asked_openai(self, body, **more) -> Asked:
        """What an OpenAI body (completions or chat) asks: its fields and vLLM's extensions, read once."""
        extra = body.model_extra or {}
        return Asked(max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None
                     else body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, n=body.n,
                     stop=body.stop, seed=body.seed, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                     num_beams=self.openai_beams(body), stream=body.stream, repetition_penalty=body.repetition_penalty,
                     length_penalty=body.length_penalty, stop_token_ids=extra.get("stop_token_ids"),
                     sampling=rule_values(body), generate=self.target_language(extra.get("target_lang")) or None,
                     skip_special_tokens=extra.get("skip_special_tokens"),
                     include_stop_str_in_output=extra.get("include_stop_str_in_output"), **more)

    def plan_openai(self, body, prompts, **more):
        return plan_rows(prompts, self.asked_openai(body, **more), self.limits)

    def plan_completion(self, body):
        """A /v1/completions body to rows (in a worker thread): checked, counted, then tokenized."""
        self.check_model(body.model)
        self.unsupported(body, chat=False)
        prompts = completion_prompts(body.prompt)
        check_count(len(prompts), body.n, self.openai_beams(body) > 1, self.limits)
        key, rows = self.plan_openai(body, self.tokenize(prompts), logprobs=body.logprobs, echo=body.echo)
        for row in rows:
            if isinstance(prompts[row.prompt_index], str):
                row.prompt_text = prompts[row.prompt_index]
        return key, rows

    def plan_chat(self, body):
        """A /v1/chat/completions body to rows (in a worker thread): its messages through the chat template."""
        self.check_model(body.model)
        self.unsupported(body, chat=True)
        return self.plan_openai(body, [self.chat_ids(body.messages)])

    def chat_ids(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                 add_special_tokens: bool = False) -> list[int]:
        """Chat messages to the prompt's token ids: through the chat template (text parts only), then tokenized with
        no special tokens added (the template writes its own) unless `add_special_tokens`."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServeError(400, f"model {self.model_id!r} has no chat template, so it cannot chat; valid: "
                                  "POST /v1/completions with a prompt", "messages", "no_chat_template")
        for i, m in enumerate(messages):  # a served model reads text; an image part would vanish in the template
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.get("type", "text") != "text" or not isinstance(part.get("text", ""), str):
                    raise ServeError(400, f"messages.{i}.content.{j}: a part of type {part.get('type')!r} is not "
                                          "served (a text model); valid: parts of type 'text'", f"messages.{i}.content")
        if add_generation_prompt and continue_final_message:
            raise ServeError(400, "add_generation_prompt and continue_final_message are both true; valid: one of "
                                  "them at most", "continue_final_message")
        parts = join_parts([m.model_dump(exclude_none=True) for m in messages], self.reads_parts)
        more = {"continue_final_message": True} if continue_final_message else {}
        try:  # the template's text, then its tokens
            text = self.tokenizer.apply_chat_template(parts, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **more)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages (roles out of order...)
            raise ServeError(400, f"messages: the chat template refused them: {' '.join(str(e).split())[:200]}",
                             "messages") from None
        ids = self.tokenizer([text], add_special_tokens=add_special_tokens)["input_ids"][0]
        if not ids:
            raise ServeError(400, "messages: the chat template made no tokens of them; valid: messages with text",
                             "messages")
        return list(ids)

    def plan_tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize answer (in a worker thread): a prompt's token ids, or a chat's through its template."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServeError(400, "POST /tokenize takes a prompt or messages, one of them; valid: {\"prompt\": "
                                  "\"text\"} or {\"messages\": [{\"role\": \"user\", \"content\": \"text\"}]}",
                             "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(self.tokenizer([body.prompt], add_special_tokens=special)["input_ids"][0])
        else:
            ids = self.chat_ids(body.messages, body.add_generation_prompt, body.continue_final_message,
                                bool(body.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids, "token_strs": strs}

    def plan_detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize answer (in a worker thread): token ids to their text (special tokens kept)."""
        self.check_model(body.model)
        vocab = len(self.tokenizer)
        bad = outside_vocabulary(body.tokens, vocab)
        if bad:
            raise ServeError(400, f"tokens: token id {bad[0]} is not in the vocabulary; valid: 0 to {vocab - 1}",
                             "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's settings as its tokenizer_config.json holds them (no file paths),
        its class and chat template: what lm-evaluation-harness's remote tokenizer reads (special tokens, the
        template) so that it needs no copy of the tokenizer."""
        def plain(value):
            if hasattr(value, "content"):  # an AddedToken
                return value.content
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

        info = {k: plain(v) for k, v in (getattr(self.tokenizer, "init_kwargs", None) or {}).items()
                if k not in ("vocab_file", "merges_file", "tokenizer_file")}
        info["tokenizer_class"] = type(self.tokenizer).__name__
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, str):
            info["chat_template"] = template
        return info

    async def wait(self, job: Job, request) -> None:
        """Until the job is done; a client that goes away cancels it."""
        while not job.done.done():
            await asyncio.wait([job.done], timeout=0.25)
            if not job.done.done() and await request.is_disconnected():
                self.server.cancel(job)
                return
        error = job.done.result()
        if error is not None:
            raise error

    def choices(self, job: Job, chat: bool) -> tuple[list[dict], int]:
        out, generated = [], 0
        index = 0
        for row in job.rows:
            for seq, reason in zip(row.sequences or [[]], row.finish or ["length"]):
                texts = self.texts(row)
                text, stopped = texts.final(seq)
                generated += len(seq)
                finish = "stop" if stopped else reason
                if chat:
                    out.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish})
                else:
                    head = self.echoed(row) if row.echo else ""
                    out.append({"index": index, "text": head + text, "finish_reason": finish,
                                "logprobs": self.logprobs(row, seq) if row.logprobs >= 0 else None})
                index += 1
        return out, generated

    def echoed(self, row) -> str:
        """A row's prompt as `echo` gives it back: the client's string, or its token ids decoded."""
        if row.prompt_text is not None:
            return row.prompt_text
        return self.tokenizer.decode(row.prompt_ids, skip_special_tokens=row.skip_special_tokens)

    def offsets(self, row) -> Offsets:
        """Where a row's new tokens' texts start in its answer's text (`text.Offsets`): after its echoed prompt where
        it asked for `echo`."""
        start = len(self.echoed(row)) if row.echo else 0
        return Offsets(self.tokenizer, self.context(row), row.skip_special_tokens, start)

    def logprobs(self, row, seq: list[int], start: int = 0, offsets: Offsets | None = None) -> dict:
        """OpenAI's completion `logprobs` of a row (its prompt's first, with `echo`): each token's text, its log
        probability (None for the prompt's first, which has no context), the likeliest tokens' (with the token
        itself, as vLLM gives them) and each token's character offset in the answer's text (`text.Offsets`). A
        stream's chunk gives `seq`'s tokens from `start` on (those the chunks before it have not), their offsets
        read on by the row's `offsets` (`Api.offsets`): the chunks' lists, joined, are the non-streamed answer's."""
        ids, chosen, tops, at = [], [], [], []
        offsets = offsets if offsets is not None else self.offsets(row)
        if row.echo and not start:
            ids += list(row.prompt_ids)
            chosen.append(None)
            tops.append(None)
            for lp, top in row.prompt_token_logprobs or ():
                chosen.append(lp)
                tops.append(top)
            at += Offsets(self.tokenizer, None, row.skip_special_tokens).extend(row.prompt_ids)
        ids += list(seq[start:])
        for lp, top in row.token_logprobs[start:len(seq)]:
            chosen.append(lp)
            tops.append(top)
        at += offsets.extend(seq[start:])
        words = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        top_logprobs = []
        for lp, top, word in zip(chosen, tops, words):
            if top is None:
                top_logprobs.append(None)
                continue
            found = {self.tokenizer.decode([i], skip_special_tokens=False): v for i, v in top}
            found.setdefault(word, lp)
            top_logprobs.append(found)
        return {"tokens": words[:len(chosen)], "token_logprobs": chosen, "top_logprobs": top_logprobs,
                "text_offset": at[:len(chosen)]}

    def usage(self, job: Job, generated: int) -> dict:
        prompts = {r.prompt_index: len(r.prompt_ids) for r in job.rows}
        prompt = sum(prompts.values())
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    async def stream(self, job: Job, chat: bool, rid: str, include_usage: bool, continuous: bool, first):
        """SSE chunks as OpenAI sends them; `first` is the event already taken off the queue."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        texts = [self.texts(r) for r in job.rows]
        generated = [0] * len(job.rows)
        prompt_tokens = sum({r.prompt_index: len(r.prompt_ids) for r in job.rows}.values())

        def chunk(choices, usage=None) -> str:
            body = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_id, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def usage_now():
            done = sum(generated)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        # where a row asked for logprobs (completions only): how many of its tokens the chunks so far gave, and where
        # the next one's text starts (`Api.offsets`)
        given, offsets = [0] * len(job.rows), [None] * len(job.rows)

        def logprobs(i, tokens):
            row = job.rows[i]
            if chat or row.logprobs < 0 or given[i] >= len(tokens):
                return None
            if offsets[i] is None:
                offsets[i] = self.offsets(row)
            found = self.logprobs(row, tokens, given[i], offsets[i])
            given[i] = len(tokens)
            return found

        def choice(i, text, finish=None, lp=None):
            if chat:
                return {"index": i, "delta": {"content": text} if text or finish is None else {},
                        "logprobs": None, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

        finished, ended = 0, set()  # rows answered; rows whose last chunk went with their last token
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(job.rows))])
            event = first
            while True:
                kind_, i, _ = event
                if kind_ == "error":
                    yield f"data: {json.dumps(i.body())}\n\n"
                    break
                row = job.rows[i]
                if kind_ == "token" and event[2] is not None and i not in ended:
                    # the row's last token (the step engine says so): its chunk carries the row's end, as vLLM's
                    # last chunk does; its Finished, after it, adds no chunk
                    ended.add(i)
                    generated[i] = len(row.tokens)
                    found = texts[i].final(row.tokens)[1]
                    yield chunk([choice(i, texts[i].rest(row.tokens), "stop" if found else event[2],
                                        logprobs(i, row.tokens))], usage_now() if continuous else None)
                elif kind_ == "token" and i not in ended:
                    generated[i] = len(row.tokens)
                    text = texts[i].delta(row.tokens)
                    lp = logprobs(i, row.tokens)  # with the tokens that came, also where their text is held back
                    # a chunk for every token, also one that adds no text yet (held back for a stop string, half a
                    # character, a special token skipped), as vLLM sends one for every step that gave a row tokens:
                    # a T5 stream with ignore_eos past its EOS sent nothing for 41 s, and a proxy's idle timeout
                    # cuts such a stream
                    yield chunk([choice(i, text, lp=lp)], usage_now() if continuous else None)
                elif kind_ == "finish":
                    if i not in ended:
                        tokens = (row.sequences or [row.tokens])[0]
                        generated[i] = len(tokens)
                        yield chunk([choice(i, texts[i].rest(tokens), _finish_reason(row, texts[i], tokens),
                                            logprobs(i, tokens))], usage_now() if continuous else None)
                    finished += 1
                    if finished == len(job.rows):
                        if include_usage:
                            yield chunk([], usage_now())
                        break
                event = await job.events.get()
            yield "data: [DONE]\n\n"
        finally:
            if finished < len(job.rows):
                self.server.cancel(job)

    async def respond(self, request, body, planned, chat: bool):
        key, rows = planned
        job = self.server.submit(key, rows)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            first = await self._first_event(job, request)
            options = body.stream_options
            return responses.StreamingResponse(
                self.stream(job, chat, rid, bool(options and options.include_usage),
                            bool(options and options.continuous_usage_stats), first),
                media_type="text/event-stream", headers=STREAM_HEADERS)
        await self.wait(job, request)
        choices, generated = self.choices(job, chat)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": choices, "usage": self.usage(job, generated)}

    async def _first_event(self, job: Job, request):
        """A stream starts (200) only once its first token is there: a failure before it is a proper status."""
        getter = asyncio.ensure_future(job.events.get())
        try:
            while not getter.done():
                await asyncio.wait([getter], timeout=0.25)
                if not getter.done() and await request.is_disconnected():
                    self.server.cancel(job)
                    raise ServeError(400, "the client closed the connection")
        finally:
            if not getter.done():
                getter.cancel()
        event = getter.result()
        if event[0] == "error":
            raise event[1]
        return event

    # ----- routes
    async def completions(self, request):
        self.check_key(request)
        body = await self.read(request, CompletionRequest)
        return await self.respond(request, body, await self.off_loop(self.plan_completion, body), chat=False)

    async def chat(self, request):
        self.check_key(request)
        body = await self.read(request, ChatRequest)
        return await self.respond(request, body, await self.off_loop(self.plan_chat, body), chat=True)

    def plan_generate(self, body: GenerateRequest):
        """A /generate body to rows (in a worker thread)."""
        p = body.parameters
        if body.stream:
            raise ServeError(400, "POST /generate does not stream; valid: stream false, or POST /v1/completions with "
                                  "stream true", "stream")
        inputs = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
        asked = self.asked_generate(p)
        check_count(len(inputs), p.num_return_sequences, p.num_beams > 1, self.limits, asked.names)
        return plan_rows(self.tokenize(inputs), asked, self.limits)

    def asked_generate(self, p) -> Asked:
        """What /generate's parameters ask, read once (max_new_tokens defaults to the model's generation config's)."""
        max_new = p.max_new_tokens
        if max_new is None:
            config = self.generation_config
            max_new = getattr(config, "max_new_tokens", None)
            if max_new is None and getattr(config, "max_length", None):
                max_new = config.max_length - (1 if self.limits.encoder_decoder else 0)
        return Asked(max_tokens=max_new, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                     n=p.num_return_sequences, stop=p.stop, seed=p.seed, ignore_eos=p.ignore_eos,
                     min_tokens=p.min_new_tokens, num_beams=p.num_beams, repetition_penalty=p.repetition_penalty,
                     length_penalty=p.length_penalty, do_sample=p.do_sample,
                     names={"max_tokens": "max_new_tokens", "n": "num_return_sequences", "min_tokens": "min_new_tokens"},
                     generate={**generate_settings(p, self.generation_config, self.limits.vocab_size),
                               **self.target_language((p.model_extra or {}).get("target_lang"))})

    async def tokenize_route(self, request):
        self.check_key(request)
        body = await self.read(request, TokenizeRequest)
        return await self.off_loop(self.plan_tokenize, body)

    async def detokenize_route(self, request):
        self.check_key(request)
        body = await self.read(request, DetokenizeRequest)
        return await self.off_loop(self.plan_detokenize, body)

    async def generate(self, request):
        self.check_key(request)
        body = await self.read(request, GenerateRequest)
        key, rows = await self.off_loop(self.plan_generate, body)
        job = self.server.submit(key, rows)
        await self.wait(job, request)
        p = body.parameters
        k = p.num_return_sequences
        outputs = []
        for index in range(1 if isinstance(body.inputs, str) else len(body.inputs)):
            texts, details = [], {"prompt_tokens": 0, "generated_tokens": [], "finish_reason": []}
            for row in [r for r in job.rows if r.prompt_index == index]:
                details["prompt_tokens"] = len(row.prompt_ids)
                for seq, reason in zip(row.sequences or [[]], row.finish or ["length"]):
                    text, stopped = self.texts(row).final(seq)
                    texts.append(text)
                    details["generated_tokens"].append(len(seq))
                    details["finish_reason"].append("stop" if stopped else reason)
            if k == 1:
                details = {**details, "generated_tokens": details["generated_tokens"][0],
                           "finish_reason": details["finish_reason"][0]}
            outputs.append({"generated_text": texts[0] if k == 1 else texts, "details": details})
        return outputs[0] if isinstance(body.inputs, str) else outputs


def build_app(api: Api, max_body_bytes: int):
    server = api.server

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await server.start()  # the replicas start loading; /health answers 503 until they are ready
        yield

    app = fastapi.FastAPI(title="ds-inference serve", docs_url=None, redoc_url=None, openapi_url=None,
                          lifespan=lifespan)

    @app.exception_handler(ServeError)
    async def _serve_error(request, error: ServeError):
        return error_response(error)

    @app.exception_handler(fastapi_exceptions.RequestValidationError)
    async def _invalid(request, error):
        return error_response(ServeError(400, *one_line(error)))

    @app.exception_handler(404)
    async def _not_found(request, error):
        path = request.url.path if len(request.url.path) <= 100 else request.url.path[:97] + "..."
        return error_response(ServeError(404, f"no route {request.method} {path}; valid: POST "
                                              "/v1/completions, /v1/chat/completions, /generate, /tokenize, "
                                              "/detokenize; GET /v1/models, /tokenizer_info, /health, /live, "
                                              "/metrics"))

    @app.exception_handler(405)
    async def _method(request, error):
        return error_response(ServeError(405, f"{request.method} is not allowed on {request.url.path}"))

    @app.exception_handler(Exception)
    async def _unexpected(request, error):  # one line, never a traceback to the client
        logger.exception("serve: unexpected error")
        return error_response(ServeError(500, f"internal error: {type(error).__name__}: {' '.join(str(error).split())[:200]}"))

    @app.get("/health")
    async def health():
        if server.state == "ready":
            return {"status": "ready"}
        status = {"loading": "loading", "draining": "draining"}.get(server.state, "broken")
        return responses.JSONResponse({"status": status, **({"reason": server.why} if server.why else {})},
                                      status_code=503)

    @app.get("/live")
    async def live():
        return {"status": "alive"}

    @app.get("/metrics")
    async def metrics():
        server.metrics.held(server.replicas.replicas if server.replicas is not None else [])
        return responses.Response(server.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: fastapi.Request):
        api.check_key(request)
        return {"object": "list", "data": [{"id": api.model_id, "object": "model", "created": api.created,
                                            "owned_by": "ds-inference", "max_model_len": api.limits.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await api.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        return await api.chat(request)

    @app.post("/generate")
    async def generate(request: fastapi.Request):
        return await api.generate(request)

    @app.post("/tokenize")
    async def tokenize(request: fastapi.Request):
        return await api.tokenize_route(request)

    @app.post("/detokenize")
    async def detokenize(request: fastapi.Request):
        return await api.detokenize_route(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: fastapi.Request):
        api.check_key(request)
        return api.tokenizer_info()

    return CountStatuses(LimitBodies(app, max_body_bytes), server.metrics)


def _paused(fn, args):
    """`fn(*args)` with the cyclic collector paused: a body of a million small lists set off full collections while
    it was decoded, each holding the event loop (the longest /live answer 220 ms, against 28 ms for a body of
    numbers); what it leaves for the collector is collected once, after the request (`_release_memory`). A body it
    refuses is emptied here, a slice at a time (`bodies.release`)."""
    with collector_paused():
        try:
            return fn(*args)
        except ServeError:
            bodies.release(*args)
            raise


def listening_socket(host: str, port: int) -> socket.socket:
    """The front's socket, bound: a TCP socket by its protocol number too, for asyncio sets TCP_NODELAY only on
    connections whose socket says IPPROTO_TCP (`base_events._set_nodelay`). Made as `socket.socket(AF_INET)` (protocol
    0), every connection kept Nagle's algorithm: on a kept-alive connection a stream's first chunk waited for the
    client's delayed ACK of the response's headers, and a 4-token completion's first token came after 48 ms against
    5.9 ms on a fresh connection (aiohttp, as vLLM's benchmark sends, embedded GPT-2 at tp 1, 2026-12-05)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InferenceSetupError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); valid: a free "
                                  "port (0: any)") from None
    return sock


def main(argv: list[str]) -> int:
    from ..policy.schema import policy_for_run
    from .replicas import Replicas
    from .settings import announced_url, model_limits, parse, read_model_dir

    model_dir, serve_args, inference_args = parse(argv)
    if serve_args.worker:
        raise InferenceSetupError("--worker runs through `ds-inference serve MODEL_DIR --worker ...`")
    config, tokenizer, generation_config = read_model_dir(model_dir, serve_args.trust_remote_code)
    if inference_args.injection_policy != "autotp":  # the policy file and head counts, before any rank starts
        policy_for_run(inference_args.injection_policy, config, inference_args.tp_size)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    limits, limits_line = model_limits(config, generation_config, serve_args, tokenizer)
    sock = listening_socket(serve_args.host, serve_args.port)
    model_id = serve_args.served_model_name or Path(model_dir).resolve().name
    own_logs = serve_args.log_dir is None  # a directory of its own, removed at exit however the server ends
    log_dir = Path(serve_args.log_dir or tempfile.mkdtemp(prefix="ds-inference-serve-"))
    server = None
    try:
        settings = engine_settings(model_dir, serve_args, inference_args)
        queue = Queue(serve_args.max_batch_size, serve_args.max_batch_tokens, serve_args.max_wait_ms,
                      serve_args.max_queue, serve_args.adaptive_wait)
        nodes = (serve_args.nnodes, serve_args.master_addr, serve_args.master_port)
        server = Server(lambda on_message, on_lost: Replicas(settings, inference_args.tp_size, serve_args.dp_size,
                                                             log_dir, on_message, on_lost, nodes),
                        queue, tokenizer, inference_args.inference_timeout, serve_args.drain_timeout,
                        limits.encoder_decoder)
        api = Api(server, tokenizer, model_id, limits, serve_args.api_key, generation_config)
        uv = Uvicorn(uvicorn.Config(build_app(api, serve_args.max_body_bytes), log_level="warning",
                                     access_log=False, timeout_graceful_shutdown=5, lifespan="on"))
        uv.server = server

        def _exit():
            uv.should_exit = True

        server.on_exit = _exit
        host, port = sock.getsockname()[:2]
        print(f"ds-inference serve: {model_id} at tp {inference_args.tp_size} x dp {serve_args.dp_size} on "
              f"{announced_url(host, port)}, {limits_line} (loading; GET /health answers 200 when ready; rank logs in "
              f"{log_dir}{', removed at exit' if own_logs else ''})", flush=True)
        uv.run(sockets=[sock])
    finally:
        if server is not None and server.replicas is not None:
            server.replicas.kill()
        if own_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    if server.exit_code:
        print(f"ds-inference serve: exiting {server.exit_code} ({server.why})", file=sys.stderr, flush=True)
    return server.exit_code
