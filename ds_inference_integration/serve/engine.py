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

import contextlib
import json
import os
import sys
from multiprocessing.connection import Client

import torch

FRONT_ENV = "DS_INFERENCE_SERVE_FRONT"  # host:port of the front's socket (the leader connects)
AUTHKEY_ENV = "DS_INFERENCE_SERVE_AUTHKEY"  # hex; the front makes a random one per start
KEEPALIVE_SECONDS = 1.0


class RowRules:
    """A logits processor for per-row rules: EOS held back until a row's `min_tokens`, then, for a sampled row
    (temperature > 0), temperature, top-k, top-p and a draw from the row's own generator, written back as a
    one-hot score so that generate's greedy step takes it. Greedy rows pass through unchanged."""

    def __init__(self, rows: list[dict], start: int, eos: list[int], device):
        self.rows, self.start, self.eos = rows, start, eos
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
            g = self.generators[i]
            if g is None:
                continue
            logits = scores[i].float() / row["temperature"]
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
            choice = torch.multinomial(logits.softmax(-1), 1, generator=g)
            scores[i] = -float("inf")
            scores[i, choice] = 0.0
        return scores


class RowStops:
    """A stopping criterion with each row's own end: EOS (unless `ignore_eos`, and not before `min_tokens`), its
    `max_new_tokens`, its stop strings. `report(step, tokens, finished)` is called after every step on the leader
    (the new token of each row still running, and the rows that finished now with their reason)."""

    def __init__(self, rows: list[dict], start: int, eos: list[int], tokenizer, report=None):
        self.rows, self.start, self.eos, self.tokenizer, self.report = rows, start, set(eos), tokenizer, report
        self.lengths: list[int | None] = [None] * len(rows)
        self.reasons: list[str | None] = [None] * len(rows)

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.start:]
        produced = new.shape[1]
        done = torch.zeros(len(self.rows), dtype=torch.bool, device=input_ids.device)
        tokens, finished = {}, {}
        for i, row in enumerate(self.rows):
            if self.lengths[i] is not None:
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
            self.report(produced, tokens, finished)
        return done

    def _hits_stop(self, ids: torch.Tensor, stops: list[str]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)


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


def run_batch(model, tokenizer, batch: dict, device, report=None) -> dict:
    """Generate one batch (every rank, the same call); returns per row its sequences (new tokens only) and finish
    reasons."""
    input_ids = torch.tensor(batch["input_ids"], dtype=torch.long, device=device)
    attention_mask = torch.tensor(batch["attention_mask"], dtype=torch.long, device=device)
    rows = batch["rows"]
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    start = 1 if encoder_decoder else input_ids.shape[1]
    eos = eos_ids(model)
    config = _generation_config(model, batch, tokenizer.pad_token_id)
    kwargs = {}
    stops = None
    if batch["shared"]["num_beams"] == 1:
        stops = RowStops(rows, start, eos, tokenizer, report)
        kwargs = {"stopping_criteria": [stops], "logits_processor": [RowRules(rows, start, eos, device)]}
    elif batch["shared"].get("stop"):
        kwargs = {"stop_strings": batch["shared"]["stop"], "tokenizer": tokenizer}
    with torch.no_grad(), _no_eos(model, stops is not None):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
    new = out[:, start:].tolist()
    if stops is not None:
        sequences, reasons = [], []
        for i, seq in enumerate(new):
            n = stops.lengths[i] if stops.lengths[i] is not None else len(seq)
            sequences.append([seq[:n]])
            reasons.append([stops.reasons[i] or "length"])
        return {"sequences": sequences, "finish": reasons}
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
    return {"sequences": sequences, "finish": reasons}


@contextlib.contextmanager
def _no_eos(model, on: bool):
    """generate without its own EOS rule, for RowStops to end each row at EOS (or not: ignore_eos). Setting the
    batch's config to None is not enough: generate fills every None of the config it is given from the model's
    generation config (`_prepare_generation_config`, transformers 5), so an ignore_eos row still ended at EOS
    (20 tokens of the 24 asked, with finish_reason "length"). The model's own config goes without it meanwhile."""
    if not on:
        yield
        return
    config = model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = None
    try:
        yield
    finally:
        config.eos_token_id = saved


def _strip_pad(seq: list[int], pad: int | None) -> list[int]:
    while seq and pad is not None and seq[-1] == pad:
        seq = seq[:-1]
    return seq


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from ..arguments import DeepSpeedInferenceArguments
    from ..load.loaders import load_model, model_class_for
    from ..predict.lockstep import check_lockstep
    from ..run.ranks import end_with_parent, init_rank
    from ..shard.setup import setup_inference

    end_with_parent()  # a front (or worker) killed with SIGKILL takes its ranks with it
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
    if leader:
        conn.send({"op": "ready", "report": str(setup.report)})
    batches = 0
    while True:
        message = None
        if leader:
            try:
                message = conn.recv() if conn.poll(KEEPALIVE_SECONDS) else {"op": "keepalive"}
            except (EOFError, OSError):
                message = {"op": "stop"}  # the front is gone: the replica ends with it
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        op = message["op"]
        if op == "stop":
            return
        if op == "keepalive":
            if leader:
                conn.send({"op": "alive"})
            continue
        batches += 1
        report = None
        if leader:
            def report(step, tokens, finished, _id=message["id"]):
                conn.send({"op": "tokens", "id": _id, "step": step, "tokens": tokens, "finished": finished})
        try:
            inputs = {"input_ids": torch.tensor(message["input_ids"]),
                      "attention_mask": torch.tensor(message["attention_mask"])}
            if topology.tp_size > 1 and inference_args.lockstep_guard:
                check_lockstep(inputs, topology, setup.groups.tp, device, batches)
            result = run_batch(model, tokenizer, message, device, report)
        except ValueError as e:  # this batch refused alike on every rank (generate's checks): answered, goes on
            # (anything else, a broken collective above all, ends the rank: the front answers 503 and exits)
            if leader:
                conn.send({"op": "failed", "id": message["id"], "message": f"{type(e).__name__}: {e}"})
            continue
        if leader:
            conn.send({"op": "done", "id": message["id"], **result})


if __name__ == "__main__":
    from ..run.lifecycle import run_main

    sys.exit(run_main(main, sys.argv[1:]))
