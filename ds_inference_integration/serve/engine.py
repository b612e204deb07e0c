"""One rank of a served replica: it loads and shards the model as predict does (`load_model`, `setup_inference`:
policies, derived policies verified, shard-aware and pre-sharded loading), then runs, in lock-step with its TP
peers, the batches the front hands to the replica's leader (its rank 0).

The leader alone talks to the front (a `multiprocessing.connection` socket); it broadcasts each message to its
peers (`broadcast_object_list` on the replica's gloo group, as transformers' own TP serving does), so it alone
fixes the order of batches. Every rank then runs the lock-step guard and the same `generate`. While idle the
leader broadcasts a keep-alive every second, so that a waiting peer never reaches `--inference_timeout` (also
its process group's timeout), and tells the front it is alive; while it generates, `Control` passes the front's
word between steps (rows whose clients left end at the next step, on every rank) and keeps telling the front it is
alive, so a long batch is never taken for a stopped rank.

Per-row rules in one batch (`RowRules`, `RowStops`): each row has its own `max_new_tokens`, minimum, stop
strings, EOS handling (`ignore_eos`) and sampling (temperature, top-k, top-p, its own seeded generator, so a
row's tokens do not depend on which requests share its batch); the leader reports every new token and every
finished row as it happens, so a short row is answered before its batch ends. A row from which no token can be
taken ends alone with its error. Beam search keeps generate's own rules (its rows share them: the front's batching
key), with our stop strings and a guard. A batch that fails is its requests' failure, not the replica's, unless the
ranks can no longer be trusted (`fatal`, `agree`; docs/serving.md says which is which).

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

from .rules import BeamGuard, BeamSteps, Refused, RowRules, RowStops

FRONT_ENV = "DS_INFERENCE_SERVE_FRONT"  # host:port of the front's socket (the leader connects)
AUTHKEY_ENV = "DS_INFERENCE_SERVE_AUTHKEY"  # hex; the front makes a random one per start
KEEPALIVE_SECONDS = 1.0  # at most: a quarter of --inference_timeout where that is shorter (`keepalive_seconds`)


def keepalive_seconds(inference_timeout: float) -> float:
    """How often the leader says it is alive: every second, or four times within a shorter --inference_timeout (at
    --inference_timeout 1 an idle server was taken for a stopped one within seconds: one message a second arrives
    just past the front's limit)."""
    return min(KEEPALIVE_SECONDS, inference_timeout / 4)


class Control:
    """What the leader learns from the front between decoding steps, given to every rank at the same step: the rows
    whose clients left (the front's "cancel"), one broadcast on the control group per step (measured: 0.26 ms on
    gloo between two CPU ranks, against 16 ms for a decoding step of the embedded GPT-2 at tp 2). The leader also
    tells the front it is alive at least every KEEPALIVE_SECONDS while it generates, so a long batch is never taken
    for a stopped replica. Other messages that arrive meanwhile wait in `pending` for the main loop."""

    def __init__(self, conn, group, world_size: int, keepalive: float = KEEPALIVE_SECONDS):
        self.conn, self.group, self.world_size, self.keepalive = conn, group, world_size, keepalive
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
            if time.monotonic() - self.said > self.keepalive:
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
    # Ctrl-C (and a closed terminal's SIGHUP) reach every process of the group: the front (or worker) drains and
    # ends the ranks; a rank that died of them first made the front answer 503 and exit 3 instead
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):  # and asgi.IGNORED
        signal.signal(sig, signal.SIG_IGN)
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
    keepalive = keepalive_seconds(inference_args.inference_timeout)
    control = Control(conn, group, world, keepalive)
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
                    message = conn.recv() if conn.poll(keepalive) else {"op": "keepalive"}
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
    from ..run.lifecycle import run_main

    sys.exit(run_main(main, sys.argv[1:]))
