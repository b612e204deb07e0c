"""One rank of a served replica: it loads and shards the model as predict does (`load_model`, `setup_inference`:
policies, derived policies verified, shard-aware and pre-sharded loading), then runs, in lock-step with its TP
peers, the rows the front admits to the replica's leader (its rank 0), over the typed messages of `wire`.

The leader alone talks to the front (a `multiprocessing.connection` socket); it broadcasts each message to its
peers (`broadcast_object_list` on the replica's gloo group, as transformers' own TP serving does), so it alone
fixes the order of admissions. Every rank then builds the model's inputs from the rows' prompts, runs the lock-step
guard and the same work: the step engine's steps (`serve/steps.py`, `--scheduler continuous`: the messages that
came since the last step, then one step) or the batch engine's `generate` (`run_batch`, one an admission). While idle the
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

from .rules import BeamGuard, BeamSteps, Refused, RowRules, RowStops, eos_ids, generation_config, own_failure
from .wire import (
    AUTHKEY_ENV,
    FRONT_ENV,
    Admit,
    Alive,
    Cancel,
    Failed,
    Finished,
    Hello,
    Keepalive,
    Ready,
    RowOutput,
    Stop,
    Tokens,
    no_delay,
)

KEEPALIVE_SECONDS = 1.0  # at most: a quarter of --inference_timeout where that is shorter (`keepalive_seconds`)


def keepalive_seconds(inference_timeout: float) -> float:
    """How often the leader says it is alive: every second, or four times within a shorter --inference_timeout (at
    --inference_timeout 1 an idle server was taken for a stopped one within seconds: one message a second arrives
    just past the front's limit)."""
    return min(KEEPALIVE_SECONDS, inference_timeout / 4)


class Control:
    """The leader's line to the front while it generates, given to every rank at the same step: which running rows'
    clients left (the front's Cancel), one broadcast on the control group per step (measured: 0.26 ms on gloo between
    two CPU ranks, against 16 ms for a decoding step of the embedded GPT-2 at tp 2). The leader also tells the front
    it is alive at least every `keepalive` seconds while it generates, so a long batch is never taken for a stopped
    replica. Other messages that arrive meanwhile wait in `pending` for the main loop. On a peer `conn` is None: it
    only takes part in the broadcast."""

    def __init__(self, conn, group, world_size: int, keepalive: float = KEEPALIVE_SECONDS):
        self.conn, self.group, self.world_size, self.keepalive = conn, group, world_size, keepalive
        self.pending: collections.deque = collections.deque()
        self.cancelled: set[int] = set()
        self.said = time.monotonic()

    def send(self, message) -> None:
        if self.conn is not None:
            self.conn.send(message)
            self.said = time.monotonic()

    def step(self, ids: list[int]) -> torch.BoolTensor:
        """Which of the rows `ids` were cancelled, the same on every rank."""
        flags = torch.zeros(len(ids), dtype=torch.bool)
        if self.conn is not None:  # the leader
            while self.conn.poll(0):
                message = self.conn.recv()
                if isinstance(message, Cancel):
                    self.cancelled.update(message.rows)
                self.pending.append(message)  # a Cancel too: the step engine's waiting rows (every rank's) end by it
            if time.monotonic() - self.said > self.keepalive:
                self.send(Alive())
            flags = torch.tensor([i in self.cancelled for i in ids], dtype=torch.bool)
        if self.world_size > 1:
            dist.broadcast(flags, src=0, group=self.group)
        return flags


def model_inputs(rows, pad_token_id: int | None, encoder_decoder: bool, device) -> dict[str, torch.Tensor]:
    """The rows' prompts as one padded batch: right-padded for an encoder (as the seq2seq collator pads sources),
    left-padded for a decoder-only model (new tokens follow every prompt directly)."""
    pad = pad_token_id if pad_token_id is not None else 0
    width = max(len(r.prompt_ids) for r in rows)
    ids, mask = [], []
    for r in rows:
        prompt, padding = list(r.prompt_ids), [pad] * (width - len(r.prompt_ids))
        ones, zeros = [1] * len(prompt), [0] * len(padding)
        ids.append(prompt + padding if encoder_decoder else padding + prompt)
        mask.append(ones + zeros if encoder_decoder else zeros + ones)
    return {"input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=device)}


class Answers:
    """What the leader tells the front of an admission's rows (every rank keeps the record, the leader sends it):
    each row answered once, Finished or Failed; `ended` the rows answered so far."""

    def __init__(self, control: Control):
        self.control, self.ended = control, set()

    def tokens(self, rows: dict[int, RowOutput]) -> None:
        """A step's new tokens, one record per row (row id -> `wire.RowOutput`)."""
        if rows:
            self.control.send(Tokens(rows))

    def finished(self, row: int, sequences: list[list[int]], reasons: list[str]) -> None:
        if row not in self.ended:
            self.ended.add(row)
            self.control.send(Finished(row, sequences, reasons))

    def failed(self, rows, status: int, message: str, together: bool = False) -> None:
        rows = tuple(r for r in rows if r not in self.ended)
        if rows:
            self.ended.update(rows)
            self.control.send(Failed(rows, status, message, together))


def run_batch(model, tokenizer, admit: Admit, device, control: Control | None = None,
              answers: Answers | None = None) -> dict:
    """The batch engine: an admission's rows generated by one `generate` (every rank, the same call). The leader's
    `answers` report each step's tokens and each row's end as it happens; returned, per row in the admission's order:
    its sequences (new tokens only), finish reasons ("error" for a row that failed, "cancelled" for one whose client
    left) and the failed rows' status and why."""
    rows, key = list(admit.rows), admit.key
    if any(r.logprobs >= 0 or r.prompt_logprobs for r in rows):
        raise Refused(400, "logprobs are served by the step engine, and this replica runs the batch engine "
                           "(--scheduler batch, or a model the step engine cannot take: its start-up line says); "
                           "valid: leave logprobs out (null)")
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    inputs = model_inputs(rows, tokenizer.pad_token_id, encoder_decoder, device)
    start = 1 if encoder_decoder else inputs["input_ids"].shape[1]
    eos = eos_ids(model)
    config = generation_config(model, key, key.max_new_tokens or max(r.max_new_tokens for r in rows),
                                tokenizer.pad_token_id)
    stops = None
    if key.num_beams == 1:
        def report(step, tokens, finished, failed):
            if answers is not None:
                answers.tokens({rows[i].id: RowOutput(t, step) for i, t in tokens.items()})
                for i, (reason, sequence) in finished.items():
                    answers.finished(rows[i].id, [sequence], [reason])
                for i, (status, why) in failed.items():
                    answers.failed((rows[i].id,), status, why)

        stops = RowStops(rows, start, eos, tokenizer, report, control)
        stops.rules = RowRules(rows, start, eos, device, finished=stops.lengths)
        kwargs = {"stopping_criteria": [stops], "logits_processor": [stops.rules]}
    else:
        kwargs = {"logits_processor": [BeamGuard(key.num_beams, start)],
                  "stopping_criteria": [BeamSteps([r.id for r in rows], control, key.stop, start, tokenizer)]}
    cleared = ("max_length", *(("eos_token_id",) if stops is not None else ()))
    with torch.no_grad(), _without(model.generation_config, cleared):
        out = model.generate(**inputs, generation_config=config, **kwargs)
    new = out[:, start:].tolist()
    sequences, reasons = [], []
    if stops is not None:
        for i, seq in enumerate(new):
            n = stops.lengths[i] if stops.lengths[i] is not None else len(seq)
            sequences.append([seq[:n]])
            reasons.append([stops.reasons[i] or "length"])
        failed = {i: list(v) for i, v in stops.rules.failed.items()}
    else:
        k, cancelled = key.num_return_sequences, control.cancelled if control is not None else set()
        for i, row in enumerate(rows):
            mine, why = [], []
            for seq in new[i * k:(i + 1) * k]:
                cut = next((j for j, t in enumerate(seq) if t in eos), None)
                # cut after its EOS, kept as a greedy row keeps it (`completion_tokens` counts it alike)
                mine.append(seq[:cut + 1] if cut is not None else _strip_pad(seq, tokenizer.pad_token_id))
                why.append("cancelled" if row.id in cancelled else "stop" if cut is not None else "length")
            sequences.append(mine)
            reasons.append(why)
        failed = {}
    if answers is not None:  # what the steps did not answer: beam rows, rows that ended when their client left
        for i, row in enumerate(rows):
            if i not in failed:
                answers.finished(row.id, sequences[i], reasons[i])
    return {"sequences": sequences, "finish": reasons, "failed": failed}


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

    from ..arguments import DeepSpeedInferenceArguments
    from ..load.loaders import load_model
    from ..load.own_code import load_config, load_tokenizer
    from ..load.skeleton import model_class_for
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
        no_delay(conn)
        conn.send(Hello(os.getpid()))
    model_dir = settings["model_dir"]
    trust = bool(settings.get("trust"))  # --trust_remote_code: the directory's own code, as the front read it
    config = load_config(model_dir, trust)
    tokenizer = load_tokenizer(model_dir, trust)
    model = load_model(model_class_for(config, trust), model_dir, config, inference_args=inference_args,
                       trust_remote_code=trust)
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
    capacity = settings["capacity"]
    guard = None
    if topology.tp_size > 1 and inference_args.lockstep_guard:
        def guard(rows, index):
            check_lockstep(model_inputs(rows, tokenizer.pad_token_id, False, "cpu"), topology, setup.groups.tp,
                           device, index)
    serve = Serving(model, tokenizer, device, control, group, world, guard)
    steps, scheduler = None, "batch"
    if settings.get("scheduler", "batch") == "continuous":
        from .steps import StepEngine, choose

        # admissions in the running rows' forward at tp > 1 (`StepEngine.fuse`: a forward costs its collectives)
        why, options = choose(model, tokenizer, device, capacity, fuse=topology.tp_size > 1)
        why = agree(None if why is None else (0, why), group, world)
        if why is None:
            # the batch engine behind the step engine, for what it cannot run (`steps_take`: more beams than slots)
            steps = StepEngine(model, tokenizer, device, capacity, serve.run_batch,
                               *settings.get("admission", (0.0, 0)), **options)
            scheduler = "continuous" + (", admissions in the running rows' step" if steps.fuse else "")
        else:
            scheduler = f"batch (--scheduler continuous: this model is served by the batch engine: {why[1]})"
    if leader:
        print(f"ds-inference serve: scheduler {scheduler}", flush=True)
    control.send(Ready(f"{setup.report}; scheduler {scheduler}", capacity=capacity, joins_running=steps is not None))
    if steps is not None:
        serve.steps_loop(steps)
    else:
        serve.batch_loop()


class Serving:
    """A rank's loop over the leader's messages: the batch engine's (`batch_loop`: one generate an admission) or the
    step engine's (`steps_loop`: one step at a time, admissions and cancellations between steps). A failure is its
    rows' unless `fatal`; the ranks agree on each batch's outcome and on each failed step (`agree`)."""

    def __init__(self, model, tokenizer, device, control: Control, group, world: int, guard=None):
        self.model, self.tokenizer, self.device, self.control = model, tokenizer, device, control
        self.group, self.world, self.guard = group, world, guard
        self.batches = 0

    def receive(self, wait: bool) -> list:
        """The leader's next messages, the same on every rank: what the front sent (waiting up to the keep-alive
        interval for one when `wait`, else what has arrived), or Keepalive when nothing came; Stop when the front is
        gone."""
        control, messages = self.control, []
        if control.conn is not None:
            try:
                messages.extend(control.pending)
                control.pending.clear()
                if wait and not messages:
                    messages.append(control.conn.recv() if control.conn.poll(control.keepalive) else Keepalive())
                while control.conn.poll(0):
                    messages.append(control.conn.recv())
            except (EOFError, OSError):
                messages = [Stop()]  # the front is gone: the replica ends with it
        if self.world > 1:
            count = torch.tensor([len(messages)])
            dist.broadcast(count, src=0, group=self.group)
            if count.item():
                box = [messages]
                dist.broadcast_object_list(box, src=0, group=self.group)
                messages = box[0]
        return messages

    def run_batch(self, admit: Admit, control: Control, answers: Answers) -> None:
        """The batch engine on one admission, its failure agreed and answered as its rows' (`fatal` ends the rank)."""
        self.batches += 1
        failure = None
        try:
            if self.guard is not None:
                self.guard(admit.rows, self.batches)
            run_batch(self.model, self.tokenizer, admit, self.device, control, answers)
        except Exception as e:  # noqa: BLE001 - a batch's failure is its requests' (see `fatal`)
            failure = self._failure(e)
        failure = agree(failure, self.group, self.world)
        if failure is not None:
            answers.failed([row.id for row in admit.rows], *failure, together=True)

    def _failure(self, error: Exception) -> tuple[int, str]:
        failure = own_failure(error)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what a failed allocation left behind
        return failure

    def batch_loop(self) -> None:
        while True:
            for message in self.receive(wait=True):
                if isinstance(message, Stop):
                    return
                if isinstance(message, Keepalive):
                    self.control.send(Alive())
                elif isinstance(message, Admit):
                    self.control.cancelled = set()
                    self.run_batch(message, self.control, Answers(self.control))
                # a Cancel here names rows already answered: nothing left to end

    def steps_loop(self, engine) -> None:
        """The step engine: between two steps, the leader's messages (admissions, cancellations) reach every rank
        alike; a step that failed on every rank is agreed and fails its running rows together (the front runs
        their requests again one at a time)."""
        control = self.control
        while True:
            # each step's own record of the rows it answered (a row is answered once within its step: a failed step
            # answers only its running rows); one record for the server's life kept every row id it ever answered
            answers = Answers(control)
            admitted = []
            for message in self.receive(wait=not engine.busy()):
                if isinstance(message, Stop):
                    return
                if isinstance(message, Keepalive):  # nothing came for a keep-alive interval
                    control.send(Alive())
                    engine.idle()
                elif isinstance(message, Cancel):
                    engine.cancel(message.rows)
                elif isinstance(message, Admit):
                    engine.take(message)
                    admitted.extend(message.rows)
            if not engine.busy():
                continue
            if control.conn is not None and time.monotonic() - control.said > control.keepalive:
                control.send(Alive())
            failure = None
            try:
                if admitted and self.guard is not None:
                    self.batches += 1
                    self.guard(admitted, self.batches)
                engine.step(answers, control)
            except Exception as e:  # noqa: BLE001 - a step's failure is its rows' (see `fatal`)
                failure = self._failure(e)
            # Agreed only where the step failed: a step's work is the same on every rank (the same messages, and
            # logits the same after the sharded forward), so a failure that is not `fatal` comes on every rank alike,
            # and they meet in `agree`; a rank that failed alone meets its peers nowhere and ends at the process
            # group's timeout, as docs/serving.md says. An agreement every step cost one more collective a step: at
            # tp 2 the step engine answered 0.89x the requests/s of the batch engine at concurrency 1 with it.
            if failure is not None:
                failure = agree(failure, self.group, self.world)
                answers.failed(engine.fail_running(), *failure, together=True)


if __name__ == "__main__":
    from ..run.lifecycle import run_main

    sys.exit(run_main(main, sys.argv[1:]))
