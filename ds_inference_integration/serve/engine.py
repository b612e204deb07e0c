"""One rank of a served replica: it loads and shards the model as predict does (`load_model`, `setup_inference`:
policies, derived policies verified, shard-aware and pre-sharded loading), then runs, in lock-step with its TP
peers, the batches the front hands to the replica's leader (its rank 0).

The leader alone talks to the front (a `multiprocessing.connection` socket); it broadcasts each message to its
peers (`broadcast_object_list` on the replica's gloo group, as transformers' own TP serving does), so it alone
fixes the order of batches. Every rank then runs the lock-step guard and the same `generate`. While idle the
leader broadcasts a keep-alive every second, so that a waiting peer never reaches `--inference_timeout` (also
its process group's timeout), and tells the front it is alive; a busy replica is bounded by that timeout.

Per-row rules in one batch (`RowRules`, `RowStops`): each row has its own `max_new_tokens`, minimum, stop
strings, EOS handling (`ignore_eos`) and sampling (temperature, top-k, top-p, its own seeded generator, so a
row's tokens do not depend on which requests share its batch); the leader reports every new token and every
finished row as it happens, so a short row is answered before its batch ends. Beam search keeps generate's
own rules (its rows share them: the front's batching key).

    python -m ds_inference_integration.serve.engine SETTINGS_JSON   (started by the front, one per rank)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

FRONT_ENV = "DS_INFERENCE_SERVE_FRONT"  # host:port of the front's socket (the leader connects)
AUTHKEY_ENV = "DS_INFERENCE_SERVE_AUTHKEY"  # hex; the front makes a random one per start
KEEPALIVE_SECONDS = 1.0


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


def sample(scores: torch.Tensor, row: dict, generator: torch.Generator) -> int:
    """One token of a sampled row, as generate samples it (temperature, top-k, top-p, a draw from the row's own
    generator). Where the temperature is so small that scores / temperature overflows a float (1e-40: transformers'
    own warper then fails on NaN), the tokens of the highest score are the draw's only candidates, which is the limit
    the distribution tends to; everywhere else the arithmetic is generate's, so a seeded row equals
    `run_generation.py --do_sample` in one process."""
    logits = scores.float() / row["temperature"]
    if not torch.isfinite(logits.max()):
        logits = torch.where(scores == scores.max(), 0.0, -float("inf"))
    top_k = row.get("top_k") or 0
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    top_p = row.get("top_p", 1.0)
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

    def __init__(self, rows: list[dict], start: int, eos: list[int], device, finished: list | None = None):
        self.rows, self.start, self.eos = rows, start, eos
        self.finished = finished if finished is not None else [None] * len(rows)  # RowStops' lengths: rows that ended
        self.failed: dict[int, tuple[int, str]] = {}
        self.generators = []
        for row in rows:
            g = None
            if row.get("temperature", 0) > 0:
                g = torch.Generator(device=device)
                g.manual_seed(int(row["seed"]))
            self.generators.append(g)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        produced = input_ids.shape[1] - self.start
        scores = scores.clone()
        for i, row in enumerate(self.rows):
            if produced < row.get("min_tokens", 0):  # EOS and the row's stop tokens wait for its minimum (vLLM's rule)
                held = [*self.eos, *row.get("stop_token_ids", ())]
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
    token of each row still running, the rows that finished now with their reason, the rows that failed now with
    status and why)."""

    def __init__(self, rows: list[dict], start: int, eos: list[int], tokenizer, report=None, control=None):
        self.rows, self.start, self.eos, self.tokenizer, self.report = rows, start, set(eos), tokenizer, report
        self.control = control
        self.lengths: list[int | None] = [None] * len(rows)
        self.reasons: list[str | None] = [None] * len(rows)
        self.rules: RowRules | None = None  # set by run_batch: the rows it failed

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.start:]
        produced = new.shape[1]
        cancelled = self.control.step(len(self.rows)) if self.control is not None else None
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
            reason = None
            if last in self.eos and not row.get("ignore_eos") and produced >= row.get("min_tokens", 0):
                reason = "stop"
            elif last in row.get("stop_token_ids", ()) and produced >= row.get("min_tokens", 0):
                reason = "stop"
            elif row.get("stop") and self._hits_stop(new[i], row["stop"]):
                reason = "stop"
            elif produced >= row["max_new_tokens"]:
                reason = "length"
            if reason:
                self.lengths[i], self.reasons[i] = produced, reason
                finished[i] = reason
                done[i] = True
        if self.report is not None:
            self.report(produced, tokens, finished, failed)
        return done

    def _hits_stop(self, ids: torch.Tensor, stops: list[str]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)


class BeamSteps:
    """A beam batch's stopping criterion for what generate's own rules do not know: a request whose client left
    (`control`) has every candidate of its beams end now, so beam search drops it (and stops once every request is
    done or gone); a candidate whose new text holds one of the batch's stop strings ends as a finished hypothesis,
    as transformers' StopStringCriteria would end it, which fails on the embedded models' word-level tokenizers
    ("ValueError: substring not found" in its vocabulary cleaning, before the first token; found by the serve fuzz)."""

    def __init__(self, requests: int, control, stops: list[str], start: int, tokenizer):
        self.requests, self.control, self.stops, self.start, self.tokenizer = requests, control, stops, start, tokenizer

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.control is not None:
            cancelled = self.control.step(self.requests).to(input_ids.device)
            done |= cancelled.repeat_interleave(input_ids.shape[0] // self.requests)
        if self.stops:
            texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
            done |= torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)
        return done


class Control:
    """What the leader learns from the front between decoding steps, given to every rank at the same step: the rows
    whose clients left (the front's "cancel"), one broadcast on the control group per step (measured: 0.26 ms on
    gloo between two CPU ranks, against 16 ms for a decoding step of the embedded GPT-2 at tp 2). The leader also
    tells the front it is alive at least every KEEPALIVE_SECONDS while it generates, so a long batch is never taken
    for a stopped replica. Other messages that arrive meanwhile wait in `pending` for the main loop."""

    def __init__(self, conn, group, world_size: int):
        self.conn, self.group, self.world_size = conn, group, world_size
        self.pending: collections.deque = collections.deque()
        self.batch_id = None
        self.cancelled: set[int] = set()
        self.said = time.monotonic()

    def begin(self, batch_id) -> None:
        self.batch_id, self.cancelled = batch_id, set()

    def send(self, message: dict) -> None:
        self.conn.send(message)
        self.said = time.monotonic()

    def step(self, rows: int) -> torch.BoolTensor:
        flags = torch.zeros(rows, dtype=torch.bool)
        if self.conn is not None:  # the leader
            while self.conn.poll(0):
                message = self.conn.recv()
                if message["op"] == "cancel":
                    if message["id"] == self.batch_id:
                        self.cancelled.update(message["rows"])
                else:
                    self.pending.append(message)
            if time.monotonic() - self.said > KEEPALIVE_SECONDS:
                self.send({"op": "alive"})
            flags[[i for i in self.cancelled if i < rows]] = True
        if self.world_size > 1:
            dist.broadcast(flags, src=0, group=self.group)
        return flags


def _generation_config(model, batch: dict, pad_token_id: int | None):
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    shared = batch["shared"]
    config.update(**shared.get("generate", {}))  # /generate's other settings (protocol.GENERATE_PASSED), checked
    config.num_beams = shared["num_beams"]
    config.num_return_sequences = shared["num_return_sequences"]
    config.do_sample = False  # sampling is per row, in RowRules
    config.max_new_tokens = shared["max_new_tokens"]
    config.max_length = None
    config.min_new_tokens = None
    config.min_length = 0
    if shared.get("repetition_penalty") is not None:
        config.repetition_penalty = shared["repetition_penalty"]
    if shared.get("length_penalty") is not None:
        config.length_penalty = shared["length_penalty"]
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    if shared["num_beams"] == 1:
        config.eos_token_id = None  # RowStops ends each row at EOS itself (and _no_eos keeps generate from refilling it)
    elif shared.get("min_tokens"):
        config.min_new_tokens = shared["min_tokens"]
    config.temperature, config.top_k, config.top_p = 1.0, None, 1.0  # no warpers: RowRules samples
    return config


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def run_batch(model, tokenizer, batch: dict, device, report=None, control: Control | None = None) -> dict:
    """Generate one batch (every rank, the same call); returns per row its sequences (new tokens only), finish
    reasons ("error" for a row that failed, "cancelled" for one whose client left) and the failed rows' status and
    why. `control`: the front's word between steps (cancelled rows), on every rank alike."""
    input_ids = torch.tensor(batch["input_ids"], dtype=torch.long, device=device)
    attention_mask = torch.tensor(batch["attention_mask"], dtype=torch.long, device=device)
    rows = batch["rows"]
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    start = 1 if encoder_decoder else input_ids.shape[1]
    eos = eos_ids(model)
    config = _generation_config(model, batch, tokenizer.pad_token_id)
    beams = batch["shared"]["num_beams"]
    stops = None
    if beams == 1:
        stops = RowStops(rows, start, eos, tokenizer, report, control)
        stops.rules = RowRules(rows, start, eos, device, finished=stops.lengths)
        kwargs = {"stopping_criteria": [stops], "logits_processor": [stops.rules]}
    else:
        kwargs = {"logits_processor": [BeamGuard(beams, start)],
                  "stopping_criteria": [BeamSteps(len(rows), control, batch["shared"].get("stop") or [], start,
                                                  tokenizer)]}
    cleared = ("max_length", *(("eos_token_id",) if stops is not None else ()))
    with torch.no_grad(), _without(model.generation_config, cleared):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
    new = out[:, start:].tolist()
    if stops is not None:
        sequences, reasons = [], []
        for i, seq in enumerate(new):
            n = stops.lengths[i] if stops.lengths[i] is not None else len(seq)
            sequences.append([seq[:n]])
            reasons.append([stops.reasons[i] or "length"])
        return {"sequences": sequences, "finish": reasons, "failed": {i: list(v) for i, v in stops.rules.failed.items()}}
    k = batch["shared"]["num_return_sequences"]
    sequences, reasons = [], []
    for i in range(len(rows)):
        mine, why = [], []
        for seq in new[i * k:(i + 1) * k]:
            cut = next((j for j, t in enumerate(seq) if t in eos), None)
            mine.append(seq[:cut] if cut is not None else _strip_pad(seq, tokenizer.pad_token_id))
            why.append("stop" if cut is not None else "length")
        sequences.append(mine)
        reasons.append(why)
    return {"sequences": sequences, "finish": reasons, "failed": {}}


@contextlib.contextmanager
def _without(config, names: tuple[str, ...]):
    """The model's generation config without `names` while generate runs. generate fills every None of the config it
    is given from the model's own (`_prepare_generation_config`, transformers 5): an ignore_eos row still ended at EOS
    (20 tokens of the 24 asked, with finish_reason "length") until RowStops was left alone with EOS; and a model whose
    generation config has a max_length (the embedded T5's 40) made generate warn on every batch that it and
    max_new_tokens were both set."""
    saved = {name: getattr(config, name) for name in names}
    for name in names:
        setattr(config, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def _strip_pad(seq: list[int], pad: int | None) -> list[int]:
    while seq and pad is not None and seq[-1] == pad:
        seq = seq[:-1]
    return seq


def fatal(error: BaseException) -> bool:
    """Whether a failure during a batch leaves this rank untrusted, so that the replica must end (the front then
    answers 503 and exits for a supervisor to restart it): a collective or a connection that broke (the ranks may
    no longer be in step), inputs that differed between ranks, a device error (CUDA's poison the context for every
    later call). Anything else (an exception in generate or our rules, an overflow, an allocation that failed) is
    that batch's failure, answered to its requests, and the replica goes on."""
    from ..errors import LockstepError

    return (not isinstance(error, Exception)
            or isinstance(error, (dist.DistError, ConnectionError, TimeoutError, EOFError, LockstepError,
                                  torch.AcceleratorError))
            or "CUDA error" in str(error))


def agree(failure: tuple[int, str] | None, group, world_size: int) -> tuple[int, str] | None:
    """Every rank's outcome of a batch, the same on each: the first failure of any rank (status, why), or None. A rank
    that failed where its peers did not (their forward still waits for it) meets them nowhere: this collective then
    reaches the process group's timeout and the rank ends (`fatal`)."""
    if world_size == 1:
        return failure
    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return None
    outcomes: list = [None] * world_size
    dist.all_gather_object(outcomes, failure, group=group)
    rank, (status, why) = next((r, o) for r, o in enumerate(outcomes) if o is not None)
    return status, why if rank == 0 else f"{why} (rank {rank})"


def say_once() -> None:
    """transformers' warnings said once per place in its code, not once per batch (each batch's values made each
    message new, so Python's own once-per-text rule repeated them): its logging handlers and `warnings` both."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    seen: set = set()

    class Once(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            key = (record.pathname, record.lineno)
            new = key not in seen
            seen.add(key)
            return new

    hf_logging.get_logger("transformers")  # configures the library's handler if it is not yet
    for handler in logging.getLogger("transformers").handlers:
        handler.addFilter(Once())
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        if (filename, lineno) not in seen:
            seen.add((filename, lineno))
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once


def main(argv: list[str]) -> None:
    import signal

    from transformers import AutoConfig, AutoTokenizer

    from ..arguments import DeepSpeedInferenceArguments
    from ..errors import first_line
    from ..load.loaders import load_model, model_class_for
    from ..predict.lockstep import check_lockstep
    from ..run.ranks import end_with_parent, init_rank
    from ..shard.setup import setup_inference

    end_with_parent()  # a front (or worker) killed with SIGKILL takes its ranks with it
    # Ctrl-C in a terminal reaches every process of its group: the front (or worker) drains and ends the ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    say_once()
    settings = json.loads(argv[0])
    inference_args = DeepSpeedInferenceArguments(**settings["inference"])
    topology, device = init_rank(timeout=inference_args.inference_timeout)
    leader = topology.rank == 0
    conn = None
    if leader:
        host, port = os.environ[FRONT_ENV].rsplit(":", 1)
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
        conn.send({"op": "hello", "pid": os.getpid()})
    model_dir = settings["model_dir"]
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_class_for(config), model_dir, config, inference_args=inference_args)
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    setup = setup_inference(model, inference_args, topology, device)
    model = setup.model
    model.eval()
    world = topology.world_size
    # the control group: gloo, CPU tensors, whatever the model's backend (a step's flags never touch a GPU)
    group = dist.new_group(backend="gloo") if world > 1 else None
    control = Control(conn, group, world)
    if leader:
        conn.send({"op": "ready", "report": str(setup.report)})
    batches = 0
    while True:
        message = None
        if leader:
            try:
                if control.pending:
                    message = control.pending.popleft()
                else:
                    message = conn.recv() if conn.poll(KEEPALIVE_SECONDS) else {"op": "keepalive"}
            except (EOFError, OSError):
                message = {"op": "stop"}  # the front is gone: the replica ends with it
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        op = message["op"]
        if op == "stop":
            return
        if op in ("keepalive", "cancel"):  # a cancel that arrives after its batch ended has nothing left to end
            if leader and op == "keepalive":
                control.send({"op": "alive"})
            continue
        batches += 1
        report = None
        if leader:
            def report(step, tokens, finished, failed, _id=message["id"]):
                control.send({"op": "tokens", "id": _id, "step": step, "tokens": tokens, "finished": finished,
                              "failed": failed})
        control.begin(message["id"])
        failure = None
        try:
            inputs = {"input_ids": torch.tensor(message["input_ids"]),
                      "attention_mask": torch.tensor(message["attention_mask"])}
            if topology.tp_size > 1 and inference_args.lockstep_guard:
                check_lockstep(inputs, topology, setup.groups.tp, device, batches)
            result = run_batch(model, tokenizer, message, device, report, control)
        except Exception as e:  # noqa: BLE001 - a batch's failure is its requests' (see `fatal`)
            if fatal(e):
                raise
            failure = ((e.status, str(e)) if isinstance(e, Refused) else
                       (500, f"generate failed: {type(e).__name__}: {first_line(e)}"[:300]))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # what a failed allocation left behind
        failure = agree(failure, group, world)
        if leader:
            if failure is not None:
                control.send({"op": "failed", "id": message["id"], "status": failure[0], "message": failure[1]})
            else:
                control.send({"op": "done", "id": message["id"], **result})


if __name__ == "__main__":
    import importlib

    from ..run.lifecycle import run_main

    # the module under its own name (run with -m, this file is `__main__`): its classes are the ones every other
    # module imports (one `Refused`, one `RowRules`), and what patches the named module patches what runs
    engine = importlib.import_module("ds_inference_integration.serve.engine")
    sys.exit(run_main(engine.main, sys.argv[1:]))
