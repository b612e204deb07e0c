"""`ds-inference policy check`: shard a local model over N ranks it starts itself and compare it with
the unsharded model in the same run: logits, per-layer hidden states, greedy, beam-search and seeded
sampling token ids, and the parameter bytes each rank holds.

Exit 0 only if every check passes. The check runs in the dtype the run will use (`--dtype`, default the
checkpoint's). fp32: max |logit difference| <= 1e-4 x max(1, max |logit|), token ids identical. fp16/bf16: every
difference judged against the unsharded model's own rounding noise (`rounding.py`): partings at near-ties pass and
are reported, a difference beyond rounding fails naming the first layer beyond its bound.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import types
from pathlib import Path

from ..load.own_code import from_pretrained
from ..policy.configs import text_config
from ..run.files import write_text_atomic
from ..run.ranks import failure_text, start_ranks, wait_ranks

LOGIT_RTOL = 1e-4
NEW_TOKENS = 8
DERIVATIONS: dict[str, list] = {}  # a rank's derived policies' verdicts, by model (`policy/derive/verdicts.py`)


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a checkpoint's config records ("dtype", or transformers 4's "torch_dtype"), as fp32/fp16/bf16;
    fp32 where it records none."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    recorded = str(data.get("dtype") or data.get("torch_dtype") or "float32")
    return {"float16": "fp16", "bfloat16": "bf16"}.get(recorded, "fp32")


def run_check(model_dirs: list[str], tp_size: int, policy: str = "auto", timeout: float = 300,
              json_path: str | None = None, dtype: str = "auto", reduce_dtype: str = "model",
              trust_remote_code: bool = False) -> int:
    """Start `tp_size` ranks, run the checks, print one line per check and a summary; never hangs. A check
    passes only if it passes on every rank; the temporary directory (pre-sharded copies) is removed.
    `json_path`: also write the merged results there (what the tests read; see `merge_rank_results`).
    `trust_remote_code`: run the code a model directory ships (`load/own_code.py`); without it such a directory is
    refused in one line before any rank starts."""
    from ..load.own_code import check_trust

    for d in model_dirs:
        if not (Path(d) / "config.json").is_file():
            print(f"error: {d} is not a model directory (no config.json)", file=sys.stderr)
            return 2
        check_trust(d, trust_remote_code)
    dtypes = [checkpoint_dtype(d) if dtype == "auto" else dtype for d in model_dirs]
    if "fp16" in dtypes and not _has_gpu():
        which = "--dtype fp16" if dtype == "fp16" else f"{model_dirs[dtypes.index('fp16')]} is float16 (its config)"
        print(f"error: {which}: DeepSpeed's CPU accelerator supports fp32 and bf16 only; check on a GPU, or pass "
              "--dtype bf16 or --dtype fp32", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ds_inference_check_") as out:
        settings = json.dumps({"dtype": dtype, "reduce_dtype": reduce_dtype, "trust": bool(trust_remote_code)})
        procs = start_ranks(tp_size, "ds_inference_integration.tools.policy_check",
                            ["--worker", out, policy, settings, *model_dirs], log_dir=out)
        codes = wait_ranks(procs, timeout)
        reports = [json.loads(p.read_text()) if p.is_file() else None
                   for p in (Path(out, f"result-{r}.json") for r in range(tp_size))]
        failure = None if all(c == 0 for c in codes) else failure_text(procs, codes)
    checks = merge_rank_results(reports)
    passed, total = sum(c["passed"] for c in checks), len(checks)
    skipped = sum(c["skipped"] for c in checks)
    # each derived policy's mechanisms and their verdicts (`policy/derive/verdicts.py`), before its model's checks
    from ..policy.derive.verdicts import table

    derivations = next((r.get("derivations", {}) for r in reports if r), {})
    shown = set()
    for c in checks:
        if c.get("model") in derivations and c["model"] not in shown:
            shown.add(c["model"])
            print(f"derived policy of {c['model']}, each mechanism's verdict:")
            for line in table(derivations[c["model"]]):
                print(f"  {line}")
        print(("PASS " if c["passed"] else "SKIP " if c["skipped"] else "FAIL ") + c["line"])
    ok = passed + skipped == total and failure is None and all(r is not None for r in reports)
    if failure is not None:
        print(f"FAIL rank processes ({failure})")
    shown = ", ".join(sorted(set(dtypes)))
    said = f", {skipped} skipped (the unsharded model cannot do them)" if skipped else ""
    print(f"{'PASS' if ok else 'FAIL'}: {passed} of {total} checks passed{said} ({len(model_dirs)} model(s), "
          f"tp {tp_size}, {shown})")
    if json_path:
        write_text_atomic(Path(json_path), json.dumps(
            {"ok": ok, "tp_size": tp_size, "dtypes": dtypes, "models": [Path(d).name for d in model_dirs], "passed": passed,
             "skipped": skipped, "total": total, "rank_failure": failure, "checks": checks,
             "derivations": derivations}, indent=1) + "\n")
    return 0 if ok else 1


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def merge_rank_results(reports: list[dict | None]) -> list[dict]:
    """One record per check from every rank's own results: passed only where every rank passed; a failed
    check's line is the first failing rank's, and `failed_ranks` names them; a rank with no results, or
    fewer, fails the check. Each record: model, tp, check (its kind: logits, hidden_states, greedy, beam,
    sample, weights_per_rank, loading_shard-aware, loading_pre-sharded, setup, error), passed, line (the
    human-readable text), failed_ranks, data (the check's figures, from the first failing rank or rank 0), skipped
    (every rank skipped it: the unsharded model cannot do it; neither passed nor failed)."""
    longest = max((len(r["checks"]) for r in reports if r), default=0)
    merged = []
    for i in range(longest):
        seen = [(rank, r["checks"][i] if r and i < len(r["checks"]) else None) for rank, r in enumerate(reports)]
        failing = [rank for rank, c in seen if c is None or not (c["passed"] or c.get("skipped"))]
        shown = next((c for _, c in seen if c is not None and (not failing or not c["passed"])), None)
        record = dict(shown) if shown else {"model": None, "tp": len(reports), "check": "missing", "passed": False,
                                            "line": "(no result)", "data": {}}
        record["skipped"] = not failing and all(c.get("skipped") for _, c in seen)
        record["passed"] = not failing and not record["skipped"]
        record["failed_ranks"] = failing
        if failing and len(reports) > 1:
            record["line"] += f" [on rank {', '.join(map(str, failing))} of {len(reports)}]"
        merged.append(record)
    missing = [rank for rank, r in enumerate(reports) if r is None]
    if missing:
        merged.append({"model": None, "tp": len(reports), "check": "results", "passed": False, "skipped": False,
                       "failed_ranks": missing, "line": f"ranks {missing} wrote no results", "data": {}})
    return merged


# Worker side ---------------------------------------------------------------------------------------

def check_record(model: str, tp: int, kind: str, ok: bool, text: str, **data) -> dict:
    """One check's result on one rank: the human line (`MODEL tpN TEXT`) and its figures, JSON-ready."""
    return {"model": model, "tp": tp, "check": kind, "passed": bool(ok), "line": f"{model} tp{tp} {text}",
            "data": data}


def _pad_id(config) -> int:
    """The pad token id, as `generate` settles it for a config without one (CodeGen's have no pad_token_id
    attribute at all in transformers 5): the first eos token id, else 0."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        eos = getattr(config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) if eos is not None else 0
    return int(pad)


def _inputs(config, torch, audio: str | None = None, model=None):
    """Three prompts of different lengths; decoder-only prompts are left-padded. A model that cannot generate
    without audio (`verify.audio_driven_input`: a speech encoder's, or audio that goes with the tokens) gets three
    random audio inputs of the shape it reads (`verify.random_speech_inputs`), with the prompts where its audio is
    added to them position by position (`verify.with_aligned_tokens`)."""
    from ..policy.verify import random_speech_inputs, with_aligned_tokens

    ids = _prompts(config, torch, torch.Generator().manual_seed(0))
    if audio is not None:
        g = torch.Generator().manual_seed(0)
        found = random_speech_inputs(config, audio, 3, g, new_tokens=NEW_TOKENS, prompt=ids["input_ids"].shape[1])
        return found if model is None else with_aligned_tokens(model, found, ids["input_ids"], ids["attention_mask"])
    return ids


def _prompts(config, torch, g, lengths=(7, 4, 10)):
    # a composite config (Gemma 3, Voxtral, Fuyu) keeps the vocabulary in its text config
    vocab = getattr(config, "vocab_size", None) or text_config(config).vocab_size
    pad = _pad_id(config)
    width = max(lengths)
    ids = torch.full((3, width), pad, dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, n in enumerate(lengths):
        tokens = torch.randint(3, vocab, (n,), generator=g)
        if config.is_encoder_decoder:
            ids[row, :n], mask[row, :n] = tokens, 1
        else:
            ids[row, width - n:], mask[row, width - n:] = tokens, 1
    return {"input_ids": ids, "attention_mask": mask}


def _forward(model, inputs, torch) -> dict:
    """Teacher-forced logits and every hidden state (float), and how many of those are the encoder's. A model whose
    audio goes with its tokens as it generates (`verify.audio_driven_input`, main input token ids: Kyutai's forward
    reads codec codes its generate makes, Voxtral-realtime's as many audio frames as tokens) is read at generate's
    first step: the logits of the next token and the hidden states of the prompt."""
    from ..policy.verify import SPEECH_INPUTS, audio_driven_input, main_input_name

    if audio_driven_input(model) is not None and main_input_name(model) not in SPEECH_INPUTS:
        return _first_step(model, inputs, torch)
    layers: list = []
    with torch.no_grad(), _reading_layers(model, layers):
        kwargs = dict(inputs, output_hidden_states=True)
        if model.config.is_encoder_decoder:
            batch = next(iter(inputs.values())).shape[0]
            kwargs["decoder_input_ids"] = torch.zeros((batch, 1), dtype=torch.long) + _decoder_start(model)
        out = model(**kwargs)
    return _outputs(model, out, layers)


@contextlib.contextmanager
def _reading_layers(model, into: list):
    """While open, each outermost layer's output (its first tensor) is added to `into` as it is computed: the hidden
    states of a model whose forward returns none (the original phi-1.5 code ignores `output_hidden_states`: "the
    unsharded model fails" here before, on the None it gave)."""
    from torch import nn

    from ..policy.schema import outermost_layer_classes
    from ..policy.verify import _first_tensor

    names = outermost_layer_classes(model)
    handles = [layer.register_forward_hook(lambda module, args, out: into.append(_first_tensor(out).detach()))
               for lst in model.modules() if isinstance(lst, nn.ModuleList) for layer in lst
               if type(layer).__name__ in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _first_step(model, inputs, torch) -> dict:
    with torch.no_grad():
        out = _generate_with(model, inputs, max_new_tokens=1, do_sample=False, num_beams=1,
                             pad_token_id=_pad_id(model.config), return_dict_in_generate=True, output_logits=True,
                             output_hidden_states=True)
    first = (out.decoder_hidden_states if model.config.is_encoder_decoder else out.hidden_states)[0]
    return _outputs(model, types.SimpleNamespace(  # as a forward's output
        logits=out.logits[0][:, None], encoder_hidden_states=getattr(out, "encoder_hidden_states", None),
        decoder_hidden_states=first, hidden_states=first))


def _outputs(model, out, layers: list | None = None) -> dict:
    encoder = list(out.encoder_hidden_states or []) if model.config.is_encoder_decoder else []
    hidden = encoder + list(out.decoder_hidden_states or []) if model.config.is_encoder_decoder else list(
        getattr(out, "hidden_states", None) or [])
    if not hidden and layers:  # a forward that returns none: each layer's output, as the hooks read it
        return {"logits": out.logits.float(), "hidden": [h.float() for h in layers], "encoder_states": 0,
                "from_layers": True}
    # an entry can itself be a tuple (Pegasus-X: each encoder layer's token and global-token states)
    flat = [t for h in hidden for t in (h if isinstance(h, (tuple, list)) else (h,))]
    return {"logits": out.logits.float(), "hidden": [h.float() for h in flat],
            "encoder_states": len(encoder) if len(flat) == len(hidden) else 0}


def _decoder_start(model) -> int:
    """The decoder's start token as `generate` finds it: the generation config's, the config's, its decoder's
    (SpeechEncoderDecoder's and T5Gemma 2's configs have none of their own), else 0."""
    for holder in (model.generation_config, model.config, getattr(model.config, "decoder", None)):
        value = getattr(holder, "decoder_start_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _generate_with(model, inputs: dict, **settings):
    """`model.generate` with `settings` on a copy of the model's generation config: Pop2Piano's generate updates the
    config it is given with the call's settings, its own where it is given none (a first call's
    `return_dict_in_generate` made every later call's output a dict)."""
    import copy

    config = copy.deepcopy(model.generation_config)
    rest = config.update(**settings)  # what is not a generation setting goes to generate as it is
    return model.generate(**inputs, generation_config=config, **rest)


def _generate(model, inputs, torch, steps: bool, **settings):
    """Token ids; with `steps`, also each row's logits at each new token, on that row's own prefix (for beam
    search, the beam its final sequence came through), as `rounding.token_verdict` reads them."""
    if not steps:
        return _generate_with(model, inputs, **settings)
    out = _generate_with(model, inputs, return_dict_in_generate=True, output_logits=True,
                         output_scores=settings.get("num_beams", 1) > 1, **settings)
    logits = torch.stack([step.float() for step in out.logits], 1)  # [rows (x beams), new tokens, vocab]
    # one row per beam, to be followed through `beam_indices`; Whisper's generate gives the final sequences' own rows
    if getattr(out, "beam_indices", None) is not None and logits.shape[0] != out.sequences.shape[0]:
        beams = out.beam_indices[:, :logits.shape[1]].long().clamp(min=0)
        logits = logits[beams, torch.arange(logits.shape[1])]
    return {"ids": out.sequences, "steps": logits}


MODES = ("greedy", "beam", "sample")
SKIPPABLE = ("beam", "sample")  # greedy is not: the loading checks compare greedy ids


def _run_model(model, inputs, torch, steps: bool = False, reference: bool = False, skip=()) -> dict:
    """Logits, hidden states and the three generations. The unsharded model (`reference`) may be unable to beam
    search or sample (RWKV's and xLSTM's cache cannot be reordered): the mode is recorded in `unable` with the
    model's reason, and the sharded model is not asked it (`skip`)."""
    pad = _pad_id(model.config)
    gen = dict(max_new_tokens=NEW_TOKENS, pad_token_id=pad)
    settings = {"greedy": dict(do_sample=False, num_beams=1), "beam": dict(do_sample=False, num_beams=3),
                "sample": dict(do_sample=True, top_k=0, top_p=1.0)}
    found = _forward(model, inputs, torch)
    found["unable"] = {}
    with torch.no_grad():
        for mode in MODES:
            if mode in skip:
                continue
            if mode == "sample":
                torch.manual_seed(1234)
            try:
                found[mode] = _generate(model, inputs, torch, steps, **settings[mode], **gen)
            except Exception as e:
                if not reference or mode not in SKIPPABLE:
                    raise
                from ..errors import first_line

                found["unable"][mode] = f"{type(e).__name__}: {first_line(e)}"
    return found


def _noise_floor(exact: dict, want: dict, steps_max: float) -> dict:
    """The unsharded half-precision model's own rounding on these inputs: its distance from the same model computed
    in fp32 (`exact`), RMS per hidden state and for the logits, and the largest for the logits, on the check's
    inputs and along its own generations (`steps_max`)."""
    from .rounding import max_diff, rms_diff

    return {"exact": exact, "logits_rms": rms_diff(want["logits"], exact["logits"]),
            "logits_max": max(max_diff(want["logits"], exact["logits"]), steps_max),
            "hidden_rms": [rms_diff(a, b) for a, b in zip(want["hidden"], exact["hidden"])]}


def _generation_noise(model, wide_model, inputs, wide_inputs, want: dict, torch) -> float:
    """The largest logit distance between the half-precision model and the fp32 one, both teacher-forced along the
    half-precision model's own generated sequences (greedy, beam, sample), at the positions that chose a new token;
    0 where a model does not take such a pass (the check's own logits then set the bound)."""
    worst = 0.0
    for mode in [m for m in MODES if m in want]:
        ids = want[mode]["ids"]
        new = want[mode]["steps"].shape[1]
        try:
            with torch.no_grad():
                found = []
                for m, given in ((model, inputs), (wide_model, wide_inputs)):
                    if m.config.is_encoder_decoder:
                        logits = m(**given, decoder_input_ids=ids[:, :-1]).logits[:, -new:]
                    else:
                        mask = torch.cat([given["attention_mask"], torch.ones_like(ids[:, given["input_ids"].shape[1]:])], 1)
                        logits = m(input_ids=ids, attention_mask=mask).logits[:, -new - 1:-1]
                    found.append(logits.float())
        except Exception:  # a model this pass does not fit: the bound falls back to the check's own logits
            continue
        if found[0].shape == found[1].shape:
            worst = max(worst, (found[0] - found[1]).abs().max().item())
    return worst


def _from_first_rank(compute, topology, groups):
    """`compute()` on the first rank of the TP group, its result sent to the group's other ranks, which would compute
    the same. `compute` must not raise: its peers wait in the broadcast; it returns its failure instead."""
    import torch.distributed as dist

    box = [None]
    first = dist.get_global_rank(groups.tp, 0)
    if topology.rank == first:
        box[0] = compute()
    if topology.tp_size > 1:
        dist.broadcast_object_list(box, src=first, group=groups.tp)
    return box[0]


def _reference(cls, model_dir, inputs, topology, groups, torch, dtype=None, unpadded: dict | None = None,
               trust: bool = False) -> dict:
    """The unsharded model's outputs, computed by the first rank of the TP group and sent to its peers: every
    rank would compute the same thing (same weights, same inputs, seeded sampling), and on CPU ranks that share
    the cores this was tp times the work (the tp-4 matrix of the tests took 70 s with it on every rank). Where the
    unsharded model fails on the padded prompts and `unpadded` (prompts of one length) are given, on those, the
    failure kept in "unpadded" (Dory's own forward fails on a padded batch with its cache: "unsharded model
    fails" in `policy sweep`, 2026-12-07, though it generates from prompts of one length)."""
    def compute() -> dict:
        try:
            half = (dtype or torch.float32) != torch.float32
            model = from_pretrained(cls, model_dir, trust, dtype=dtype or torch.float32).eval()
            given = inputs
            try:
                found = _run_model(model, inputs, torch, steps=half, reference=True)
            except Exception as e:  # noqa: BLE001 (any failure on padding: tried once more without)
                if unpadded is None:
                    raise
                from ..errors import first_line

                given = unpadded
                found = _run_model(model, given, torch, steps=half, reference=True)
                found["unpadded"] = f"{type(e).__name__}: {first_line(e)}"
            if half:
                wide = {k: v.float() if v.is_floating_point() else v for k, v in given.items()}
                wide_model = from_pretrained(cls, model_dir, trust, dtype=torch.float32).eval()
                exact = _forward(wide_model, wide, torch)
                steps = _generation_noise(model, wide_model, given, wide, found, torch)
                found["floor"] = _noise_floor(exact, found, steps)
                from .rounding import hidden_state_names

                found["names"] = hidden_state_names(model, found["encoder_states"], len(found["hidden"]))
            return found
        except Exception as e:  # its peers wait in the broadcast: send them the failure, not nothing
            from ..errors import first_line

            return {"error": f"{type(e).__name__}: {first_line(e)}"}

    found = _from_first_rank(compute, topology, groups)
    if "error" in found:
        raise ReferenceFailed(f"the unsharded model fails before any sharding ({found['error']})")
    return found


class ShardedForwardFailed(Exception):
    """The sharded model fails on the check's inputs. Every rank runs the same code on the same inputs, so the
    ranks fail alike (a shape that does not fit, a head count the attention checks): each records the failure,
    they meet at a barrier of the TP group (bounded by its timeout), and the check goes on with the next model."""


class ReferenceFailed(Exception):
    """The unsharded model itself fails on the check's inputs: on every rank alike, so the check goes on with the
    next model."""


def _run_model_naming_failures(model, inputs, torch, steps: bool = False, skip=()) -> dict:
    """`_run_model`, but an exception of any type the model raises names the module it happened in (the
    innermost one, `verify_policy.track_modules`)."""
    from ..errors import first_line, sharding_failure
    from ..policy.verify import track_modules

    inside = track_modules(model)
    try:
        with inside:
            return _run_model(model, inputs, torch, steps, skip=skip)
    except Exception as e:
        if not sharding_failure(e):
            raise
        raise ShardedForwardFailed(f"sharded forward failed in {inside.where()}: {type(e).__name__}: "
                                   f"{first_line(e)}") from None


def _policy_name(policy) -> str:
    """How the report names the policy: a shipped file's name, "derived", "autotp", or the file's path."""
    from ..policy.derive import is_derived
    from ..policy.schema import POLICY_DIR

    if policy is None:
        return "autotp"
    if is_derived(policy):
        return "derived"
    if policy.source.resolve().parent == POLICY_DIR.resolve():
        return f"shipped {policy.source.name}"
    return str(policy.source)


def _check_one(model_dir: str, policy_spec: str, topology, groups, records: list[dict],
               work_dir: Path | None = None, dtype_spec: str = "auto", reduce_dtype: str = "model",
               trust: bool = False) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    from ..arguments import DeepSpeedInferenceArguments
    from ..errors import InferenceSetupError
    from ..load.own_code import load_config, own_model_class
    from ..load.skeleton import check_generates_text, model_class_for
    from ..policy.derive import is_derived, policy_for_model
    from ..policy.schema import check_head_counts, resolve_policy
    from ..policy.verify import audio_driven_input
    from ..shard.inject import shard_model
    from ..shard.weight_share import TOLERANCE
    from .rounding import DTYPES, HALF

    name = Path(model_dir).name
    dtype = DTYPES[checkpoint_dtype(model_dir) if dtype_spec == "auto" else dtype_spec]
    half = dtype in HALF
    try:  # before any collective, every rank alike: a model that does not load is this model's one line
        config = load_config(model_dir, trust)
        cls = model_class_for(config, trust)
        own = own_model_class(cls, config, trust)  # the model's own class, where it ships its code
        if own is not None or type(config) in cls._model_mapping:  # one that generates no text by itself: refused
            check_generates_text(config, own or cls._model_mapping[type(config)], name)  # before it loads
        model = from_pretrained(cls, model_dir, trust, dtype=dtype).eval()
    except InferenceSetupError:
        raise
    except Exception as e:  # noqa: BLE001 (Emu3's and Mllama's text configs: no Auto class builds them)
        from ..errors import first_line

        raise InferenceSetupError(f"{name}: transformers does not load it as a generating model "
                                  f"({type(e).__name__}: {first_line(e)[:200]})") from None
    # first: no known probe input is refused before any work
    inputs = _inputs(config, torch, audio_driven_input(model), model)
    # audio features in the model's dtype, as a feature extractor's output is cast for a half-precision model
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    policy = resolve_policy(policy_spec, config)
    check_head_counts(policy, config, topology.tp_size)
    mask = inputs.get("attention_mask")
    unpadded = None  # prompts of one length, where the unsharded model fails on padded ones
    if mask is not None and not bool(mask.all()) and "input_ids" in inputs and len(inputs) == 2:
        unpadded = _prompts(config, torch, torch.Generator().manual_seed(0), lengths=(7, 7, 7))
    want = _reference(cls, model_dir, inputs, topology, groups, torch, dtype, unpadded, trust)
    if "unpadded" in want:
        inputs = unpadded
    args = DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=topology.tp_size, reduce_dtype=reduce_dtype)
    # a derived policy: the check predict, the server and `ds-inference shard` run on it before using it (each layer
    # against its unsharded copy) runs here too, a refusal this model's setup FAIL, ~0.1 s a model. Not run, it
    # refused ten right derived policies (T5's, MPT's, BigBird's...) unseen by the matrix until 2026-12-07. A file or
    # autotp is left to this command's own comparisons below, finer (a wrong file's failing module by name)
    policy = policy_for_model(policy, model, topology.tp_size)
    if is_derived(policy):
        DERIVATIONS[name] = [list(row) for row in policy.verdicts]
    model, report = shard_model(model, args, topology, groups, policy, dtype, verify=is_derived(policy))
    policy = report.policy_object
    unable = want["unable"]
    got = _run_model_naming_failures(model, inputs, torch, steps=half, skip=unable)

    passed = total = 0

    def check(ok: bool, kind: str, text: str, **data) -> None:
        nonlocal passed, total
        total += 1
        passed += bool(ok)
        if kind == "logits" and "unpadded" in want:  # said once, on the first line of the model's checks
            text += (f"; on prompts of one length: the unsharded model fails on left-padded ones "
                     f"({want['unpadded'][:160]})")
            data["unpadded"] = want["unpadded"]
        records.append(check_record(name, topology.tp_size, kind, ok, text, **data))

    agree = {}  # every rank of the group generated the same ids (a split can be right on one rank only)
    for mode in [m for m in MODES if m not in unable]:
        a = got[mode]["ids"] if half else got[mode]
        peers = [torch.empty_like(a) for _ in range(topology.tp_size)]
        dist.all_gather(peers, a.contiguous(), group=groups.tp)
        agree[mode] = all(torch.equal(p, a) for p in peers)

    def check_tokens(ok: bool, mode: str, text: str, **data) -> None:
        nonlocal total
        if mode in unable:  # said, neither passed nor failed: the unsharded model cannot do it
            total += 1
            records.append(check_record(name, topology.tp_size, mode, False, f"{mode} token ids: skipped, the "
                                        f"unsharded model cannot do it ({unable[mode]})", reason=unable[mode])
                           | {"skipped": True})
            return
        check(ok and agree[mode], mode, text + ("" if agree[mode] else "; ranks of the TP group disagree"),
              ranks_agree=agree[mode], **data)

    if half:
        _half_precision_checks(got, want, dtype, check, check_tokens)
    else:
        exact = _fp64_reference(got, want, cls, model_dir, inputs, topology, groups, torch, trust)
        _fp32_checks(got, want, check, check_tokens, torch, exact)

    share = report.weight_share  # what shard_model measured against the policy's target (shard/weight_share.py)
    mine = torch.tensor([share.held, share.full, round(share.target_elements)], dtype=torch.long)
    every = [torch.zeros_like(mine) for _ in range(topology.tp_size)]
    dist.all_gather(every, mine, group=groups.tp)
    shares = [int(e[0]) / max(int(e[1]), 1) for e in every]
    target = max(int(e[2]) / max(int(e[1]), 1) for e in every)
    whole = "; ".join(f"{p} ({why})" for p, why in sorted(share.by_design.items()))
    kept = f" (whole by design, counted in the target: {whole})" if whole else ""
    unplanned = f"; held whole and not placed: {', '.join(share.not_placed)}" if share.not_placed else ""
    check(all(abs(s - target) <= TOLERANCE * target for s in shares), "weights_per_rank",
          f"layer weights per rank: {', '.join(f'{s:.1%}' for s in shares)} of {share.full} elements "
          f"(target {target:.1%}, tolerance {TOLERANCE:.0%}){kept}{unplanned}",
          shares=shares, target=target, full_elements=share.full, kv_replicated=bool(report.replicated_kv),
          by_design=share.by_design, not_placed=share.not_placed, model_type=config.model_type,
          policy=_policy_name(policy))
    if work_dir is not None:
        greedy = got["greedy"]["ids"] if half else got["greedy"]
        for ok, kind, text, data in _check_loading(model_dir, cls, config, model, greedy, inputs, args, topology,
                                                   groups, resolve_policy(policy_spec, config), work_dir, dtype,
                                                   trust):
            check(ok, kind, text, **data)
    return passed, total


def _beyond_fixed_tolerance(got: dict, want: dict) -> list[bool]:
    """[logits, then each hidden state]: whether the sharded model's is beyond LOGIT_RTOL of the unsharded one's."""
    return [(a.shape != b.shape) or (a - b).abs().max().item() > LOGIT_RTOL * max(1.0, b.abs().max().item())
            for a, b in zip([got["logits"], *got["hidden"]], [want["logits"], *want["hidden"]])]


def _fp64_reference(got: dict, want: dict, cls, model_dir, inputs, topology, groups, torch, trust: bool = False
                    ) -> dict | None:
    """Where the fp32 logits or a hidden state are beyond LOGIT_RTOL (on any rank of the group): the unsharded model
    computed in fp64 on the same inputs, by the group's first rank and sent to its peers, for `_fp32_checks` to judge
    against the model's own fp32 rounding, as the half-precision check judges against fp32 (`rounding.py`). A
    recurrent model repeats its rounding: HRM (2 x 3 cycles of its layers) is 6.5e-3 from fp64 in one process, and
    sharded 6.2e-3 from one process, against a fixed tolerance of 7.7e-4 (its tokens identical; `policy sweep`,
    2026-12-06). None where the fixed tolerance holds (the fp64 copy, twice the model's memory, is not made)."""
    import torch.distributed as dist

    beyond = torch.tensor([float(any(_beyond_fixed_tolerance(got, want)))])
    if topology.tp_size > 1:
        dist.all_reduce(beyond, op=dist.ReduceOp.MAX, group=groups.tp)
    if not beyond.item():
        return None

    def compute() -> dict:
        try:
            wide = from_pretrained(cls, model_dir, trust, dtype=torch.float64).eval()
            return _forward(wide, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}, torch)
        except Exception:  # noqa: BLE001 (a model with no fp64 path: the fixed tolerance decides)
            return {}

    return _from_first_rank(compute, topology, groups) or None


def _fp32_checks(got: dict, want: dict, check, check_tokens, torch, exact: dict | None = None) -> None:
    """Logits and hidden states within LOGIT_RTOL of the unsharded model's; where not, and `exact` (the fp64
    outputs, `_fp64_reference`) is given, within the unsharded fp32 model's own distance from fp64 (FACTOR x it, RMS,
    as `rounding.py` judges half precision against fp32). Token ids identical."""
    from .rounding import FACTOR, first_beyond, rms_bound, rms_diff

    scale = max(1.0, want["logits"].abs().max().item())
    diff = (got["logits"] - want["logits"]).abs().max().item()
    fixed = _beyond_fixed_tolerance(got, want)
    if fixed[0] and exact is not None:
        noise, distance = rms_diff(want["logits"], exact["logits"]), rms_diff(got["logits"], exact["logits"])
        limit = rms_bound(noise, exact["logits"], torch.float32)
        check(distance <= limit, "logits", f"logits: max |diff| {diff:.2e}, beyond {LOGIT_RTOL * scale:.2e}; within "
              f"the unsharded model's own fp32 rounding: RMS distance from fp64 {distance:.3g}, the unsharded fp32 "
              f"model's {noise:.3g} (bound {limit:.3g}: {FACTOR:g} x it)" if distance <= limit else
              f"logits: max |diff| {diff:.2e} (tolerance {LOGIT_RTOL * scale:.2e}); RMS distance from fp64 "
              f"{distance:.3g}, beyond {FACTOR:g} x the unsharded fp32 model's {noise:.3g}",
              max_diff=diff, tolerance=LOGIT_RTOL * scale, distance=distance, noise=noise, bound=limit)
    else:
        check(not fixed[0], "logits", f"logits: max |diff| {diff:.2e} (tolerance {LOGIT_RTOL * scale:.2e})",
              max_diff=diff, tolerance=LOGIT_RTOL * scale)
    first_bad = next((i for i, bad in enumerate(fixed[1:]) if bad), None)
    within = "every layer within tolerance"
    if first_bad is not None and exact is not None and len(exact["hidden"]) == len(want["hidden"]):
        noise = [rms_diff(a, b) for a, b in zip(want["hidden"], exact["hidden"])]
        beyond = first_beyond(got["hidden"], exact["hidden"], noise, torch.float32)
        first_bad = None if beyond is None else beyond[0]
        within = (f"every layer within tolerance or within {FACTOR:g} x the unsharded fp32 model's own distance "
                  "from fp64")
    read = " (each layer's output: the model's forward returns no hidden states)" if want.get("from_layers") else ""
    check(first_bad is None, "hidden_states", f"hidden states: {within}{read}" if first_bad is None
          else f"hidden states: first diverging layer is hidden_states[{first_bad}] of {len(want['hidden'])}{read}",
          first_diverging=first_bad, layers=len(want["hidden"]))
    for mode in MODES:
        if mode not in want:
            check_tokens(False, mode, "")
            continue
        a, b = got[mode], want[mode]
        same_shape = a.shape == b.shape
        mism = None if same_shape and torch.equal(a, b) else (
            "shape" if not same_shape else tuple(int(x) for x in (a != b).nonzero()[0]))
        check_tokens(mism is None, mode, f"{mode} token ids: " + ("identical to unsharded" if mism is None else
                                                           f"first different token at (row, position) {mism}"),
              identical=mism is None, first_different=mism)


def _half_precision_checks(got: dict, want: dict, dtype, check, check_tokens) -> None:
    """Logits, hidden states and token ids judged against the unsharded model's own rounding (`rounding.py`)."""
    from .rounding import FACTOR, dtype_name, first_beyond, rms_bound, rms_diff, step_bound, token_verdict

    floor, names, exact, kind = want["floor"], want["names"], want["floor"]["exact"], dtype_name(dtype)
    beyond = first_beyond(got["hidden"], exact["hidden"], floor["hidden_rms"], dtype)
    where = "" if beyond is None else f"; first beyond rounding: {names[beyond[0]]}"
    limit = rms_bound(floor["logits_rms"], exact["logits"], dtype)
    distance = rms_diff(got["logits"], exact["logits"])
    ratios = [rms_diff(a, b) / max(n, 1e-30) for a, b, n in zip(got["hidden"], exact["hidden"], floor["hidden_rms"])]
    check(distance <= limit, "logits", f"logits ({kind}): RMS distance from fp32 {distance:.3g}, the unsharded "
          f"{kind} model's {floor['logits_rms']:.3g} (bound {limit:.3g}: {FACTOR:g} x it)" + (
              "" if distance <= limit else where),
          distance=distance, noise=floor["logits_rms"], bound=limit,
          ratio=distance / max(floor["logits_rms"], 1e-30), hidden_ratios=ratios)
    check(beyond is None, "hidden_states", f"hidden states ({kind}): every layer within {FACTOR:g} x the unsharded "
          f"model's own distance from fp32" if beyond is None else f"hidden states ({kind}): first beyond rounding "
          f"at {names[beyond[0]]} (hidden_states[{beyond[0]}] of {len(names)}): RMS distance from fp32 "
          f"{beyond[1]:.3g}, bound {beyond[2]:.3g}",
          first_diverging=None if beyond is None else beyond[0], layer=None if beyond is None else names[beyond[0]],
          layers=len(names))
    steps = step_bound(floor["logits_max"], exact["logits"], dtype)
    for mode in MODES:
        if mode not in want:
            check_tokens(False, mode, "")
            continue
        ok, text, data = token_verdict(mode, got[mode], want[mode], steps)
        check_tokens(ok, mode, text + ("" if ok else where), **data)


def _check_loading(model_dir, cls, config, naive, naive_greedy, inputs, args, topology, groups, policy, work_dir,
                   dtype=None, trust: bool = False):
    """The shard-aware and pre-sharded loading paths against the naive one (full load, then split):
    every tensor of this rank's shard bitwise equal, and greedy token ids equal."""
    import torch

    from ..errors import InferenceSetupError
    from ..load.checkpoint import checkpoint_files
    from ..load.loaders import load_model, pending_load, policy_id
    from ..load.presharded import start_writing, write_presharded
    from ..policy.derive import policy_for_model
    from ..shard.inject import shard_model

    if checkpoint_files(Path(model_dir)) is None:
        yield False, "loading_shard-aware", "loading: no safetensors weights, shard-aware loading not checked", {}
        return
    want = {n: p for n, p in naive.named_parameters(remove_duplicate=False)}
    out = Path(work_dir) / f"presharded_{Path(model_dir).name}"
    for mode in ("shard-aware", "pre-sharded"):
        source = out if mode == "pre-sharded" else model_dir
        dtype = dtype or torch.float32
        fallback = ""
        try:
            model = load_model(cls, source, mode=mode, inference_args=args, dtype=dtype, trust_remote_code=trust)
        except InferenceSetupError as e:
            if mode != "shard-aware" or not getattr(e, "needs_conversion", False):
                raise
            # a checkpoint whose tensors transformers converts at load (Ergo's `gate_kernel`, Kimi-Linear's
            # convolutions): what a run's default `--loading auto` does with it, said in the verdict
            model = load_model(cls, source, mode="auto", inference_args=args, dtype=dtype, trust_remote_code=trust)
            reason = str(e).split(": ", 2)[-1].split("; valid")[0]
            fallback = f" (shard-aware reading refused: {reason}; --loading auto loads it full)"
        metas = sum(p.is_meta for p in model.parameters())
        model, report = shard_model(model, args, topology, groups, policy_for_model(policy, model, topology.tp_size),
                                    dtype, verify=False, pending=pending_load(model))
        if mode == "shard-aware":  # the copy `ds-inference shard` writes: from weights no forward has run on
            if topology.rank == 0:
                start_writing(out)
            write_presharded(model, Path(model_dir), out, topology, groups, policy_id(report.policy_object or policy),
                             dtype)
        with torch.no_grad():
            pad = _pad_id(config)
            # as the naive path's ids were made (Whisper's generate takes another path where it returns a dict)
            half = dtype != torch.float32
            greedy = _generate(model, inputs, torch, half, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS,
                               pad_token_id=pad)
            greedy = greedy["ids"] if half else greedy
        # the tensors compared after the model has run, as the naive one's were: a module that rewrites its own weight
        # in its first forward (Baichuan's NormHead normalises `lm_head.weight` in place) had changed only the naive
        # model's ("16/17 tensors bitwise equal to the naive path (first different: lm_head.weight)", 2026-12-07)
        mine = dict(model.named_parameters(remove_duplicate=False))
        bad = [n for n in want if n not in mine or mine[n].shape != want[n].shape or not torch.equal(mine[n], want[n])]
        bad += [n for n in mine if n not in want]
        # tied weights stay tied: names that share one tensor in the naive model share one here too
        ties = [(a, b) for a in want for b in want if a < b and want[a] is want[b]]
        bad += [f"{a} (no longer tied to {b})" for a, b in ties if a in mine and b in mine and mine[a] is not mine[b]]
        same = greedy.shape == naive_greedy.shape and torch.equal(greedy, naive_greedy)
        yield (not bad and same and (metas > 0 or bool(fallback)), f"loading_{mode}",
               f"loading {mode}{fallback}: {len(mine) - len(bad)}/{len(mine)} tensors bitwise equal to the naive path"
               + (f", {len(ties)} ties kept" if ties else "")
               + (f" (first different: {bad[0]})" if bad else "")
               + f", greedy ids {'identical' if same else 'DIFFERENT'}; built on meta: {metas} tensors; {report.loading}",
               dict(tensors=len(mine), equal_tensors=len(mine) - len(bad), first_different=bad[0] if bad else None,
                    ties=len(ties), greedy_identical=same, built_on_meta=metas))


def _worker(out_dir: str, policy_spec: str, settings: str, model_dirs: list[str]) -> int:
    import torch.distributed as dist

    from ..deepspeed_compat import init_deepspeed_comm
    from ..errors import InferenceSetupError
    from ..run.ranks import init_rank
    from ..topology import init_process_groups

    topology, device = init_rank(timeout=120)
    groups = init_process_groups(topology, device.type, timeout=120)
    init_deepspeed_comm(topology)
    checks: list[dict] = []

    def save() -> None:  # every rank its own results: the parent counts a check as passed only if all passed
        Path(out_dir, f"result-{topology.rank}.json").write_text(json.dumps({"checks": checks,
                                                                             "derivations": DERIVATIONS}))

    try:
        for d in model_dirs:
            try:
                given = json.loads(settings)
                _check_one(d, policy_spec, topology, groups, checks, Path(out_dir), given["dtype"],
                           given["reduce_dtype"], given["trust"])
            except InferenceSetupError as e:
                checks.append(check_record(Path(d).name, topology.tp_size, "setup", False, f"setup: {e}"))
            except ReferenceFailed as e:
                checks.append(check_record(Path(d).name, topology.tp_size, "reference", False, f"reference: {e}"))
            except ShardedForwardFailed as e:
                checks.append(check_record(Path(d).name, topology.tp_size, "sharded_forward", False, str(e)))
                dist.barrier(group=groups.tp)
            except Exception as e:  # a rank that raised mid-collective: report it and stop here
                checks.append(check_record(Path(d).name, topology.tp_size, "error", False,
                                           f"{type(e).__name__}: {str(e)[:300]}", exception=type(e).__name__))
                raise
            save()
    finally:
        save()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "--worker":
        from ds_inference_integration.run.lifecycle import exit_now
        from ds_inference_integration.tools import policy_check

        # Run the worker from the imported module, not from __main__: one copy of its functions, the same
        # ones a test's fault hook (tests/faults) patches on import. Then leave without the interpreter's
        # teardown (results written, process group destroyed): gloo's threads aborted a rank there after every
        # check had passed (twice in one `make test` with two workers, 2026-12-04), failing the check.
        exit_now(policy_check._worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))
    print("usage: ds-inference policy check MODEL_DIR --tp-size N", file=sys.stderr)
    sys.exit(2)
