"""The step engine (`--scheduler continuous`): rows join and leave a running batch at every decoding step.

Every rank runs the same steps in lock step (the leader broadcasts each step's admissions and cancellations,
`engine.Serving.steps_loop`). A step is three parts, each with its own type: `schedule` (rows whose clients left end,
their slots freed; the rows waiting are admitted while slots are free: a `Plan`), `execute` (the forwards: the
admitted rows prefilled together, with transformers' own cache, packed into one sequence or right-padded; an
encoder-decoder's admitted rows only their encoder, their first decoder step this step's; each row's keys and values
copied into its slot of `slots.SlotCache`; then every row that was running decodes one token, all together, each at
its own position under a 4D mask, `SlotCache.decode`: its `Outputs`), `update` (each row's token chosen by its rules,
beams advanced, rows that end answered). A row
ends the step it ends (answered, slot freed), so a short row never waits for a long one and a new row never waits
for a batch.

Each row keeps generate's own rules, one row at a time: the logits processors generate builds from the model's
generation config and the row's settings (`_get_logits_processor`, repetition penalty included), then our per-row
rules (`rules.RowRules`: minimum, sampling with the row's seeded generator; `rules.row_end`: EOS, stop ids and
strings, max_tokens, as the batch engine's `RowStops` ends rows). A row's tokens are then those of its request
generated alone in one process.

Decoders that take no per-row positions (an encoder-decoder's decoder computes them from its cache's one length:
BART's family adds learned or sinusoidal embeddings at that position, T5's a relative bias from it) get them from
`DecoderPositions` while a step runs. Every row taken is one record (`_Row`) from its admission to its answer, its
`Status` saying where it is (waiting, prefilling, running, finished, cancelled, failed); `running` maps each slot to
the row holding it. Beam requests are groups of slots (a row whose `group` is its `beams.BeamGroup`); one with more beams
than the slots is run by the batch engine (`engine.run_batch`, one generate) when no row is running, rows behind it
waiting (first come, first served). State-space and linear-attention layers keep a state per slot
(`slots.SlotStateLayer`), their rows prefilled left-padded. A model whose probe (`probe`: rows joining a running
batch must give each row's logits alone) fails, or whose cache holds layers of another kind (`slots.check_layers`),
is served by the batch engine alone, said at start."""

from __future__ import annotations

import collections
import contextlib
import enum
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, EncoderDecoderCache, LogitsProcessorList
from transformers.modeling_outputs import BaseModelOutput

from ..errors import first_line
from ..policy.configs import text_config
from . import rules as row_rules
from .beams import BeamGroup
from .prefill import PACKED_TOKENS, Prefill, top_logprobs
from .rules import RowRules, eos_ids, generation_config, own_failure, with_defaults
from .sampling import changes_greedy
from .slots import SlotCache, check_layers, layer_kinds
from .wire import Admit, BatchKey, RowOutput, RowSpec

# The rows admitted at one step keep rows x (their longest prompt)^2 within this: a right-padded prefill's attention
# weights a head where they are computed (4 x 1024^2: 16 MiB in fp32), and an encoder's over padded prompts; 16 rows
# of 2,048 tokens admitted at once held 64M (256 MiB a head), 4 a step now; 16 of 512 tokens, or of bench serve's
# 32, join together as before
ADMISSION_BUDGET = 4 * PACKED_TOKENS * PACKED_TOKENS


class NotPerRow(Exception):
    """A model whose cache the step engine cannot hold a row of (`probe` says why)."""


def steps_take(key: BatchKey, capacity: int) -> bool:
    """Whether the step engine runs rows of this key (else the batch engine runs their admission whole): any key
    whose beams fit the slots (/generate's other settings are logits processors and beam settings, which each row
    and beam group builds as generate builds them)."""
    return key.num_beams <= capacity


class Status(enum.Enum):
    """Where a row is, from its admission to its answer."""

    WAITING = "waiting"  # taken, not yet given a slot
    PREFILLING = "prefilling"  # given its slots; its prompt goes through the model this step
    RUNNING = "running"  # decoding a token a step
    FINISHED = "finished"  # answered with its tokens
    CANCELLED = "cancelled"  # its client left
    FAILED = "failed"  # answered with why it failed


@dataclass(eq=False)  # a row is itself (a set member, a dict key)
class _Row:
    """One row of the engine from its admission to its answer (a beam request: one record for its beams, `group`),
    with its status; `running` maps each slot it holds to it."""

    spec: RowSpec
    key: BatchKey
    arrived: int  # the step it was taken at
    status: Status = Status.WAITING
    slot: int = -1
    ids: list[int] = field(default_factory=list)  # prompt (decoder-only) or decoder start, and new tokens
    start: int = 0  # where its new tokens start in `ids`
    processors: LogitsProcessorList | None = None
    rules: RowRules | None = None
    group: BeamGroup | None = None  # a beam request's search: its slots are the group's

    @property
    def new(self) -> list[int]:
        return self.ids[self.start:]

    @property
    def produced(self) -> int:
        return len(self.ids) - self.start


@dataclass
class Plan:
    """What one step does, decided before anything runs (`StepEngine.schedule`): an admission the batch engine runs
    whole and alone, or the rows admitted now (`joining`: one each; `groups`: beam requests) and the rows that were
    running, which decode a token (slot -> row)."""

    whole: Admit | None = None
    joining: list[_Row] = field(default_factory=list)
    groups: list[_Row] = field(default_factory=list)
    decoding: dict[int, _Row] = field(default_factory=dict)


@dataclass
class Outputs:
    """What a step's forwards gave (`StepEngine.execute`), for `StepEngine.update` to choose tokens from: each
    admitted row's first logits (a decoder-only row's prefill; a beam request's, one row per beam) with its prompt's
    log probabilities where it asked for them (else None), and the decoding rows with the step's logits (a row per
    slot up to the highest decoding)."""

    first: list[tuple[_Row, torch.Tensor, list | None]] = field(default_factory=list)
    decoded: dict[int, _Row] = field(default_factory=dict)
    logits: torch.Tensor | None = None


class StepEngine:
    """The rows of one replica, slot by slot. `take` queues an admission (rows), `cancel` names rows whose clients
    left; `step` runs one step and reports through `answers` (`engine.Answers`: tokens, rows finished or failed);
    `run_batch(admit, control, answers)` is the batch engine, for admissions the steps do not take."""

    def __init__(self, model, tokenizer, device, capacity: int, run_batch=None, waiting_served_ratio: float = 0.0,
                 max_waiting_steps: int = 0, project_cross: bool = True, fixed_shapes: bool | None = None,
                 pack_prefill: bool = True, fuse_admissions: bool = False):
        self.model, self.tokenizer, self.device, self.capacity = model, tokenizer, device, capacity
        self.run_batch = run_batch
        # when waiting rows join running ones (TGI's rule): once they are `waiting_served_ratio` x the running rows,
        # or the oldest has waited `max_waiting_steps` steps, or nothing runs (0, 0: at the next step, always)
        self.waiting_served_ratio, self.max_waiting_steps = waiting_served_ratio, max_waiting_steps
        self.steps = 0  # steps run
        # the admissions' forwards, and the model's facts they and the steps read
        self.prefill = Prefill(model, tokenizer, device, pack_prefill)
        self.encoder_decoder, self.states = self.prefill.encoder_decoder, self.prefill.states
        self.pad, self.cache_name, self.keep = self.prefill.pad, self.prefill.cache_name, self.prefill.keep
        # sliding-window attention: every key kept, the window the step's mask's; the sliding layers' mask passed as
        # the model's mapping by layer type where its config names its layers' types (Qwen2, Gemma 2/3...), as the
        # one mask where the window is the whole model's (Mistral); the probe checks what was chosen
        self.window = self.prefill.window
        self.mapping = bool(getattr(text_config(model.config), "layer_types", None))
        self.positions = DecoderPositions(model) if self.encoder_decoder else None
        # a decoding step over every slot and the cache's whole width (`SlotCache.decode(fixed=True)`): its shapes
        # change only when the cache grows, as CUDA graphs and `torch.compile` need; by default on a GPU only. On
        # CPU it costs the empty slots' rows and the masked columns: 0.85x the tokens/s of the tight steps on
        # gpt2-256, 1.03x on the embedded T5 (in one process, 1 thread, 64 rows of max_tokens 8-128 through 16 slots
        # as each ends, medians of 3, 2026-12-05)
        self.fixed_shapes = str(device).startswith("cuda") if fixed_shapes is None else fixed_shapes
        # rows admitted while others run prefilled in the running rows' decoding forward (`_fused`), where the
        # model's attention takes any 4D mask (decoder-only, keys and values only, no window: what packing needs).
        # The server asks for it at tp > 1 (`engine.main`), where a forward costs its collectives: bench serve's
        # gpt2-256 at tp 2, mixed lengths 8-128, concurrency 16: 1.61x the batch engine's output tok/s (TPOT 12.3
        # ms) against 1.38x (14.3 ms) with a forward of their own (2026-12-07, 3 repeats each). In one process its
        # attention over every slot's columns costs more than the forward it saves: a step admitting one 32-token
        # row beside 15 on gpt2-256 took 4.5 ms fused against 3.5 apart, 71 against 55 ms on a Llama of width 512.
        self.fuse = (fuse_admissions and self.prefill.pack and not self.fixed_shapes and self.window is None)
        # joining rows' cross-attention keys and values projected at admission (`CrossProjection`), where the decoder's
        # layers are found and `project_cross` (the probe's choice) allows; else computed in the step's forward
        self.projection = CrossProjection.of(model) if self.encoder_decoder and project_cross else None
        self.eos = eos_ids(model)
        self.eos_set = set(self.eos)
        self.waiting: collections.deque = collections.deque()  # rows (`_Row`), or an Admit for the batch engine
        self.running: dict[int, _Row] = {}  # slot -> the row holding it (a beam request holds several)
        self.cancelled: set[int] = set()
        self.alone = False  # running an admission that must run alone
        self.cache: SlotCache | None = None
        self.joining: dict[int, torch.Tensor] = {}  # slot -> the encoder's output for a row whose first step is next
        self.record: dict[int, list[torch.Tensor]] | None = None  # row id -> each step's logits (`probe`)
        self.configs: dict = {}  # key -> its rows' generation config (`_config`)
        self.ended: list[tuple] = []  # rows that ended this step: (id, sequences, reasons), answered after its tokens

    # ----- what the leader passes on
    def take(self, admit: Admit) -> None:
        if steps_take(admit.key, self.capacity) and not admit.alone:
            self.waiting.extend(_Row(spec, admit.key, self.steps) for spec in admit.rows)  # a row, or a beam request
        else:  # run whole, with no other row beside it
            self.waiting.append(admit)

    def cancel(self, ids) -> None:
        self.cancelled.update(ids)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def rows(self) -> list[int]:
        """The ids of every row held (running or waiting), in order."""
        held = list(dict.fromkeys(r.spec.id for r in self.running.values()))  # a beam group holds several slots
        for item in self.waiting:
            held.extend(s.id for s in item.rows) if isinstance(item, Admit) else held.append(item.spec.id)
        return held

    # ----- one step
    def _admit_now(self) -> bool:
        """Whether the rows waiting join the running ones at this step: a prefill holds every running row back for
        its length, and a few rows prefilled together cost about what one does (one forward's overhead), so waiting
        rows join once they are `waiting_served_ratio` x the running rows or the oldest has waited
        `max_waiting_steps` steps, as TGI's router decides (its `waiting_served_ratio` and `max_waiting_tokens`; ours
        are `--waiting_served_ratio` and `--max_waiting_steps`, measured in `serve/settings.py`)."""
        if not self.running or not self.waiting or isinstance(self.waiting[0], Admit):
            return True
        running = len(set(map(id, self.running.values())))
        waiting = sum(1 for item in self.waiting if not isinstance(item, Admit))
        oldest = self.waiting[0].arrived
        return waiting >= self.waiting_served_ratio * running or self.steps - oldest >= self.max_waiting_steps

    def step(self, answers, control=None) -> None:
        """One step; the step's tokens (with the log probabilities rows asked for) are answered before the rows that
        ended with them, so that the front has every token's before it answers a row."""
        tokens: dict[int, RowOutput] = {}  # row id -> what this step gave it
        done = False
        try:
            self._step(answers, control, tokens)
            done = True
        finally:
            if done and tokens:
                answers.tokens(tokens)
            ended, self.ended = self.ended, []
            for row_id, sequences, reasons in ended:  # also where the step failed: these rows had ended before
                answers.finished(row_id, sequences, reasons)

    def _step(self, answers, control, tokens: dict) -> None:
        """schedule -> execute -> update: which rows are admitted, run and ended; the forwards over them on every
        rank; each row's token chosen, beams advanced, rows ended and answered."""
        self.steps += 1
        self._end_cancelled(answers)
        plan = self.schedule()
        if plan.whole is not None:  # the batch engine's: one generate, no other row beside it
            if control is not None:
                control.cancelled = set(self.cancelled)
            self.run_batch(plan.whole, control, answers)
            if control is not None:
                self.cancel(control.cancelled)  # cancellations that came while it ran
            return
        self.update(self.execute(plan, answers), tokens, answers)
        if not self.running:
            self.alone = False
            if not self.waiting:
                self.joining = {}

    def schedule(self) -> Plan:
        """This step's plan: the rows that were running decode; the rows waiting join them while slots are free (first
        come, first served; a beam request takes its beams' slots at once) where `_admit_now` says, as many as keep
        rows x longest prompt^2 within ADMISSION_BUDGET (the first always: a prompt alone is bounded by the model's
        positions), the others at the next steps; an admission the batch engine runs whole waits until no row runs."""
        plan = Plan(decoding=dict(self.running))
        if self.waiting and isinstance(self.waiting[0], Admit) and not self.running:
            # a whole admission's turn, alone (while rows run, none is admitted before it: first come, first served)
            admit = self.waiting.popleft()
            if not steps_take(admit.key, self.capacity):
                plan.whole = admit
                return plan
            self.alone = True  # a request run again alone (its batch failed): nothing joins it until it ends
            self.waiting.extendleft(reversed([_Row(spec, admit.key, self.steps) for spec in admit.rows]))
            limit = len(admit.rows)
        else:
            limit = 0 if (self.alone and self.running) or not self._admit_now() else len(self.waiting)
        free = self.capacity - len(self.running)
        rows, longest = 0, 0  # the rows joining, and their longest prompt
        while self.waiting and not isinstance(self.waiting[0], Admit) and len(plan.joining) + len(plan.groups) < limit:
            need = self.waiting[0].key.num_beams
            if need > free:
                break
            if need == 1 and not self.alone:  # within ADMISSION_BUDGET, or the first row alone
                wider = max(longest, len(self.waiting[0].spec.prompt_ids))
                if rows and (rows + 1) * wider * wider > ADMISSION_BUDGET:
                    break
                rows, longest = rows + 1, wider
            free -= need
            (plan.groups if need > 1 else plan.joining).append(self.waiting.popleft())
        return plan

    def execute(self, plan: Plan, answers) -> Outputs:
        """The plan's forwards, on every rank alike: the admitted rows' prefills (an encoder-decoder's rows, once its
        cache exists, only their encoder: their first decoder step is this step's decoding forward), then one
        decoding forward over the decoding rows. A prefill that fails fails its rows alone (answered here)."""
        outputs, decoding = Outputs(), dict(plan.decoding)
        if plan.joining and decoding and self._fuses(plan.joining, decoding):
            fused = self._fused(plan.joining, decoding)
            if fused is not None:
                outputs.first += fused[0]
                plan = Plan(groups=plan.groups)
                outputs.decoded, outputs.logits, decoding = decoding, fused[1], {}
        if plan.joining:
            first, joined = self._admit(plan.joining, answers)
            outputs.first += first
            for row in joined:
                decoding[row.slot] = row
        for row in plan.groups:
            found = self._admit_beams(row, answers)
            if found is not None:
                outputs.first.append(found)
        if decoding:
            outputs.decoded, outputs.logits = decoding, self._forward(decoding)
        return outputs

    def update(self, outputs: Outputs, tokens: dict, answers) -> None:
        """Each row's token from its logits, by its rules: admitted rows' first tokens, beam requests' steps, then the
        decoding rows' (plain greedy rows together, `_plain`); rows that end are answered."""
        for row, logits, prompt in outputs.first:
            if row.group is not None:
                self._beam_step(row, logits, answers)
            else:
                self._next(row, logits, tokens, answers, prompt_logprobs=prompt)
        if outputs.logits is not None:
            self._choose(outputs.decoded, outputs.logits, tokens, answers)

    def idle(self) -> None:
        """No row held for a while (the server's loop calls this when nothing came for a keep-alive interval, on
        every rank alike): the slot cache goes back to its first width (`_release`)."""
        if not self.busy():
            self._release()

    def _release(self) -> None:
        """The slot cache back to its first width (`SlotCache.shrink`), so that memory follows the rows held now,
        not the longest row ever held: the cache grows to the longest row's width for every slot and never shrank
        (one 2048-token row left a 32-layer model with 8 KV heads of 128 at 32 slots holding
        2 x 32 x 8 x 128 x 2048 x 32 x 2 bytes = 8.6 GB in bf16 until the server ended, idle or not). Shrunk rather
        than dropped: a T5 row admitted into no cache takes the first prefill's way, 4.3 against 3.9 ms. Not the
        moment the last row ends (`idle`): a client alone, whose next request comes right after its answer, had the
        cache shrunk and grown again (16 -> 128 columns) for every request, 30 allocations each, and its decoding
        steps ran 0.85x the batch engine's (embedded T5, tp 1, concurrency 1, 2026-12-05)."""
        if self.cache is not None:
            self.cache.shrink()
        self.joining = {}

    def _end_cancelled(self, answers) -> None:
        if not self.cancelled:
            return
        for slot, row in list(self.running.items()):
            if row.spec.id in self.cancelled:
                del self.running[slot]
                if row.status is not Status.CANCELLED:  # once for a beam request's slots
                    row.status = Status.CANCELLED
                    answers.finished(row.spec.id, [row.new] if row.group is None else [[]], ["cancelled"])
        kept = collections.deque()
        for item in self.waiting:
            specs = item.rows if isinstance(item, Admit) else (item.spec,)
            if all(s.id in self.cancelled for s in specs):
                if not isinstance(item, Admit):
                    item.status = Status.CANCELLED
                for s in specs:
                    answers.finished(s.id, [[]], ["cancelled"])
            else:
                kept.append(item)
        self.waiting = kept
        self.cancelled &= set(self.rows())  # ids no longer held are forgotten

    def _prepare(self, row: _Row, slot: int) -> _Row:
        """A row given its slot, prefilled next: its processors (generate's, from the model's generation config and
        its key), rules and stops; its ids start as its prompt (a decoder-only model) or the decoder's start token."""
        spec = row.spec
        prompt = torch.tensor([list(spec.prompt_ids)], dtype=torch.long, device=self.device)
        config = self._config(row.key)
        row.processors = self.model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt.shape[1], encoder_input_ids=prompt,
            logits_processor=LogitsProcessorList(), device=self.device, model_kwargs={})
        row.ids = self._start(spec, config)
        row.start, row.slot, row.status = len(row.ids), slot, Status.PREFILLING
        row.rules = RowRules([spec], row.start, self.eos, self.device)
        return row

    def _config(self, key: BatchKey):
        """The generation config of a row of `key` (`rules.generation_config`, generate's defaults and special
        tokens filled), kept per key: building one copies the model's whole config (1.3 ms a row on the embedded T5,
        2026-12-05: 6% of the step engine's time on rows of random lengths while it was kept per (key, length)), and
        rows read it only for their processors and decoder start, which no row's length changes (its length is its
        `RowRules`'; a beam group builds its own, `_admit_beams`)."""
        found = self.configs.get(key)
        if found is None:
            if len(self.configs) >= 256:
                self.configs.clear()
            found = with_defaults(self.model, generation_config(self.model, key, None, self.tokenizer.pad_token_id))
            self.model._prepare_special_tokens(found, True, device=self.device)
            self.configs[key] = found
        return found

    def _start(self, spec: RowSpec, config) -> list[int]:
        """What a row's ids start as: its prompt (a decoder-only model) or the decoder's start token (`config` after
        `_prepare_special_tokens`)."""
        if self.encoder_decoder:
            return [int(config._decoder_start_token_tensor.reshape(-1)[0])]
        return list(spec.prompt_ids)

    def _admit(self, items: list, answers) -> tuple[list, list[_Row]]:
        """New rows (`_Row`s waiting): prefilled together and copied into free slots; their first tokens are chosen
        by `update` from the logits returned. A prefill that fails is run again a row at a time, so that only the row
        that fails alone fails.

        An encoder-decoder's rows, once the slots exist, only run their encoder here (together), and their
        cross-attention keys and values are projected from it into their slots (`CrossProjection`; where the probe
        found that wrong, the step's forward computes them, `SlotCache.join`): their first decoder step is the
        step's decoding forward with the running rows (`_decode`), so an admission costs one forward less: at tp 2 on
        this machine a forward costs mostly its collectives (the embedded T5's 16-row step, 21 ms at tp 2 against 6
        at tp 1). Those rows are returned, to decode with the others.

        A row that asked for its prompt's log probabilities is prefilled alone: every position of a prefill then goes
        through the head, and together with the admission's other rows the logits held were [rows, longest prompt,
        vocabulary] (16 rows of 2048 tokens of a 150k vocabulary: 20 GB in fp32); alone, its own prompt's.

        Returns the decoder-only rows' first logits ((row, logits, its prompt's log probabilities or None) each) and
        the encoder-decoder rows that decode in this step's forward."""
        if len(items) > 1 and any(item.spec.prompt_logprobs for item in items):
            plain = [item for item in items if not item.spec.prompt_logprobs]
            first, joined = self._admit(plain, answers) if plain else ([], [])
            for item in items:
                if item.spec.prompt_logprobs:
                    more = self._admit([item], answers)
                    first, joined = first + more[0], joined + more[1]
            return first, joined
        rows = [self._prepare(item, slot) for item, slot in zip(items, self._free())]
        encoders = self.encoder_decoder and self.cache is not None  # the rows' encoders only, here
        projected = None
        try:
            if encoders:
                encoded = self.prefill.encode(*self.prefill.padded([r.spec.prompt_ids for r in rows]))
                if self.projection is not None and self.projection.fits(len(self.cache.cross.layers)):
                    projected = self.projection(encoded)
            else:
                wants = [r.spec if r.spec.prompt_logprobs else None for r in rows]
                prefilled, logits, places, prompt = self._prefill([(r.spec.prompt_ids, r.ids) for r in rows], wants)
        except NotPerRow:
            raise
        except Exception as e:  # noqa: BLE001 - the rows' failure (alike on every rank), unless `fatal`
            failure = own_failure(e)
            if len(items) > 1:
                alone = [self._admit([item], answers) for item in items]
                return [f for a in alone for f in a[0]], [r for a in alone for r in a[1]]
            rows[0].status = Status.FAILED
            answers.failed((rows[0].spec.id,), *failure)
            return [], []
        first = []
        for b, row in enumerate(rows):
            self.running[row.slot] = row
            row.status = Status.RUNNING
            if encoders:
                if projected is not None:  # its cross-attention keys in its slot now: the step decodes it as any row
                    self.cache.write_cross(row.slot, [(k[b:b + 1], v[b:b + 1]) for k, v in projected],
                                           len(row.spec.prompt_ids))
                else:
                    self.joining[row.slot] = encoded[b, :len(row.spec.prompt_ids)]
                continue
            at, offset = places[b]
            self.cache.write_prompt(row.slot, prefilled, at, len(row.ids), len(row.spec.prompt_ids), offset)
            first.append((row, logits[b], prompt.get(row.spec.id)))
        return first, (rows if encoders else [])

    def _prefill(self, rows: list[tuple], wants: list | None = None) -> tuple:
        """The rows' prompts through the model at once (`prefill.Prefill.run`: its cache, each row's last logits,
        places and asked-for prompt log probabilities); the slot cache is made from the first prefill's layers, or the
        model refused (`NotPerRow`) where a layer is of a kind it cannot hold."""
        prefilled, logits, places, prompt = self.prefill.run(rows, wants)
        if self.cache is None:
            why = check_layers(prefilled)
            if why:
                raise NotPerRow(f"the step engine cannot hold this model's cache: {why}")
            self.cache = SlotCache(layer_kinds(prefilled), self.capacity, cross=self.encoder_decoder)
        return prefilled, logits, places, prompt

    def _admit_beams(self, row: _Row, answers) -> tuple[_Row, torch.Tensor, None] | None:
        """A beam request: its prompt prefilled once and copied into `num_beams` free slots; its first logits, one row
        per beam, for its first step (None where its prefill failed: answered)."""
        spec, key = row.spec, row.key
        row.status = Status.PREFILLING
        slots = self._free()[:key.num_beams]
        config = with_defaults(self.model, generation_config(self.model, key, key.max_new_tokens or spec.max_new_tokens,
                                                             self.tokenizer.pad_token_id))
        try:
            group = BeamGroup(self.model, spec, key, slots, config, self.eos, self.tokenizer, self.device,
                              start=lambda prepared: self._start(spec, prepared))
            prefilled, logits, places, _ = self._prefill([(spec.prompt_ids, group.start)])
        except NotPerRow:
            raise
        except Exception as e:  # noqa: BLE001 - the request's failure (alike on every rank), unless `fatal`
            row.status = Status.FAILED
            answers.failed((spec.id,), *own_failure(e))
            return None
        row.group, row.status = group, Status.RUNNING
        for slot in slots:  # an encoder-decoder's beams read the first beam's cross-attention keys
            self.cache.write_prompt(slot, prefilled, 0, len(group.start), len(spec.prompt_ids), places[0][1],
                                    holder=None if slot == slots[0] else slots[0])
            self.running[slot] = row
        return row, logits[0][None].expand(len(slots), -1), None

    def _beam_step(self, row: _Row, logits: torch.Tensor, answers) -> None:
        """A beam request's step from its beams' logits: the search advances, its slots are reordered within its
        group, and it is answered when the search ends; a request with nothing left to take fails alone."""
        group = row.group
        try:
            sources = group.step(logits)
        except Exception as e:  # noqa: BLE001 - the request's failure (alike on every rank), unless `fatal`
            failure = own_failure(e)
            for slot in group.slots:
                del self.running[slot]
            row.status = Status.FAILED
            answers.failed((group.spec.id,), *failure)
            return
        self.cache.reorder(group.slots, [group.slots[j] for j in sources])
        if group.done:
            for slot in group.slots:
                del self.running[slot]
            row.status = Status.FINISHED
            answers.finished(group.spec.id, *group.result(self.tokenizer.pad_token_id))

    @staticmethod
    def _input(held: _Row, slot: int) -> tuple[int, int]:
        """What a decoding slot feeds the step: (its last token, that token's position); a beam's, its group's."""
        if held.group is not None:
            return held.group.last_tokens()[held.group.slots.index(slot)], held.group.position()
        return held.ids[-1], len(held.ids) - 1

    def _free(self) -> list[int]:
        """The slots no row holds, lowest first (the order admissions take them in)."""
        return sorted(set(range(self.capacity)) - set(self.running))

    def _fuses(self, items: list[_Row], decoding: dict) -> bool:
        """Whether the admitted rows are prefilled in the decoding forward (`_fused`): where the engine fuses, no
        admitted row asked for its prompt's log probabilities, and the step's mask (and the attention weights where
        they are computed) stay within PACKED_TOKENS^2 a head: the step's tokens x every slot's columns (one 2,000-token
        prompt beside 16 rows of 2,048 columns: 66M, 264 MB a head in fp32)."""
        if not self.fuse or self.cache is None or any(item.spec.prompt_logprobs for item in items):
            return False
        tokens = sum(len(item.spec.prompt_ids) for item in items) + len(decoding)
        hi = max(max(decoding), len(self.running) + len(items) - 1) + 1
        width = max([len(item.spec.prompt_ids) for item in items]
                    + [self._input(held, slot)[1] + 1 for slot, held in decoding.items()])
        return tokens * hi * width <= PACKED_TOKENS * PACKED_TOKENS

    def _fused(self, items: list[_Row], decoding: dict) -> tuple | None:
        """The admitted rows' prompts and the running rows' next tokens in one forward, as one sequence (each token at
        its slot's position, each seeing its own slot's past: `SlotCache.tokens`): (the admitted rows' first logits,
        as `_admit` gives them; the decoding rows' logits by slot, as `_forward` gives them), or None where that
        forward failed (the step then runs them apart, and a failure is theirs as it would be)."""
        rows = [self._prepare(item, slot) for item, slot in zip(items, self._free())]
        places, ids, keep = [], [], []
        for row in rows:
            prompt = list(row.spec.prompt_ids)
            places += [(row.slot, p) for p in range(len(prompt))]
            ids += prompt
            keep.append(len(ids) - 1)
        order = sorted(decoding)
        for slot in order:
            token, position = self._input(decoding[slot], slot)
            places.append((slot, position))
            ids.append(token)
            keep.append(len(ids) - 1)
        hi = max(slot for slot, _ in places) + 1
        kept = {"logits_to_keep": torch.tensor(keep, device=self.device)} if self.keep else {}
        try:
            position_ids, mask = self.cache.tokens(places, hi)
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                                 position_ids=position_ids, attention_mask=mask, use_cache=True,
                                 **{self.cache_name: self.cache}, **kept)
        except Exception as e:  # noqa: BLE001 - run apart, where a failure is the rows' own (`_admit`, `_forward`)
            own_failure(e)  # unless `fatal` (a rank or a collective gone): that ends the replica, as anywhere
            return None
        finally:
            self.cache.done()
        logits = (out.logits[0] if self.keep else out.logits[0, keep]).to(dtype=torch.float32)
        first = []
        for b, row in enumerate(rows):
            self.running[row.slot] = row
            row.status = Status.RUNNING
            first.append((row, logits[b], None))
        by_slot = logits.new_zeros((hi, logits.shape[-1]))
        by_slot[torch.tensor(order, device=logits.device)] = logits[len(rows):]
        return first, by_slot

    def _forward(self, rows: dict) -> torch.Tensor:
        """One decoding forward for every row in `rows` (slot -> its row; a beam request's at each of its slots), each
        at its own position: the last position's logits of each slot up to the highest, in float32."""
        hi = self.capacity if self.fixed_shapes else max(rows) + 1
        feed, positions = [], {}
        for slot in range(hi):
            held = rows.get(slot)
            if held is not None:
                token, positions[slot] = self._input(held, slot)
                feed.append(token)
            else:
                feed.append(self.pad)
        ids = torch.tensor([[t] for t in feed], dtype=torch.long, device=self.device)
        joining, self.joining = self.joining, {}
        position_ids, mask, sliding = self.cache.decode(positions, self.window, hi, self.fixed_shapes,
                                                        held=set(self.running))
        if sliding is not None:
            mask = {"full_attention": mask, "sliding_attention": sliding} if self.mapping else sliding
        try:
            with torch.no_grad():
                if self.encoder_decoder:
                    if joining:
                        self.cache.join({slot: state.shape[0] for slot, state in joining.items()})
                    sources = self.cache.source_mask(hi, self.fixed_shapes)
                    width, dtype = self.prefill.source_state
                    # the decoder reads the running rows' cached cross-attention keys, so their encoder output is
                    # only a shape; rows joining now have theirs, from which each layer writes their slots' keys
                    states = torch.zeros((1, 1, width), dtype=dtype, device=self.device).expand(
                        hi, sources.shape[1], width)
                    if joining:
                        states = states.contiguous()
                        for slot, state in joining.items():
                            states[slot, :state.shape[0]] = state
                    with self.positions.per_row(position_ids[:, 0].tolist()):
                        out = self.model(encoder_outputs=BaseModelOutput(last_hidden_state=states),
                                         attention_mask=sources, decoder_input_ids=ids, decoder_attention_mask=mask,
                                         use_cache=True, **{self.cache_name: self.cache.for_step()}, **self.keep)
                elif mask is None:  # no attention layer (a state-space model): no mask, no positions
                    out = self.model(input_ids=ids, use_cache=True, **{self.cache_name: self.cache}, **self.keep)
                else:
                    out = self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                                     **{self.cache_name: self.cache}, **self.keep)
        finally:
            self.cache.done()
        return out.logits[:, -1].to(dtype=torch.float32)

    def _choose(self, rows: dict, logits: torch.Tensor, tokens: dict, answers) -> None:
        """Each decoding row's token from the step's logits (`_forward`): the plain greedy rows' together, the others
        by their own rules (`_next`), a beam request's step once for its slots."""
        plain = [s for s, held in rows.items() if held.group is None and self._plain(held)]
        taken = {}
        if plain:  # one argmax and one finiteness check for every plain row (a row with a problem takes `_next`'s way)
            index = torch.tensor(plain, device=logits.device)
            scores = logits[index]
            fine = (~(torch.isnan(scores) | torch.isposinf(scores)).any(-1) & ~torch.isneginf(scores).all(-1)).tolist()
            taken = {s: t for s, t, ok in zip(plain, scores.argmax(-1).tolist(), fine) if ok}
        for held in dict.fromkeys(rows.values()):  # each row, a beam request once
            if held.group is not None:
                self._beam_step(held, logits[held.group.slots], answers)
            else:
                self._next(held, logits[held.slot], tokens, answers, taken.get(held.slot))

    def _next(self, row: _Row, logits: torch.Tensor, tokens: dict, answers, token: int | None = None,
              prompt_logprobs: list | None = None) -> None:
        """The row's next token from its logits, by its rules (`token`: already taken, where `_plain` allows); the
        row ends here if that ends it. `prompt_logprobs`: its prompt's, with its first token."""
        if self.record is not None:
            self.record.setdefault(row.spec.id, []).append(logits.clone())
        failed = reason = None
        try:
            if token is None:
                ids = torch.tensor([row.ids], dtype=torch.long, device=self.device)
                scores = row.rules(ids, row.processors(ids, logits[None]))
                failed = row.rules.failed.get(0)
                token = int(scores[0].argmax()) if failed is None else None
            if failed is None:
                # through the module: the tests' fault hook (tests/faults) replaces it for both engines; the row's
                # new tokens are listed only where a stop string needs its text (a copy a row a step, otherwise)
                reason = row_rules.row_end(row.spec, token, row.produced + 1, self.eos_set,
                                           lambda: self.tokenizer.decode([*row.new, token], skip_special_tokens=True))
        except Exception as e:  # noqa: BLE001 - a row's own rules failing is its failure (alike on every rank)
            failed = own_failure(e)
        if failed is not None:
            del self.running[row.slot]
            row.status = Status.FAILED
            answers.failed((row.spec.id,), *failed)
            return
        row.ids.append(token)
        tokens[row.spec.id] = RowOutput(
            token, row.produced,
            top_logprobs(logits[None], [token], row.spec.logprobs)[0] if row.spec.logprobs >= 0 else None,
            prompt_logprobs, reason or None)
        if reason:
            del self.running[row.slot]
            row.status = Status.FINISHED
            self.ended.append((row.spec.id, [row.new], [reason]))  # answered after the step's tokens (`step`)

    def _plain(self, row: _Row) -> bool:
        """Whether the row's next token is simply the highest logit: greedy, no processor of generate's, no rule that
        changes a greedy row's token (`sampling.changes_greedy`), nothing held back (its minimum reached); its scores
        are then checked and its token taken with every such row's at once, the same token `_next`'s rules would take
        (argmax of the same float32 logits)."""
        return (row.spec.temperature <= 0 and not row.processors and row.produced >= row.spec.min_tokens
                and not changes_greedy(row.spec) and self.record is None)

    def fail_running(self) -> list[int]:
        """A step that failed on every rank: its rows end (their ids returned, to be answered together)."""
        ids = list(dict.fromkeys(r.spec.id for r in self.running.values()))
        for row in self.running.values():
            row.status = Status.FAILED
        self.running.clear()
        self._release()  # what the failed step left in the cache goes with its rows
        return ids


class CrossProjection:
    """An encoder-decoder's cross-attention keys and values for rows that join running ones, projected at admission
    from their encoder output by each decoder layer's own key and value projections (T5's family: `k`, `v` of its
    `EncDecAttention`; BART's: `k_proj`, `v_proj` of its `encoder_attn`; the head width `key_value_proj_dim` or
    `head_dim`), as the layer's forward projects them; sharded projections give this rank's heads, as in the forward.
    The step that admits them is then a plain decoding step. Computed inside that step's forward instead (the
    fallback), every running row's stand-in went through the projections too: a step admitting one row beside 16
    took 9.1 ms against 4.8 for a plain step on the embedded T5 in one process, the encoder 2.2 of it (2026-12-05).
    `probe` checks the result against each row alone; where it differs the engine computes them in the forward."""

    NAMES = ("EncDecAttention", "encoder_attn")

    def __init__(self, layers: dict):
        self.layers = layers  # layer index -> (key projection, value projection, head width)

    @classmethod
    def of(cls, model) -> "CrossProjection | None":
        """The decoder's cross-attention projections, or None where a layer's are not found as above."""
        layers = {}
        for name, module in model.get_decoder().named_modules():
            if name.rsplit(".", 1)[-1] not in cls.NAMES:
                continue
            k, v = (next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.nn.Module)),
                         None) for names in (("k_proj", "k"), ("v_proj", "v")))
            width = getattr(module, "head_dim", None) or getattr(module, "key_value_proj_dim", None)
            index = getattr(module, "layer_idx", None)
            if k is None or v is None or not isinstance(width, int) or not isinstance(index, int) or index in layers:
                return None
            layers[index] = (k, v, width)
        return cls(layers) if layers else None

    def fits(self, layers: int) -> bool:
        """Whether it has one projection per cross-attention layer of the cache (0 .. layers - 1)."""
        return sorted(self.layers) == list(range(layers))

    def __call__(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values), `[rows, heads, source width, head width]`, from encoder output `[rows,
        source width, hidden]`."""
        out = []
        with torch.no_grad():
            for index in range(len(self.layers)):
                k, v, width = self.layers[index]
                shape = (*states.shape[:-1], -1, width)
                out.append((k(states).view(shape).transpose(1, 2), v(states).view(shape).transpose(1, 2)))
        return out


# The probe's bound on |logits - alone| / max |alone|, in fp32 (key True) and in half precision: rows decoded in one
# step sum in another order than alone. Measured (2026-12-05, tiny random GPT-2, T5, BART, Marian, rows fed the same
# tokens): right, at most 1.6e-6 in fp32, 0.0037 in fp16, 0.019 in bf16; a row given one shared position (the same
# models without `DecoderPositions`): 0.017-0.43 in fp32, 0.015-0.52 in half precision. So fp32 tells every error
# measured; half precision only those above its rounding (T5's relative bias on a tiny random model, 0.015, is not),
# which docs/serving.md says.
PROBE_TOLERANCE = {True: 1e-4, False: 3e-2}


class _Captured(Exception):
    pass


class DecoderPositions:
    """Per-row positions for a decoder that computes its positions from its cache's one length (an encoder-decoder's
    decoder takes no position ids): while a step runs (`per_row`), the decoder's position embedding module
    (`embed_positions`: BART's family, learned or sinusoidal) answers each row's own position, from a table of its
    own outputs (captured from one call over positions 0..n-1, whatever its signature or offset), and a relative
    position bias (`compute_bias`: T5's family) is computed for each row from its own position. The probe checks the
    result against each row run alone."""

    def __init__(self, model):
        self.decoder = model.get_decoder()
        self.embed = getattr(self.decoder, "embed_positions", None)
        # the token the table is read with: not the padding one, which a module that counts positions over the
        # tokens that are not padding (M2M100's and NLLB's sinusoidal embedding) gives no position at all (the table
        # read with padding was its padding row at every position: the probe refused M2M100, relative difference 1.1)
        pad = getattr(model.config, "pad_token_id", None)
        self.fill = 1 if pad == 0 else 0
        self.biases = [m for m in self.decoder.modules()
                       if getattr(m, "has_relative_attention_bias", False) and hasattr(m, "compute_bias")]
        self.table: torch.Tensor | None = None
        self.bias_tables: dict[int, torch.Tensor] = {}  # id(module) -> `_bias_table`

    def _table(self, n: int) -> torch.Tensor:
        """The position module's output for positions 0..n-1 (at least), `[n, dim]`: the decoder called on n tokens,
        stopped once the module has answered."""
        if self.table is None or self.table.shape[0] < n:
            size = max(n, 64, 2 * (0 if self.table is None else self.table.shape[0]))
            limit = getattr(self.embed, "num_embeddings", None)
            offset = getattr(self.embed, "offset", 0)
            if limit is not None:
                size = min(size, limit - offset)
            found = []

            def capture(module, args, output):
                found.append(output)
                raise _Captured

            weight = next(self.decoder.parameters())
            handle = self.embed.register_forward_hook(capture)
            try:
                with torch.no_grad():
                    self.decoder(input_ids=torch.full((1, size), self.fill, dtype=torch.long, device=weight.device),
                                 encoder_hidden_states=torch.zeros((1, 1, self.embed.embedding_dim),
                                                                   dtype=weight.dtype, device=weight.device))
            except _Captured:
                pass
            finally:
                handle.remove()
            self.table = found[0].reshape(-1, found[0].shape[-1])
        return self.table

    def _per_row_bias(self, module, positions: list[int]):
        """`module.compute_bias` for rows at their own `positions` (`[rows, heads, query, key]`): T5's computation
        (`relative position = key - (query + past)`, bucketed, embedded) where the module has its parts
        (`_relative_position_bucket`, `relative_attention_bias`), read from a table of the embedded bias of every
        relative position (`_bias_table`: the same bucket and embedding rows, gathered); else its own `compute_bias`
        a row at a time (16 calls took 1.8 of a 4 ms step of 16 rows on the embedded T5, 2026-12-05; the probe checks
        both)."""
        own = type(module).compute_bias.__get__(module)
        bucket = getattr(module, "_relative_position_bucket", None)
        embed = getattr(module, "relative_attention_bias", None)
        if bucket is None or not isinstance(embed, torch.nn.Embedding):
            def per_row_bias(query_length, key_length, device=None, past_seen_tokens=0):
                return torch.cat([own(query_length, key_length, device=device, past_seen_tokens=p)
                                  for p in positions])
            return per_row_bias

        def all_rows_bias(query_length, key_length, device=None, past_seen_tokens=0):
            table = self._bias_table(module, bucket, embed, max(key_length, query_length + max(positions)) + 1)
            at = table.device  # the relative positions index the table where it is
            past = torch.tensor(positions, dtype=torch.long, device=at)[:, None, None]
            context = torch.arange(query_length, dtype=torch.long, device=at)[None, :, None] + past
            memory = torch.arange(key_length, dtype=torch.long, device=at)[None, None, :]
            # [rows, query, key, heads] -> [rows, heads, query, key]
            bias = table[memory - context + (table.shape[0] // 2)].permute([0, 3, 1, 2])
            return bias if device is None else bias.to(device)
        return all_rows_bias

    def _bias_table(self, module, bucket, embed, reach: int) -> torch.Tensor:
        """`[2 R, heads]`: row R + d is the module's embedded bias of relative position d, for |d| < R (R >= `reach`):
        computing the buckets (a logarithm a key) and embedding them for every row at every step took ~10% of the
        embedded T5's decoding step; a gather of the same rows does not. Kept per module; weights do not change while
        serving."""
        found = self.bias_tables.get(id(module))
        if found is None or found.shape[0] // 2 < reach:
            half = max(reach, 256, 0 if found is None else found.shape[0])
            relative = torch.arange(-half, half, dtype=torch.long, device=embed.weight.device)
            with torch.no_grad():
                found = embed(bucket(relative, bidirectional=not module.is_decoder,
                                     num_buckets=module.relative_attention_num_buckets,
                                     max_distance=module.relative_attention_max_distance))
            self.bias_tables[id(module)] = found
        return found

    @contextlib.contextmanager
    def per_row(self, positions: list[int]):
        handle = None
        if self.embed is not None:
            rows = self._table(max(positions) + 1)[torch.tensor(positions, device=self.table.device)][:, None, :]
            handle = self.embed.register_forward_hook(lambda module, args, output: rows.to(output.dtype))
        for module in self.biases:
            module.compute_bias = self._per_row_bias(module, positions)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            for module in self.biases:
                del module.compute_bias


class Kept:
    """Answers kept in this process (the probe's, the benches'): each row's sequences and reasons by id; a row that
    fails raises, since nothing here expects one to."""

    def __init__(self):
        self.rows: dict[int, tuple[list[list[int]], list[str]]] = {}

    def tokens(self, rows):
        pass

    def finished(self, row, sequences, reasons):
        self.rows[row] = (sequences, reasons)

    def failed(self, rows, status, message, together=False):
        raise RuntimeError(f"rows {list(rows)} failed: {message}")


def choose(model, tokenizer, device, capacity: int, fuse: bool = False) -> tuple[str | None, dict]:
    """Whether the step engine serves this model ((None, its settings)) or why not ((the reason, {})): the probe,
    with joining rows' cross-attention projected at admission (`CrossProjection`) and, where that fails, computed in
    the step's forward. The same on every rank (the probe's logits are the sharded forward's, alike everywhere)."""
    why = probe(model, tokenizer, device, capacity, fuse_admissions=fuse)
    if why is None:
        return None, {"fuse_admissions": fuse} if fuse else {}
    if not getattr(model.config, "is_encoder_decoder", False):
        # admitted rows prefilled apart from the running rows' step; then prefilled padded, not packed
        if fuse and probe(model, tokenizer, device, capacity, fuse_admissions=False) is None:
            return None, {}
        if probe(model, tokenizer, device, capacity, pack_prefill=False) is None:
            return None, {"pack_prefill": False}
    elif CrossProjection.of(model) is not None:
        if probe(model, tokenizer, device, capacity, project_cross=False) is None:
            return None, {"project_cross": False}
    return why, {}


def probe(model, tokenizer, device, capacity: int = 4, project_cross: bool = True,
          pack_prefill: bool = True, fuse_admissions: bool = False) -> str | None:
    """Why this model cannot be served by the step engine (None: it can). Five rows of different lengths, admitted
    two together into the empty engine (prefilled packed, `pack_prefill`), then one and then two together while
    others run (in the running rows' step, `fuse_admissions`), must each give the logits of that row run alone (the
    plain forward at batch 1 with transformers' own cache, as generate runs it), step for step, within rounding: a
    model whose attention does not follow per-row positions and a 4D mask (a relative bias or ALiBi computed from one
    shared position or a 2D mask...) differs by far more. Run on every rank alike (its forward is sharded)."""
    vocab = min(int(text_config(model.config).vocab_size), len(tokenizer))
    # lengths far apart, and the third row joining 6 steps after the others: a row given another's position differs
    # the most (limited to the model's positions: 64 and more for every model we ship)
    prompts = [[(7 * i + 3) % vocab for i in range(24)], [(5 * i + 11) % vocab for i in range(3)],
               [(3 * i + 5) % vocab for i in range(12)], [(11 * i + 2) % vocab for i in range(7)],
               [(13 * i + 7) % vocab for i in range(9)]]
    # its own engine, with a slot for each of its rows whatever the served capacity (--max_batch_size 1 left the
    # probe no slot for its second row: "KeyError: 1", and the model went to the batch engine)
    engine = StepEngine(model, tokenizer, device, max(capacity, len(prompts)), project_cross=project_cross,
                        pack_prefill=pack_prefill, fuse_admissions=fuse_admissions)
    engine.record = {}

    answers, key = Kept(), BatchKey()
    try:
        # two rows admitted together into the empty engine (prefilled packed, or padded: a right-padded prefill is
        # generate's own, checked against rows alone in fp32 by tests/test_serve_steps.py; a packed one must keep
        # each row to its own positions and past), then one while they run, then two together (prefilled in the
        # running rows' step, `StepEngine._fused`, where the engine fuses). The first two end (5 and 3 tokens)
        # before the last two join, which take their slots, below a row that runs on: slots of rows admitted in a
        # step, under that step's highest (a state there is overwritten by the step unless put back,
        # `slots.SlotStateLayer`)
        engine.take(Admit(0, key, (RowSpec(tuple(prompts[0]), 5, ignore_eos=True, id=0),
                                   RowSpec(tuple(prompts[4]), 3, ignore_eos=True, id=4))))
        engine.step(answers)
        engine.take(Admit(1, key, (RowSpec(tuple(prompts[1]), 10, ignore_eos=True, id=1),)))
        for _ in range(5):
            engine.step(answers)
        engine.take(Admit(2, key, (RowSpec(tuple(prompts[2]), 6, ignore_eos=True, id=2),
                                   RowSpec(tuple(prompts[3]), 5, ignore_eos=True, id=3))))
        for _ in range(12):
            if not engine.busy():
                break
            engine.step(answers)
        worst = 0.0
        for i, prompt in enumerate(prompts):
            want = _alone(model, engine, prompt, answers.rows[i][0][0])
            got = torch.stack(engine.record[i])
            if got.shape != want.shape:
                return f"the probe's row {i} gave {got.shape[0]} steps, alone {want.shape[0]}"
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp(min=1.0)))
        tolerance = PROBE_TOLERANCE[model.dtype == torch.float32]
        if not worst <= tolerance:
            return (f"rows in one step do not give their single-row logits (relative difference {worst:.2g} at "
                    f"most, against {tolerance:g}): its attention or states do not follow per-row positions, masks "
                    f"and slots")
    except NotPerRow as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure: the batch engine serves it
        return f"the probe failed: {type(e).__name__}: {first_line(e)}"[:300]
    return None


def _alone(model, engine: StepEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """A prompt's logits alone, through the plain forward and transformers' own cache, fed the tokens the step engine
    chose (so that a near tie decided otherwise in half precision does not make the rows diverge): one per token."""
    ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
    found = []
    with torch.no_grad():
        if engine.encoder_decoder:
            encoded = model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
            cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
            start = model.generation_config.decoder_start_token_id
            if start is None:
                start = model.config.decoder_start_token_id
            decoded = torch.tensor([[start, *tokens]], dtype=torch.long, device=engine.device)
            for n in range(len(tokens)):
                out = model(encoder_outputs=encoded, attention_mask=torch.ones_like(ids), use_cache=True,
                            decoder_input_ids=decoded[:, n:n + 1], **{engine.cache_name: cache})
                found.append(out.logits[0, -1].to(dtype=torch.float32))
            return torch.stack(found)
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[*prompt, *tokens]], dtype=torch.long, device=engine.device)
        done = 0
        for n in range(len(prompt), len(prompt) + len(tokens)):
            # a state-space model decodes as generate runs it: no mask once its states exist (Mamba's layers multiply
            # their input by a 2D mask as it is)
            mask = {} if engine.states and done else {"attention_mask": torch.ones_like(ids[:, :n])}
            out = model(input_ids=ids[:, done:n], position_ids=torch.arange(done, n, device=engine.device)[None],
                        use_cache=True, **mask, **{engine.cache_name: cache}, **engine.keep)
            done = n
            found.append(out.logits[0, -1].to(dtype=torch.float32))
    return torch.stack(found)
