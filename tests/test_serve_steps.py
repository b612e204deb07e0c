"""The step engine (`--scheduler continuous`): rows join and leave a running batch at every step, each row's tokens
those of its request generated alone in one process. In this process: the engine against `run_batch` of each row
alone (greedy, sampled, stop strings and ids, minimums, repetition penalty, one-token rows), on the embedded GPT-2
and a tiny GQA Llama; the slot cache not copied when a row joins; the probe that sends a model to the batch engine;
cancellation, a row's own failure, beam and run-alone admissions between steps. Launched: a tp 2 server under
load against the unsharded model, and a short request answered while a long row runs, a left client's slot freed."""

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time

import pytest
import torch
from serving import ServerProc, post, post_all, post_on, request
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, LlamaConfig, MistralConfig

from conftest import EXAMPLES, save_tiny_model
from ds_inference_integration.serve.engine import Answers, run_batch
from ds_inference_integration.serve.prefill import Prefill
from ds_inference_integration.serve.rules import Refused
from ds_inference_integration.serve.slots import SlotCache
from ds_inference_integration.serve.steps import DecoderPositions, Kept, Status, StepEngine, _Row, choose, probe
from ds_inference_integration.serve.wire import Admit, BatchKey, RowSpec

GPT2 = EXAMPLES / "models" / "gpt2-num2words-en-ro"
T5 = EXAMPLES / "models" / "t5-num2words-en-ro"
PROMPTS = (EXAMPLES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()


class Record(Answers):
    """What the engine answers, kept: each row's sequence and reason, failures, the running rows at each step."""

    def __init__(self):
        self.ended, self.out, self.whole, self.failures, self.counts = set(), {}, {}, {}, []
        self.logprobs, self.prompt = {}, {}

    def tokens(self, rows):
        self.counts.append({row: out.count for row, out in rows.items()})
        for row, out in rows.items():
            if out.logprobs is not None:
                self.logprobs.setdefault(row, []).append(out.logprobs)
            if out.prompt_logprobs is not None:
                self.prompt[row] = out.prompt_logprobs

    def finished(self, row, sequences, reasons):
        self.ended.add(row)
        self.out[row] = (sequences[0], reasons[0])
        self.whole[row] = (sequences, reasons)

    def failed(self, rows, status, message, together=False):
        for r in rows:
            self.ended.add(r)
            self.failures[r] = (status, message)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(GPT2).eval(), AutoTokenizer.from_pretrained(GPT2)


def _llama(tokenizer, path=None, **overrides):
    """A tiny random Llama with grouped-query attention (4 query heads, 2 key/value heads) and rotary positions,
    with large weights so that greedy tokens depend on the input."""
    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": 1,
                            "bos_token_id": 2, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    if path is not None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model


def _windowed(tokenizer, kind: str):
    """A tiny random model with sliding-window attention (window 4, shorter than every prompt): Mistral (one window
    for the whole model, one mask) or Gemma 2 (sliding and full layers alternating, a mask per layer type)."""
    from transformers import Gemma2Config

    torch.manual_seed(0)
    small = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4, "pad_token_id": 0,
             "eos_token_id": 1, "bos_token_id": 2}
    config = MistralConfig(**small) if kind == "mistral" else Gemma2Config(**small, head_dim=16)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _alone(model, tokenizer, spec, key=BatchKey()):
    out = run_batch(model, tokenizer, Admit(0, key, (spec,)), "cpu")
    return out["sequences"][0][0], out["finish"][0][0]


def _run(engine, arrivals, answers, limit=500):
    """Admissions at their steps ({step: Admit}); steps until every row is answered."""
    step = 0
    while (arrivals or engine.busy()) and step < limit:
        if step in arrivals:
            engine.take(arrivals.pop(step))
        engine.step(answers)
        step += 1
    assert not engine.busy() and not arrivals, "the engine did not finish"
    return step


def _rows(tokenizer, n=10):
    specs = []
    for i, prompt in enumerate(PROMPTS[:n]):
        settings = {"max_new_tokens": 2 + 3 * i}
        if i % 3 == 1:
            settings.update(temperature=1.0, top_k=50, seed=42 + i)
        if i == 0:
            settings.update(max_new_tokens=30, ignore_eos=True)  # the long row the others overtake
        if i == 9:
            settings.update(max_new_tokens=1)
        if i == 4:
            settings.update(stop=("de",))
        if i == 5:
            settings.update(min_tokens=6, stop_token_ids=(7, 9))
        if i == 8:
            settings.update(temperature=0.7, top_p=0.8, seed=3)
        specs.append(RowSpec(tuple(tokenizer(prompt)["input_ids"]), id=i, **settings))
    return specs


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = save_tiny_model("bart", tmp_path_factory.mktemp("bart") / "bart")
    return AutoModelForSeq2SeqLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "llama-gqa-fused", "mistral-window", "gemma2-window", "t5",
                                  "bart"])
def test_rows_that_join_and_leave_each_get_their_answer_alone(gpt2, bart, kind):
    """Ten rows (greedy, sampled with seeds, top-p, a stop string, stop ids held back by a minimum, one-token rows)
    arrive two every third step into 3 slots (prefilled together, right-padded): every row's tokens and finish
    reason equal that row generated alone, rows of different lengths shared steps, and a later short row finished
    before an earlier long one. Decoder-only (GPT-2; a Llama with grouped-query attention and rotary positions) and
    encoder-decoders (T5's relative position bias, BART's learned positions: their decoders get each row's own);
    sliding windows shorter than the prompts (the keys all kept, the window the step's mask's)."""
    model, tokenizer = {"gpt2": gpt2, "bart": bart}.get(kind, gpt2)
    if kind.startswith("llama-gqa"):
        model = _llama(tokenizer)
    if kind.endswith("-window"):
        model = _windowed(tokenizer, kind.split("-")[0])
    if kind == "t5":
        model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    specs = _rows(tokenizer)
    # "-fused": rows joining running ones prefilled in their step, as a server at tp > 1 runs them
    engine = StepEngine(model, tokenizer, "cpu", capacity=3, fuse_admissions=kind.endswith("-fused"))
    answers = Record()
    _run(engine, {3 * i: Admit(i, BatchKey(), tuple(specs[2 * i:2 * i + 2])) for i in range(5)}, answers)
    assert not answers.failures
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
    assert any(len(set(c.values())) > 1 for c in answers.counts), "no step held rows of different lengths"
    order = list(answers.out)
    assert order.index(1) < order.index(0) and order.index(2) < order.index(0), order


def test_the_batch_engine_keeps_a_cache_whatever_the_checkpoint_says(gpt2):
    """A checkpoint saved from a config that says `"use_cache": false` (as training leaves it: the embedded GPT-2's
    says so) carries it into its generation config, and generate then fed the whole sequence at every step. The batch
    engine decodes one token a forward, with the same tokens as the step engine (which always kept its own cache)."""
    embedded, tokenizer = gpt2
    assert embedded.config.use_cache is False
    model = AutoModelForCausalLM.from_config(embedded.config).eval()
    model.load_state_dict(embedded.state_dict())
    assert model.generation_config.use_cache is False
    widths = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    spec = RowSpec(tuple(tokenizer(PROMPTS[0])["input_ids"]), max_new_tokens=6, ignore_eos=True)
    try:
        tokens, _ = _alone(model, tokenizer, spec)
    finally:
        handle.remove()
    assert widths == [len(spec.prompt_ids)] + [1] * 5, widths
    engine, answers = StepEngine(model, tokenizer, "cpu", 2), Kept()
    _run(engine, {0: Admit(0, BatchKey(), (spec,))}, answers)
    assert answers.rows[0][0][0] == tokens


def test_repetition_penalty_is_the_rows_own(gpt2):
    """A key's repetition penalty reaches each of its rows through generate's own processors."""
    model, tokenizer = gpt2
    key = BatchKey(repetition_penalty=5.0)
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=16, id=i, ignore_eos=True)
             for i, p in enumerate(PROMPTS[:3])]
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    _run(engine, {0: Admit(0, key, tuple(specs[:2])), 3: Admit(1, key, (specs[2],))}, answers)
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec, key)
    plain = [_alone(model, tokenizer, spec) for spec in specs]
    assert plain != [answers.out[s.id] for s in specs]  # the penalty changed something, or this proves nothing


def _penalised_alone(model, spec) -> list[int]:
    """A greedy row with OpenAI's penalties, written out: the plain forward over the whole sequence each token, the
    generated tokens' counts taken off the last logits (presence once, frequency per time), the highest taken."""
    ids, new = list(spec.prompt_ids), []
    with torch.no_grad():
        for _ in range(spec.max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            for token in set(new):
                logits[token] -= spec.presence_penalty + spec.frequency_penalty * new.count(token)
            new.append(int(logits.argmax()))
            ids.append(new[-1])
    return new


def test_presence_and_frequency_penalties_are_the_rows_own(gpt2):
    """OpenAI's presence and frequency penalties on greedy and sampled rows joining running ones: each row equals
    the batch engine's answer alone, a greedy one the penalties written out (`_penalised_alone`), and they change
    the answer (the prompt's own tokens are not counted, as vLLM counts them). A random GPT-2 of the embedded one's
    shape: the trained one is too sure of its tokens for a penalty of 2 to change one."""
    embedded, tokenizer = gpt2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(embedded.config).eval()
    settings = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7}, {"presence_penalty": -1.0, "frequency_penalty": 2.0},
                {"frequency_penalty": 1.0, "temperature": 1.0, "seed": 3, "top_k": 20}]
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=14, id=i, ignore_eos=True, **kw)
             for i, (p, kw) in enumerate(zip(PROMPTS[5:], settings))]
    plain = RowSpec(tuple(tokenizer(PROMPTS[9])["input_ids"]), max_new_tokens=20, id=9, ignore_eos=True)
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    _run(engine, {0: Admit(0, BatchKey(), (plain, specs[0])), 2: Admit(1, BatchKey(), tuple(specs[1:]))}, answers)
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
        unpenalised = RowSpec(spec.prompt_ids, 14, temperature=spec.temperature, seed=spec.seed, top_k=spec.top_k,
                              ignore_eos=True)
        assert answers.out[spec.id][0] != _alone(model, tokenizer, unpenalised)[0], spec
    for spec in specs[:3]:
        assert answers.out[spec.id][0] == _penalised_alone(model, spec), spec


def test_min_p_rows_draw_as_transformers_min_p_does_alone(gpt2):
    """vLLM's `min_p` on sampled rows joining running ones (and a greedy row, which it leaves alone): each row's
    tokens equal `generate` in one process with the same temperature, min_p and seed (transformers' own min-p
    warper, the same draw where top-k and top-p are not set), and min_p changed what the sampled rows drew. A random
    GPT-2 of the embedded one's shape, whose flat distributions min-p cuts."""
    embedded, tokenizer = gpt2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(embedded.config).eval()
    settings = [{"min_p": 0.3, "temperature": 1.0, "seed": 5}, {"min_p": 0.1, "temperature": 0.7, "seed": 9},
                {"min_p": 0.6, "temperature": 1.3, "seed": 2}, {"min_p": 0.5}]
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=12, id=i, **kw)
             for i, (p, kw) in enumerate(zip(PROMPTS[2:], settings))]
    plain = RowSpec(tuple(tokenizer(PROMPTS[9])["input_ids"]), max_new_tokens=16, id=9, ignore_eos=True)
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=5), Record()
    _run(engine, {0: Admit(0, BatchKey(), (plain, specs[0])), 2: Admit(1, BatchKey(), tuple(specs[1:]))}, answers)
    changed = 0
    for spec in specs:
        sampled = spec.temperature > 0
        ids = torch.tensor([spec.prompt_ids])
        runs = []
        for min_p in (spec.min_p, None):
            torch.manual_seed(spec.seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=sampled, max_new_tokens=12,
                                 pad_token_id=tokenizer.pad_token_id, **({"temperature": spec.temperature, "top_k": 0,
                                                                          "top_p": 1.0, "min_p": min_p} if sampled else {}))
            new = out[0, ids.shape[1]:].tolist()
            ends = [i for i, t in enumerate(new) if t == tokenizer.eos_token_id]
            runs.append(new[:ends[0] + 1] if ends else new)  # the padding after its EOS is generate's, not a token
        assert answers.out[spec.id][0] == runs[0], (spec, runs)
        changed += sampled and runs[0] != runs[1]
    assert changed >= 2  # min_p changed the sampled rows' draws, or this proves nothing


def _reference_logprobs(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """Each position's log probabilities, from the unsharded model's one forward over prompt + new tokens."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt + new])).logits[0].float(), -1)


def test_log_probabilities_of_prompt_and_new_tokens_are_the_models(gpt2):
    """Rows that ask for log probabilities (3 top tokens; one also its prompt's, as `echo` asks), greedy and sampled,
    joining running rows: each new token's and each prompt token's (after the first) equal the unsharded model's own
    log-softmax over the whole sequence within 1e-5, their top tokens too, and the tokens are what they were without
    logprobs; the head sends every position through for the row that asked for its prompt's only (admitted beside
    another row, it is prefilled alone); the batch engine refuses them in one line."""
    model, tokenizer = gpt2
    asks = [{"logprobs": 3, "prompt_logprobs": True}, {"logprobs": 0},
            {"logprobs": 2, "temperature": 1.0, "seed": 4, "top_k": 30}]
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=9, id=i, **kw)
             for i, (p, kw) in enumerate(zip(PROMPTS[12:], asks))]
    plain = RowSpec(tuple(tokenizer(PROMPTS[20])["input_ids"]), max_new_tokens=12, id=9)
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    heads = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: heads.append(tuple(output.shape[:2])))
    try:
        _run(engine, {0: Admit(0, BatchKey(), (plain, specs[0])), 2: Admit(1, BatchKey(), tuple(specs[1:]))},
             answers)
    finally:
        hook.remove()
    # several rows' prefill: at most their last positions (one each) go through the head
    assert (1, len(specs[0].prompt_ids)) in heads and all(rows == 1 or width <= rows for rows, width in heads), heads
    assert 9 not in answers.logprobs and set(answers.prompt) == {0}
    for spec in specs:
        new = answers.out[spec.id][0]
        without = RowSpec(spec.prompt_ids, 9, temperature=spec.temperature, seed=spec.seed, top_k=spec.top_k)
        assert (new, answers.out[spec.id][1]) == _alone(model, tokenizer, without)
        want = _reference_logprobs(model, list(spec.prompt_ids), new)
        n = len(spec.prompt_ids)
        got = answers.logprobs[spec.id]
        assert len(got) == len(new)
        for i, (lp, top) in enumerate(got):
            assert abs(lp - float(want[n - 1 + i, new[i]])) < 1e-5
            assert [t for t, _ in top] == want[n - 1 + i].topk(spec.logprobs).indices.tolist()
            assert all(abs(v - float(want[n - 1 + i, t])) < 1e-5 for t, v in top)
        if spec.prompt_logprobs:
            prompt = answers.prompt[spec.id]
            assert len(prompt) == n - 1
            for j, (lp, top) in enumerate(prompt):
                assert abs(lp - float(want[j, spec.prompt_ids[j + 1]])) < 1e-5
                assert [t for t, _ in top] == want[j].topk(3).indices.tolist()
    with pytest.raises(Refused, match="logprobs are served by the step engine"):
        run_batch(model, tokenizer, Admit(0, BatchKey(), (specs[1],)), "cpu")


def test_a_row_joins_without_the_running_rows_cache_being_copied(gpt2):
    """An admission writes its own row's slot only: the cache's tensors stay where they were (no re-padding, no copy
    of the batch) unless the longest row outgrows the width, which doubles."""
    model, tokenizer = gpt2
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    prompt = tuple(tokenizer(PROMPTS[0])["input_ids"])
    engine.take(Admit(0, BatchKey(), (RowSpec(prompt, max_new_tokens=3, id=0, ignore_eos=True),)))
    engine.step(answers)
    layer = engine.cache.layers[0]
    layer.grow(64)
    where = [(x.data_ptr(), x.shape) for lay in engine.cache.layers for x in (lay.keys, lay.values)]
    engine.take(Admit(1, BatchKey(), (RowSpec(prompt[:4], max_new_tokens=3, id=1, ignore_eos=True),)))
    engine.step(answers)
    assert where == [(x.data_ptr(), x.shape) for lay in engine.cache.layers for x in (lay.keys, lay.values)]
    layer.grow(65)
    assert layer.keys.shape[2] == 128


def test_the_probe_sends_what_the_slots_cannot_hold_to_the_batch_engine(gpt2, bart, monkeypatch):
    """GPT-2, a GQA Llama, T5, BART and sliding-window models pass; a model whose attention does not follow per-row
    positions and masks (Bloom's ALiBi, computed from a 2D mask) and a model whose cache keeps neither keys nor
    states per layer (RWKV: its own state, outside the cache) are refused, with
    why; and so are T5 and BART where their decoders are not given each row's position, and the sliding-window
    models where the step's mask leaves the window out (the probe sees what it must)."""
    from ds_inference_integration.serve.steps import choose

    model, tokenizer = gpt2
    assert probe(model, tokenizer, "cpu") is None
    assert probe(_llama(tokenizer), tokenizer, "cpu") is None
    for capacity in (1, 2):  # fewer slots than the probe's rows: still the step engine (it was the batch engine)
        assert choose(model, tokenizer, "cpu", capacity) == (None, {})
    t5 = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    for model, tokenizer in (t5, bart):
        assert probe(model, tokenizer, "cpu") is None
    windowed = [_windowed(gpt2[1], kind) for kind in ("mistral", "gemma2")]
    for model in windowed:
        assert probe(model, gpt2[1], "cpu") is None
    monkeypatch.setattr(DecoderPositions, "per_row", lambda self, positions: contextlib.nullcontext())
    for model, tokenizer in (t5, bart):
        assert "do not give their single-row logits" in probe(model, tokenizer, "cpu")
    decode = SlotCache.decode
    monkeypatch.setattr(SlotCache, "decode", lambda self, positions, window=None, hi=None, fixed=False, held=None:
                        decode(self, positions, None, hi, fixed, held))
    for model in windowed:
        assert "do not give their single-row logits" in probe(model, gpt2[1], "cpu")
    monkeypatch.undo()
    from transformers import RwkvConfig

    rwkv = AutoModelForCausalLM.from_config(RwkvConfig(vocab_size=len(gpt2[1]), hidden_size=32, num_hidden_layers=2,
                                                       attention_hidden_size=32, intermediate_size=64)).eval()
    assert probe(rwkv, gpt2[1], "cpu") == "the step engine cannot hold this model's cache: its layer 0 keeps no 4D keys"
    model, tokenizer = gpt2
    from transformers import BloomConfig

    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=len(tokenizer), hidden_size=64, n_layer=2,
                                                         n_head=4)).eval()
    assert probe(bloom, tokenizer, "cpu") is not None


def test_joining_rows_cross_attention_is_projected_from_their_own_encoder_output_alone(bart, monkeypatch):
    """T5 and BART: a row that joins running rows has its cross-attention keys and values projected from its own
    encoder output at admission (the key projections see the joining rows only: computed in the step's forward,
    every running row's stand-in went through them too), and its answer is its answer alone. Where the projection
    is not the layers' own (here: made wrong), `choose` finds it and the engine computes them in the forward."""
    from ds_inference_integration.serve.steps import CrossProjection, choose

    t5 = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    for model, tokenizer in (t5, bart):
        assert choose(model, tokenizer, "cpu", 4) == (None, {})
        first = next(m for n, m in model.get_decoder().named_modules() if n.endswith(CrossProjection.NAMES))
        k = first.k if hasattr(first, "k") else first.k_proj
        seen = []
        hook = k.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
        engine, answers = StepEngine(model, tokenizer, "cpu", 4), Record()
        specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=12, ignore_eos=True, id=i)
                 for i, p in enumerate(PROMPTS[:3])]
        engine.take(Admit(0, BatchKey(), tuple(specs[:2])))
        engine.step(answers)
        engine.step(answers)
        seen.clear()
        engine.take(Admit(1, BatchKey(), (specs[2],)))
        engine.step(answers)  # the third row joins the two running
        hook.remove()
        assert seen == [1], seen
        while engine.busy():
            engine.step(answers)
        for spec in specs:
            assert answers.out[spec.id] == _alone(model, tokenizer, spec)

        def wrong(self, states, own=CrossProjection.__call__):
            return [(keys * 2, values) for keys, values in own(self, states)]

        monkeypatch.setattr(CrossProjection, "__call__", wrong)
        assert choose(model, tokenizer, "cpu", 4) == (None, {"project_cross": False})
        monkeypatch.undo()


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_fixed_shapes_decode_every_slot_over_the_caches_width_and_answer_as_alone(gpt2, kind):
    """With fixed shapes (a GPU's default): every decoding step runs all the slots over the cache's whole width, so
    its shapes change only when the cache grows (the widths seen are doublings), while rows of different lengths
    join and leave, greedy and sampled and a beam group among them; every row's answer is still its answer alone."""
    model, tokenizer = gpt2 if kind == "gpt2" else (AutoModelForSeq2SeqLM.from_pretrained(T5).eval(),
                                                     AutoTokenizer.from_pretrained(T5))
    engine, answers = StepEngine(model, tokenizer, "cpu", 6, fixed_shapes=True), Record()
    assert not StepEngine(model, tokenizer, "cpu", 6).fixed_shapes  # off by default on CPU
    shapes = []

    def seen(module, args, kwargs):
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        mask = kwargs.get("decoder_attention_mask", kwargs.get("attention_mask"))
        if ids is not None and ids.shape[1] == 1 and mask is not None and mask.dim() == 4:  # a decoding step
            shapes.append((ids.shape[0], mask.shape[-1], kwargs["attention_mask"].shape[-1]
                           if kind == "t5" else None))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    specs = _rows(tokenizer, 6)
    beam_key = BatchKey(num_beams=2, max_new_tokens=5)
    beam = RowSpec(tuple(tokenizer(PROMPTS[7])["input_ids"]), max_new_tokens=5, id=99)
    try:
        _run(engine, {0: Admit(0, BatchKey(), tuple(specs[:2])), 2: Admit(1, BatchKey(), tuple(specs[2:4])),
                      5: Admit(2, beam_key, (beam,)), 9: Admit(3, BatchKey(), tuple(specs[4:]))}, answers)
    finally:
        hook.remove()
    assert shapes and {rows for rows, _, _ in shapes} == {6}, shapes
    widths = sorted({width for _, width, _ in shapes})
    assert all(w == 16 * 2 ** i for i, w in enumerate(widths)), widths  # the cache's widths: 16, 32, ...
    assert len(widths) < len(shapes) / 4, widths
    if kind == "t5":
        assert len({source for _, _, source in shapes}) <= 2, shapes
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec)
    assert answers.whole[99][0][0] == run_batch(model, tokenizer, Admit(0, beam_key, (beam,)), "cpu")["sequences"][0][0]


def test_an_idle_engine_shrinks_its_cache_and_the_next_rows_answer_as_alone(gpt2):
    """A 300-token row grows the slot cache to 512 columns for every slot; once no row is held and the engine is
    idle (`idle`: nothing came for a keep-alive interval) the cache is back to its first 16 (it stayed at its widest
    for the server's life), not before (a client alone had it shrunk and grown again for every request), and rows
    admitted after it answer as alone; a step that fails shrinks it at once."""
    model, tokenizer = gpt2
    llama = _llama(tokenizer)
    engine, answers = StepEngine(llama, tokenizer, "cpu", 4), Record()
    long = RowSpec(tuple(tokenizer(PROMPTS[0])["input_ids"]), max_new_tokens=300, ignore_eos=True, id=0)
    engine.take(Admit(0, BatchKey(), (long,)))
    widths = []
    while engine.busy():
        engine.step(answers)
        widths.append(engine.cache.layers[0].width())
    assert max(widths) >= 512 and widths[-1] == max(widths)
    engine.idle()
    assert engine.cache.layers[0].width() == 16
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=6, ignore_eos=True, id=i)
             for i, p in enumerate(PROMPTS[1:4], start=1)]
    _run(engine, {0: Admit(1, BatchKey(), tuple(specs[:2])), 2: Admit(2, BatchKey(), (specs[2],))}, answers)
    assert engine.cache.layers[0].width() == 32  # what these rows needed, not the long row's 512
    for spec in [long, *specs]:
        assert answers.out[spec.id] == _alone(llama, tokenizer, spec)
    engine.take(Admit(3, BatchKey(), (RowSpec(long.prompt_ids, max_new_tokens=300, ignore_eos=True, id=9),)))
    for _ in range(40):
        engine.step(answers)
    assert engine.cache.layers[0].width() == 64 and engine.fail_running() == [9]
    assert engine.cache.layers[0].width() == 16


def test_cancelled_failed_wide_beam_and_alone_rows_between_steps(gpt2):
    """A cancelled running row ends 'cancelled' at the next step, a cancelled waiting row without running; a row
    with nothing left to sample fails alone (400) and its neighbours keep their answers; a beam request wider than
    the slots runs by the batch engine once the running rows end, rows that came after it waiting; a run-alone
    admission (a request run again after its batch failed) has no row beside it."""
    model, tokenizer = gpt2
    ids = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:6]]
    vocab = tuple(range(len(tokenizer)))
    long_row = RowSpec(ids[0], max_new_tokens=40, id=0, ignore_eos=True)
    masked = RowSpec(ids[1], max_new_tokens=8, id=1, min_tokens=4, stop_token_ids=vocab)
    good = RowSpec(ids[2], max_new_tokens=8, id=2)
    wide = Admit(3, BatchKey(num_beams=5, num_return_sequences=2, max_new_tokens=6),
                 (RowSpec(ids[3], max_new_tokens=6, id=3),))
    after = RowSpec(ids[4], max_new_tokens=5, id=4)
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    engine.run_batch = lambda admit, control, a: [a.finished(r.id, s, f) for r, s, f in zip(
        admit.rows, *(lambda o: (o["sequences"], o["finish"]))(run_batch(model, tokenizer, admit, "cpu")))]
    engine.take(Admit(0, BatchKey(), (long_row, masked, good)))
    engine.step(answers)
    engine.take(wide)
    engine.take(Admit(4, BatchKey(), (after,)))
    engine.step(answers)
    assert 4 not in [r.spec.id for r in engine.running.values()]  # behind the wide beams: waits
    engine.cancel([0])
    for _ in range(30):
        engine.step(answers)
    assert answers.out[0][1] == "cancelled" and len(answers.out[0][0]) == 2
    assert answers.failures[1][0] == 400 and "every token is masked" in answers.failures[1][1]
    assert answers.out[2] == _alone(model, tokenizer, good)
    whole = run_batch(model, tokenizer, wide, "cpu")
    assert answers.out[3] == (whole["sequences"][0][0], whole["finish"][0][0])
    assert answers.out[4] == _alone(model, tokenizer, after)
    engine.take(Admit(5, BatchKey(), (RowSpec(ids[5], max_new_tokens=6, id=5),), alone=True))
    engine.take(Admit(6, BatchKey(), (RowSpec(ids[0], max_new_tokens=3, id=6),)))
    engine.step(answers)
    assert [r.spec.id for r in engine.running.values()] == [5]
    waiting = RowSpec(ids[1], max_new_tokens=3, id=7)
    engine.take(Admit(7, BatchKey(), (waiting,)))
    engine.cancel([7])
    while engine.busy():
        engine.step(answers)
    assert answers.out[7] == ([], "cancelled")
    assert answers.out[6] == _alone(model, tokenizer, RowSpec(ids[0], max_new_tokens=3, id=6))


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
def test_rows_admitted_together_are_prefilled_packed_in_one_forward_as_each_alone(gpt2, kind):
    """Rows admitted at one step are prefilled as one sequence (their prompts one after another, each at its own
    positions from 0 under a block-diagonal causal mask): one forward of their tokens' sum, no padding, and each row's
    tokens equal that row generated alone. Where packing gives a row another's positions (a deliberately wrong
    packing here), the start-up probe finds it and the engine prefills right-padded instead."""
    model, tokenizer = gpt2
    if kind == "llama-gqa":
        model = _llama(tokenizer)
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=5 + i, id=i) for i, p in enumerate(PROMPTS[3:7])]
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    assert engine.prefill.pack
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        _run(engine, {0: Admit(0, BatchKey(), tuple(specs))}, answers)
    finally:
        hook.remove()
    assert shapes[0] == (1, sum(len(s.prompt_ids) for s in specs)), shapes[:2]
    # past PACKED_TOKENS, or where padding costs less (long prompts), right-padded
    assert not engine.prefill.packing_pays([[5] * 600, [5] * 600]) and not engine.prefill.packing_pays([[5] * 500] * 2)
    assert engine.prefill.packing_pays([[5] * 16] + [[5] * 4] * 15)
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
    assert choose(model, tokenizer, "cpu", 4) == (None, {})

    def wrong(self, prompts):  # every row at the positions of one sequence, the first row's mask for all
        prefilled, logits, places = packed(self, [[t for p in prompts for t in p]])
        return prefilled, logits.expand(len(prompts), -1), [(0, 0)] * len(prompts)

    packed = Prefill.packed
    Prefill.packed = wrong
    try:
        assert "do not give their single-row logits" in probe(model, tokenizer, "cpu", 4)
        assert choose(model, tokenizer, "cpu", 4) == (None, {"pack_prefill": False})
    finally:
        Prefill.packed = packed


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
def test_rows_joining_running_ones_are_prefilled_in_the_running_rows_step(gpt2, kind, monkeypatch):
    """Rows admitted while others run are prefilled in the running rows' decoding forward (vLLM's step: one forward
    a step, the admitted prompts' tokens beside each running row's next token, each at its slot's positions): a step
    that admits two rows beside three running ones is one forward of their tokens' sum, and every row equals that
    row generated alone. A fused step that lets a token see other slots (a deliberately wrong mask here) is found by
    the start-up probe, and the engine then prefills them apart (`fuse_admissions` off)."""
    model, tokenizer = gpt2
    if kind == "llama-gqa":
        model = _llama(tokenizer)
    specs = [RowSpec(tuple(tokenizer(p)["input_ids"]), max_new_tokens=6 + 2 * i, id=i, ignore_eos=True)
             for i, p in enumerate(PROMPTS[10:15])]
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=6, fuse_admissions=True), Record()
    assert engine.fuse
    engine.take(Admit(0, BatchKey(), tuple(specs[:3])))
    engine.step(answers)
    # within PACKED_TOKENS^2 a head (the step's tokens x every slot's columns), else prefilled apart
    assert engine._fuses([_Row(RowSpec((5,) * 40, 4), BatchKey(), 0)], dict(engine.running))
    assert not engine._fuses([_Row(RowSpec((5,) * 1500, 4), BatchKey(), 0)], dict(engine.running))
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        engine.take(Admit(1, BatchKey(), tuple(specs[3:])))
        engine.step(answers)
    finally:
        hook.remove()
    assert shapes == [(1, len(specs[3].prompt_ids) + len(specs[4].prompt_ids) + 3)], shapes
    _run(engine, {}, answers)
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec

    tokens = SlotCache.tokens

    def wrong(self, places, hi):  # every token sees every slot's columns up to its position
        positions, mask = tokens(self, places, hi)
        width = mask.shape[-1] // hi
        columns = torch.arange(hi * width)
        seen = (columns[None, :] % width) <= positions[0][:, None]
        return positions, torch.where(seen, 0.0, torch.finfo(mask.dtype).min).to(mask.dtype)[None, None]

    assert choose(model, tokenizer, "cpu", 4, fuse=True) == (None, {"fuse_admissions": True})

    # a fused forward that fails runs the step apart (each row's failure its own there); a fatal failure (a
    # collective gone) ends the step, as anywhere
    def failing(error):
        def tokens(self, places, hi):
            raise error
        return tokens

    for error, ends in ((RuntimeError("no memory for the fused step"), False), (ConnectionError("peer gone"), True)):
        engine, answers = StepEngine(model, tokenizer, "cpu", capacity=6, fuse_admissions=True), Record()
        engine.take(Admit(0, BatchKey(), tuple(specs[:3])))
        engine.step(answers)
        with monkeypatch.context() as patched:
            patched.setattr(SlotCache, "tokens", failing(error))
            engine.take(Admit(1, BatchKey(), tuple(specs[3:])))
            if ends:
                with pytest.raises(ConnectionError):
                    engine.step(answers)
                continue
            engine.step(answers)
        _run(engine, {}, answers)
        assert not answers.failures
        for spec in specs:
            assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
    monkeypatch.setattr(SlotCache, "tokens", wrong)
    assert "do not give their single-row logits" in probe(model, tokenizer, "cpu", 4, fuse_admissions=True)
    assert choose(model, tokenizer, "cpu", 4, fuse=True) == (None, {})


def test_long_prompts_waiting_together_join_a_few_a_step_within_the_admission_budget(gpt2):
    """Six rows of 1,000-token prompts waiting at once: a step admits as many as keep rows x longest prompt^2 within
    ADMISSION_BUDGET (4 here: a right-padded prefill's attention weights 16 MiB a head), the rest at the next step;
    every row equals its request alone. Short prompts join all together (16 of 32 tokens)."""
    from ds_inference_integration.serve.steps import ADMISSION_BUDGET

    tokenizer = gpt2[1]
    model = _llama(tokenizer)
    specs = [RowSpec(tuple((7 * i + 3 * r) % 60 + 3 for i in range(1000)), max_new_tokens=3 + r, id=r,
                     ignore_eos=True) for r in range(6)]
    assert 4 * 1000 ** 2 <= ADMISSION_BUDGET < 5 * 1000 ** 2
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=8), Record()
    engine.take(Admit(0, BatchKey(), tuple(specs)))
    engine.step(answers)
    assert len(engine.running) == 4 and len(engine.waiting) == 2
    engine.step(answers)
    assert len(engine.running) == 6 and not engine.waiting
    _run(engine, {}, answers)
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
    short = StepEngine(model, tokenizer, "cpu", capacity=16)
    short.take(Admit(1, BatchKey(), tuple(RowSpec((5,) * 32, 4, id=100 + r) for r in range(16))))
    short.step(Record())
    assert len(short.running) == 16


def _multilingual(tmp_path):
    """A tiny random M2M100-style encoder-decoder whose word-level tokenizer has NLLB-style language codes among its
    special tokens (fra_Latn, deu_Latn, ron_Latn), saved: (model, tokenizer, its directory)."""
    import transformers as tr
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "</s>", "<unk>", "<s>", "fra_Latn", "deu_Latn", "ron_Latn"] + \
        "one two three four five six seven eight nine ten hundred thousand and".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = tr.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                           unk_token="<unk>", bos_token="<s>",
                                           additional_special_tokens=["fra_Latn", "deu_Latn", "ron_Latn"])
    torch.manual_seed(0)
    config = tr.M2M100Config(vocab_size=len(words), d_model=64, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                             decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                             bos_token_id=3, decoder_start_token_id=1)
    model = tr.M2M100ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "m2m")
    tokenizer.save_pretrained(tmp_path / "m2m")
    return model, tokenizer, tmp_path / "m2m"


def test_rows_of_different_target_languages_share_a_step_each_as_generate_alone(tmp_path):
    """A request's `target_lang` on a multilingual encoder-decoder: the language's token, as its tokenizer names it,
    forced as the decoder's first (NLLB's, M2M100's and mBART-50's way); rows of three languages and one without
    share steps, and each equals `generate` alone with that forced first token. (M2M100's decoder counts its
    positions over the tokens that are not padding: the start-up probe refused it, its per-row position table read
    with padding tokens.) A model without language codes, or a code it does not have, is one 400 line."""
    from ds_inference_integration.serve.app import Api
    from ds_inference_integration.serve.protocol import CompletionRequest, ModelLimits, ServeError

    model, tokenizer, _ = _multilingual(tmp_path)
    assert choose(model, tokenizer, "cpu", 4) == (None, {})  # the step engine serves it
    limits = ModelLimits(encoder_decoder=True, max_positions=60, max_source_positions=60, max_n=4, max_batch_size=4,
                         default_max_tokens=6, vocab_size=len(tokenizer))
    api = Api(None, tokenizer, "m2m", limits, None, model.generation_config)
    specs, want = [], {}
    for i, lang in enumerate(["fra_Latn", "deu_Latn", None, "ron_Latn"]):
        body = CompletionRequest(prompt="one hundred and " + ["two", "three", "four", "five"][i], max_tokens=6,
                                 temperature=0, **({"target_lang": lang} if lang else {}))
        key, rows = api.plan_completion(body)
        specs.append((key, rows[0].spec(i)))
        ids = torch.tensor([rows[0].prompt_ids])
        forced = {"forced_bos_token_id": tokenizer.convert_tokens_to_ids(lang)} if lang else {}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             num_beams=1, **forced)
        want[i] = out[0, 1:].tolist()
        if lang:
            assert want[i][0] == tokenizer.convert_tokens_to_ids(lang)
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=4), Record()
    _run(engine, {0: Admit(0, specs[0][0], (specs[0][1],)), 1: Admit(1, specs[1][0], (specs[1][1],)),
                  2: Admit(2, specs[2][0], (specs[2][1],)), 3: Admit(3, specs[3][0], (specs[3][1],))}, answers)
    assert max(len(c) for c in answers.counts) >= 3  # rows of different languages decoded in one step
    for i in range(4):
        got = answers.out[i][0]
        assert got == want[i][:len(got)] and (len(got) == 6 or got[-1] == tokenizer.eos_token_id), (i, got, want[i])
    for bad in ("spa_Latn", "one"):  # "one" is a word of the vocabulary, not a language
        with pytest.raises(ServeError, match=rf"^target_lang '{bad}' is not one of this model's language codes; "
                                             r"valid: fra_Latn, deu_Latn, ron_Latn$"):
            api.plan_completion(CompletionRequest(prompt="one", target_lang=bad))
    plain = Api(None, tokenizer, "m2m", ModelLimits(encoder_decoder=False, max_positions=60, max_source_positions=None,
                                                    max_n=4, max_batch_size=4, default_max_tokens=6,
                                                    vocab_size=len(tokenizer)), None, model.generation_config)
    with pytest.raises(ServeError, match=r"^target_lang 'fra_Latn': model 'm2m' has no language codes"):
        plain.plan_completion(CompletionRequest(prompt="one", target_lang="fra_Latn"))


def test_a_row_is_one_record_with_its_status_from_admission_to_answer(gpt2):
    """Every row the engine takes is one record (a beam request's beams too) whose status says where it is: waiting
    while the slots are full, running once admitted, then finished, cancelled (its client left) or failed (its own
    rules failed: every token masked), as the answers say."""
    model, tokenizer = gpt2
    ids = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:4]]
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=3), Record()
    everything = tuple(range(model.config.vocab_size))
    engine.take(Admit(0, BatchKey(), (RowSpec(ids[0], 6, id=0, ignore_eos=True),
                                      RowSpec(ids[1], 20, id=1, ignore_eos=True),
                                      RowSpec(ids[2], 6, id=2, min_tokens=3, stop_token_ids=everything))))
    engine.take(Admit(1, BatchKey(num_beams=2, num_return_sequences=1, max_new_tokens=4), (RowSpec(ids[3], 4, id=3),)))
    rows = {row.spec.id: row for row in engine.waiting}
    assert {i: r.status for i, r in rows.items()} == {i: Status.WAITING for i in range(4)}
    engine.step(answers)
    # row 2's stop ids held back with EOS cover every token: it fails at its first token; the beams wait for 2 slots
    assert {i: r.status for i, r in rows.items()} == {0: Status.RUNNING, 1: Status.RUNNING, 2: Status.FAILED,
                                                      3: Status.WAITING}
    assert "every token is masked" in answers.failures[2][1]
    engine.step(answers)  # row 2's slot is free, but the beams need two
    assert rows[3].status is Status.WAITING
    engine.cancel([1])
    engine.step(answers)  # row 1 leaves; the beams take its slot and row 2's
    assert rows[1].status is Status.CANCELLED and answers.out[1][1] == "cancelled"
    assert rows[3].status is Status.RUNNING and rows[3].group is not None
    assert sorted({r.spec.id for r in engine.running.values()}) == [0, 3]
    _run(engine, {}, answers)
    assert {i: r.status for i, r in rows.items()} == {0: Status.FINISHED, 1: Status.CANCELLED, 2: Status.FAILED,
                                                      3: Status.FINISHED}


def test_waiting_rows_join_by_tgis_rule(gpt2):
    """--waiting_served_ratio 1, --max_waiting_steps 3: one row arriving beside 4 running rows waits 3 steps, 4 rows
    arriving at once join at the next step (4 >= 1 x 4), a row arriving at an idle engine at once; each row's answer
    is still its answer alone."""
    model, tokenizer = gpt2
    ids = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:10]]
    engine = StepEngine(model, tokenizer, "cpu", capacity=10, waiting_served_ratio=1.0, max_waiting_steps=3)
    answers = Record()

    def running():
        return sorted(r.spec.id for r in engine.running.values())

    rows = [RowSpec(ids[i], max_new_tokens=30, ignore_eos=True, id=i) for i in range(10)]
    engine.take(Admit(0, BatchKey(), tuple(rows[:4])))
    engine.step(answers)
    assert running() == [0, 1, 2, 3]  # idle: at once
    engine.take(Admit(1, BatchKey(), (rows[4],)))
    for _ in range(2):
        engine.step(answers)
        assert 4 not in running()
    engine.step(answers)
    assert 4 in running()  # waited 3 steps
    engine.take(Admit(2, BatchKey(), tuple(rows[5:10])))
    engine.step(answers)
    assert running() == list(range(10))  # 5 waiting >= 1 x 5 running
    while engine.busy():
        engine.step(answers)
    for spec in rows:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec)


def test_the_step_loop_keeps_no_record_of_rows_answered_in_earlier_steps(gpt2, monkeypatch):
    """The leader's step loop, fed 40 one-row requests and then a stop as its front would feed it: every row is
    answered once, and what the loop keeps of the rows it answered is never more than one step's (a record kept for
    the server's life held every row id ever answered: memory that grew with every request)."""
    from ds_inference_integration.serve import engine as serve_engine
    from ds_inference_integration.serve.wire import Failed, Finished, Stop

    model, tokenizer = gpt2
    ids = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:40]]
    records = []

    class Kept(serve_engine.Answers):
        def __init__(self, control):
            super().__init__(control)
            records.append(self)

    class Front:
        """The leader's connection: one admission a poll while any is left, then (every row answered) Stop."""

        def __init__(self):
            self.admits = [Admit(i, BatchKey(), (RowSpec(ids[i], max_new_tokens=3, ignore_eos=True, id=i),))
                           for i in range(40)]
            self.finished = []
            self.polls, self.failed, self.stopped = 0, [], False

        def poll(self, timeout=0):
            self.polls += 1  # bounded: a loop that never answers them all is stopped after 2000 polls
            return (bool(self.admits) or len(self.finished) + len(self.failed) == 40 or self.polls > 2000) \
                and not self.stopped

        def recv(self):
            if self.admits:
                return self.admits.pop(0)
            self.stopped = True
            return Stop()

        def send(self, message):
            if isinstance(message, Finished):
                self.finished.append(message.row)
            elif isinstance(message, Failed):
                self.failed.append(message)

    monkeypatch.setattr(serve_engine, "Answers", Kept)
    front = Front()
    control = serve_engine.Control(front, None, 1)
    engine = StepEngine(model, tokenizer, "cpu", capacity=4)
    serve_engine.Serving(model, tokenizer, torch.device("cpu"), control, None, 1).steps_loop(engine)
    assert not front.failed and sorted(front.finished) == list(range(40))
    assert max(len(r.ended) for r in records) <= 4


def test_the_step_loop_shrinks_the_cache_once_idle_for_a_keepalive_not_between_a_clients_requests(gpt2):
    """Requests that come one after another each right after the last one's answer (a client alone) find the slot
    cache as the last left it (it was shrunk and grown again for each: 0.85x the batch engine's decoding at
    concurrency 1); a keep-alive interval with nothing coming shrinks it."""
    from ds_inference_integration.serve import engine as serve_engine
    from ds_inference_integration.serve.wire import Finished, Stop

    model, tokenizer = gpt2
    prompt = tuple(tokenizer(PROMPTS[0])["input_ids"])
    widths = []

    class Front:
        """One 40-token request a poll after the previous one's answer, 3 of them; then nothing for a poll (the
        keep-alive), then Stop."""

        def __init__(self):
            self.sent, self.finished, self.polls, self.quiet, self.stopped = 0, 0, 0, False, False

        def poll(self, timeout=0):
            self.polls += 1
            if self.stopped:
                return False
            if self.polls > 5000:
                return True  # bounded: Stop
            if self.finished < 3:
                return self.sent == self.finished  # the next request right after the last one's answer
            if not self.quiet:
                if timeout > 0:  # the idle loop's wait: nothing comes within the keep-alive interval
                    self.quiet = True
                    widths.append(engine.cache.layers[0].width())
                return False
            return timeout > 0  # then Stop, at the next wait (after the loop took the keep-alive)

        def recv(self):
            if self.sent < 3 and self.polls <= 5000:
                self.sent += 1
                widths.append(engine.cache.layers[0].width() if engine.cache is not None else 0)
                return Admit(self.sent, BatchKey(), (RowSpec(prompt, max_new_tokens=40, ignore_eos=True,
                                                             id=self.sent),))
            widths.append(engine.cache.layers[0].width())
            self.stopped = True
            return Stop()

        def send(self, message):
            if isinstance(message, Finished):
                self.finished += 1

    front = Front()
    engine = StepEngine(model, tokenizer, "cpu", capacity=4)
    serve_engine.Serving(model, tokenizer, torch.device("cpu"), serve_engine.Control(front, None, 1), None,
                         1).steps_loop(engine)
    assert front.finished == 3 and front.polls < 5000
    grown = max(widths)
    assert grown >= 64 and widths[2:4] == [grown, grown]  # the second and third requests found it as it was left
    assert widths[-1] == 16  # after the keep-alive: shrunk


def test_a_beam_rows_eos_is_kept_and_counted_as_a_greedy_rows(gpt2):
    """A beam request that ends at EOS: its sequence is generate's new tokens up to and with that EOS, in both
    engines, as a greedy row's is (so `completion_tokens` counts it alike; the text drops it as a special token)."""
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    eos = model.generation_config.eos_token_id
    key = BatchKey(num_beams=3, max_new_tokens=40)
    spec = RowSpec(tuple(tokenizer("translate English to Romanian: " + "forty-two")["input_ids"]), max_new_tokens=40)
    ids = torch.tensor([spec.prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=3, max_new_tokens=40)
    want = out[0, 1:].tolist()
    want = want[:want.index(eos) + 1]
    whole = run_batch(model, tokenizer, Admit(0, key, (spec,)), "cpu")
    assert whole["sequences"][0] == [want] and whole["finish"][0] == ["stop"], (whole, want)
    engine, answers = StepEngine(model, tokenizer, "cpu", 4), Kept()
    _run(engine, {0: Admit(0, key, (spec,))}, answers)
    assert answers.rows[0] == ([want], ["stop"])
    greedy = RowSpec(spec.prompt_ids, max_new_tokens=40)
    assert _alone(model, tokenizer, greedy)[0][-1] == eos  # a greedy row keeps its EOS


def _generate(**settings):
    return tuple((name, json.dumps(value)) for name, value in sorted(settings.items()))


@pytest.mark.parametrize("kind", ["gpt2", "t5", "bart"])
def test_beam_groups_and_generate_settings_join_running_rows_as_generate_alone(gpt2, bart, kind):
    """Beam requests (3 and 4 beams, 2 sequences returned, length penalties either way, a minimum, a stop string, a
    repetition penalty, early_stopping True and "never") and /generate's other settings (no-repeat n-grams, bad and
    suppressed words, an exponential length decay, a forced EOS, renormalised logits), greedy and sampled, join a
    step engine of 8 slots while greedy rows run, one admission a step: every request's sequences and reasons equal
    the batch engine's (one generate) on that request alone; beams are reordered within their own slots only."""
    model, tokenizer = {"gpt2": gpt2, "bart": bart}.get(kind, gpt2)
    if kind == "t5":
        model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    keys = [BatchKey(num_beams=3, max_new_tokens=10),
            BatchKey(num_beams=4, num_return_sequences=2, max_new_tokens=8, length_penalty=2.0),
            BatchKey(num_beams=2, max_new_tokens=12, min_tokens=5),
            BatchKey(num_beams=3, max_new_tokens=10, stop=("de",)),
            BatchKey(num_beams=3, max_new_tokens=10, length_penalty=-1.0, repetition_penalty=1.5),
            BatchKey(num_beams=3, max_new_tokens=10, generate=_generate(early_stopping=True, no_repeat_ngram_size=2)),
            BatchKey(num_beams=2, max_new_tokens=6, generate=_generate(early_stopping="never")),
            BatchKey(num_beams=2, max_new_tokens=10, generate=_generate(exponential_decay_length_penalty=[3, 1.5],
                                                                        forced_eos_token_id=1)),
            BatchKey(generate=_generate(no_repeat_ngram_size=2)),
            BatchKey(generate=_generate(bad_words_ids=[[5], [7]], suppress_tokens=[9])),
            BatchKey(generate=_generate(renormalize_logits=True, remove_invalid_values=True))]
    admits = []
    for i, key in enumerate(keys):
        sampled = [{}] if key.num_beams > 1 else [{}, {"temperature": 1.0, "seed": 5 + i, "top_k": 20}]
        for j, settings in enumerate(sampled):
            spec = RowSpec(tuple(tokenizer(PROMPTS[i + 11 * j])["input_ids"]), max_new_tokens=key.max_new_tokens or 12,
                           id=10 * i + j, **settings)
            admits.append(Admit(len(admits), key, (spec,)))
    greedy = tuple(RowSpec(tuple(tokenizer(PROMPTS[30 + j])["input_ids"]), max_new_tokens=6 + 5 * j, id=200 + j)
                   for j in range(4))
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=8), Record()
    engine.take(Admit(99, BatchKey(), greedy))
    arrivals = {1 + i: a for i, a in enumerate(admits)}
    steps = 0
    while arrivals or engine.busy():
        if steps in arrivals:
            engine.take(arrivals.pop(steps))
        engine.step(answers)
        steps += 1
        assert steps < 300
    assert not answers.failures, answers.failures
    for admit in admits:
        whole = run_batch(model, tokenizer, admit, "cpu")
        assert answers.whole[admit.rows[0].id] == (whole["sequences"][0], whole["finish"][0]), admit
    for spec in greedy:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec)


def test_an_encoder_decoder_beam_groups_beams_read_one_copy_of_its_cross_attention_keys():
    """A T5 beam request of 4 beams beside running rows: its cross-attention keys and values are written once, in its
    first slot; its other beams' slots read that one (`SlotCache.holder`) and hold none of their own (their rows of
    each cross-attention layer stay as the cache made them); its sequences equal generate's on it alone, and a row
    admitted after it into one of its freed slots reads its own."""
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(T5).eval(), AutoTokenizer.from_pretrained(T5)
    ids = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:4]]
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=6), Record()
    engine.take(Admit(0, BatchKey(), (RowSpec(ids[0], 12, id=0, ignore_eos=True),)))
    engine.step(answers)
    beams = Admit(1, BatchKey(num_beams=4, max_new_tokens=8), (RowSpec(ids[1], 8, id=1),))
    engine.take(beams)
    engine.step(answers)
    slots = sorted(s for s, row in engine.running.items() if row.group is not None)
    assert len(slots) == 4 and [engine.cache.holder[s] for s in slots] == [slots[0]] * 4
    for layer in engine.cache.cross.layers:
        assert layer.keys[slots[0]].abs().sum() > 0
        assert all(layer.keys[s].abs().sum() == 0 for s in slots[1:])  # never written: no copy
    _run(engine, {}, answers)
    assert not answers.failures
    whole = run_batch(model, tokenizer, beams, "cpu")
    assert answers.whole[1] == (whole["sequences"][0], whole["finish"][0])
    later = tuple(RowSpec(ids[j % 4], 5 + j, id=10 + j) for j in range(6))  # every slot, the beams' among them
    engine.take(Admit(2, BatchKey(), later))
    engine.step(answers)
    assert sorted(engine.running) == list(range(6)) and engine.cache.holder == list(range(6))
    _run(engine, {}, answers)
    for spec in (RowSpec(ids[0], 12, id=0, ignore_eos=True), *later):
        assert answers.out[spec.id] == _alone(model, tokenizer, spec)


def _zoo(name):
    from ds_inference_integration.load.skeleton import model_class_for
    from ds_inference_integration.tools.architecture_zoo import ZOO

    torch.manual_seed(0)
    config = ZOO[name]()
    return model_class_for(config).from_config(config).eval()


# every other state-keeping model of the zoo (make test-all; 19 of 19 equal alone, 2026-12-07, commit fb549e1)
MORE_STATES = ["mamba2_groups4", "falcon_mamba", "bamba", "falcon_h1_norm", "zamba", "zamba2", "qwen3_5_text", "lfm2",
               "lfm2_moe", "nemotron_h", "granitemoehybrid", "kimi_linear", "olmo_hybrid", "bailing_hybrid"]


@pytest.mark.parametrize("name", ["mamba", "mamba2", "jamba", "falcon_h1", "qwen3_next",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in MORE_STATES)])
def test_state_space_and_hybrid_rows_each_get_their_answer_alone(gpt2, name):
    """Models that keep states (`slots.SlotStateLayer`) on the step engine: a pure state-space model (Mamba, Mamba2),
    hybrids with Mamba layers beside attention layers (Jamba), with both in one layer (Falcon-H1) and with gated delta
    nets (Qwen3-Next). 16 rows of 1 to 40 prompt tokens and 1 to 30 new ones, greedy and sampled with seeds, arrive
    in five admissions into 8 slots (so that rows join under running ones, in slots freed below them) and a beam
    request among them: every row's tokens and reason equal the batch engine's answer to that request alone (one
    generate), and the probe passes (so the server runs these models on the step engine)."""
    model, tokenizer = _zoo(name), gpt2[1]
    assert probe(model, tokenizer, "cpu") is None
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    specs = []
    for i in range(16):
        length = (1, 2, 3, 40, 7, 17, 5, 29, 11, 1, 23, 4, 36, 9, 13, 2)[i]
        prompt = tuple(torch.randint(3, vocab, (length,), generator=generator).tolist())
        settings = {"temperature": 1.0, "top_k": 20, "seed": 7 + i} if i % 4 == 1 else {}
        specs.append(RowSpec(prompt, max_new_tokens=(30, 3, 12, 8, 1, 20, 6, 15)[i % 8], id=i, ignore_eos=True,
                             **settings))
    arrivals = {0: Admit(0, BatchKey(), tuple(specs[:6])), 2: Admit(1, BatchKey(), tuple(specs[6:8])),
                5: Admit(2, BatchKey(), tuple(specs[8:12])), 9: Admit(3, BatchKey(), tuple(specs[12:15])),
                14: Admit(4, BatchKey(), (specs[15],))}
    beams = Admit(5, BatchKey(num_beams=2, max_new_tokens=6), (RowSpec(specs[3].prompt_ids, 6, id=99),))
    arrivals[4] = beams
    engine, answers = StepEngine(model, tokenizer, "cpu", capacity=8), Record()
    assert engine.states
    _run(engine, arrivals, answers)
    assert not answers.failures, answers.failures
    assert isinstance(engine.cache, SlotCache) and engine.cache.states
    for spec in specs:
        assert answers.out[spec.id] == _alone(model, tokenizer, spec), spec
    whole = run_batch(model, tokenizer, beams, "cpu")
    assert answers.whole[99] == (whole["sequences"][0], whole["finish"][0])
    assert len({tuple(answers.out[s.id][0]) for s in specs}) > 8  # the rows' answers are their own, not one answer
    assert any(len(set(c.values())) > 1 for c in answers.counts), "no step held rows of different lengths"


# ---- launched: a server with --scheduler continuous at tp 2

@pytest.mark.launched
@pytest.mark.parametrize("name", ["jamba", pytest.param("mamba", marks=pytest.mark.slow)])
def test_a_state_space_model_is_served_continuously_at_tp_2_as_one_process(tmp_path, name):
    """A hybrid (Jamba: Mamba layers, attention and experts) and a pure state-space model (Mamba; `make test-all`:
    the same path without attention) at tp 2 with --scheduler continuous: the step engine serves it (said at start),
    and 16 concurrent clients' requests of 1 to 24 prompt words and 2 to 30 tokens, greedy and seeded sampling,
    each get what the unsharded model generates for that request alone."""
    from ds_inference_integration.load.skeleton import model_class_for
    from ds_inference_integration.tools.architecture_zoo import ZOO

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    config = ZOO[name]()
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = model_class_for(config).from_config(config).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = ServerProc(path, ["--tp_size", "2", "--inference_timeout", "60", "--scheduler", "continuous",
                               "--max_batch_size", "16"], tmp_path, 2)
    try:
        server.wait_ready()
        assert "scheduler continuous" in server.output() and "served by the batch engine" not in server.output()
        words = " ".join(PROMPTS).split()
        bodies = []
        for i in range(16):
            prompt = " ".join(words[7 * i:7 * i + (1, 20, 3, 15, 9, 24, 2, 12)[i % 8]])  # within 64 positions
            body = {"prompt": prompt, "max_tokens": (30, 2, 17, 8, 25, 5, 12, 20)[i % 8], "ignore_eos": True}
            body.update({"temperature": 1.0, "top_k": 20, "seed": 3 + i} if i % 3 == 2 else {"temperature": 0})
            bodies.append(body)
        got = post_all(server.url + "/v1/completions", bodies, concurrency=16)
        for body, (status, answer) in zip(bodies, got):
            assert status == 200, answer
            spec = RowSpec(tuple(tokenizer(body["prompt"])["input_ids"]), max_new_tokens=body["max_tokens"],
                           temperature=body["temperature"], top_k=body.get("top_k", 0), seed=body.get("seed", 0),
                           ignore_eos=True)
            want = tokenizer.decode(_alone(model, tokenizer, spec)[0], skip_special_tokens=True)
            assert answer["choices"][0]["text"].strip() == want.strip(), (body, answer)
        assert len({answer["choices"][0]["text"] for _, answer in got}) > 8
    finally:
        server.stop()


@pytest.mark.launched
def test_a_continuous_server_answers_as_one_process_and_never_makes_a_short_row_wait(tmp_path):
    """A tiny GQA Llama at tp 2, --scheduler continuous (said at start) with 8 slots: 24 prompts from 8 clients,
    greedy and seeded sampling, each equal to that prompt generated alone by the unsharded model; a beam request (a
    group of slots among the rows) equal too. While a 300-token row streams, an 8-token request is answered in about
    its own time (the batch engine made it wait for the long row); 8 clients that leave their 3000-token streams
    free every slot at the next step; a rank killed mid-row ends the server (503, exit 3). (SIGTERM with a row
    running is test_serve.py's module server's end; a second server here, of one slot, cost 13 CPU-s of a suite over
    its 10 minutes, 2026-12-06.)"""
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    path = tmp_path / "llama"
    model = _llama(tokenizer, path)
    server = ServerProc(path, ["--tp_size", "2", "--inference_timeout", "60", "--scheduler", "continuous",
                               "--max_batch_size", "8"], tmp_path, 2)
    url = server.url + "/v1/completions"
    try:
        server.wait_ready()
        assert "scheduler continuous" in server.output() and "served by the batch engine" not in server.output()
        assert "admissions in the running rows' step" in server.output()  # tp 2: fused (`StepEngine.fuse`)
        bodies = [{"prompt": p, "max_tokens": 4 + i % 13, "temperature": 0, "ignore_eos": True}
                  for i, p in enumerate(PROMPTS[:16])]
        bodies += [{"prompt": p, "max_tokens": 10, "temperature": 1.0, "top_k": 20, "seed": 7 + i}
                   for i, p in enumerate(PROMPTS[16:24])]
        got = post_all(url, bodies, concurrency=8)
        for body, (status, answer) in zip(bodies, got):
            assert status == 200, answer
            spec = RowSpec(tuple(tokenizer(body["prompt"])["input_ids"]), max_new_tokens=body["max_tokens"],
                           temperature=body["temperature"], top_k=body.get("top_k", 0), seed=body.get("seed", 0),
                           ignore_eos=body.get("ignore_eos", False))
            want = tokenizer.decode(_alone(model, tokenizer, spec)[0], skip_special_tokens=True)
            assert answer["choices"][0]["text"].strip() == want.strip(), (body, answer)
        status, beam = post(server.url + "/generate", {"inputs": PROMPTS[0], "parameters": {
            "num_beams": 3, "max_new_tokens": 6}})
        whole = run_batch(model, tokenizer, Admit(0, BatchKey(num_beams=3, max_new_tokens=6), (RowSpec(
            tuple(tokenizer(PROMPTS[0])["input_ids"]), max_new_tokens=6),)), "cpu")["sequences"][0][0]
        assert status == 200 and beam["generated_text"].strip() == tokenizer.decode(whole).strip(), beam

        short = {"prompt": PROMPTS[1], "max_tokens": 8, "ignore_eos": True}
        start = time.monotonic()
        assert post(url, short)[0] == 200
        alone = time.monotonic() - start
        long_answer = {}
        # 300 tokens: 5-9 s of steps at tp 2 here, well past the second and the short request it is measured over
        # (1000 cost 20 CPU-s more of a suite at its 10 minutes, 2026-12-06); the test says so if it ended first
        long_client = threading.Thread(target=lambda: long_answer.update(r=request("POST", url, {
            "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True}, timeout=300)))
        long_client.start()
        time.sleep(1.0)
        start = time.monotonic()
        assert post(url, short)[0] == 200
        beside = time.monotonic() - start
        assert beside < max(2.0, 10 * alone), (alone, beside)
        assert long_client.is_alive(), "the long row ended first: this measured nothing"
        long_client.join(300)
        assert long_answer["r"][0] == 200 and long_answer["r"][1]["usage"]["completion_tokens"] == 300

        # every slot taken by a stream whose client leaves: the slots are free at the next step
        clients = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(8)]
        try:
            for client in clients:
                post_on(client, {"prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True, "stream": True})
            for client in clients:
                assert client.recv(200).startswith(b"HTTP/1.1 200")
            time.sleep(0.5)
        finally:
            for client in clients:
                client.close()
        start = time.monotonic()
        assert post(url, short)[0] == 200
        assert time.monotonic() - start < max(2.0, 10 * alone)  # the left rows' slots were freed at their next step

        answers: list = []
        client = threading.Thread(target=lambda: answers.append(request("POST", url, {
            "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True}, timeout=60)))
        client.start()
        time.sleep(0.5)
        os.kill(server.ranks()[-1], signal.SIGKILL)  # a rank dies mid-row: the request 503, the server ends non-zero
        client.join(60)
        status, body, headers = answers[0]
        assert status == 503 and headers.get("x-should-retry") == "false", answers
        assert "exited" in body["error"]["message"], body
        health, _, _ = request("GET", server.url + "/health", timeout=5)
        assert health in (503, 0), health  # answering 503 on its way out, or gone
        assert server.proc.wait(30) == 3, server.output()[-2000:]
        # the rank killed, or its peer whose all-reduce it broke: whichever the front saw end first
        assert re.search(r"error: replica 0 rank [01] exited", server.output()), server.output()[-2000:]
    finally:
        server.stop()
    assert not server.group_alive()


def test_bench_steps_writes_its_figures(tmp_path):
    """`ds-inference bench steps` on a tiny model, once: every point has its admission and step times and ratios."""
    from ds_inference_integration.tools.bench_steps import run_bench_steps

    results = run_bench_steps([4, 8], [1, 2], 1, 64, 1, tmp_path, together=3)
    assert {(p["prompt_tokens"], p["running_rows"]) for p in results["points"]} == {(4, 1), (4, 2), (8, 1), (8, 2)}
    assert all(p["admission_ms"]["median"] > 0 and p["step_ms"]["median"] > 0 for p in results["points"])
    assert [(t["prompt_tokens"], t["rows"]) for t in results["together"]] == [(4, 3), (8, 3)]
    assert all(t["together_ms"]["median"] > 0 and t["together_vs_one"]["median"] > 0 for t in results["together"])
    table = (tmp_path / "bench_steps.md").read_text()
    assert "| 8 | 2 |" in table and "3 rows of L/4 to L together" in table
    # bench serve's T5 (an encoder-decoder's admission: its encoder and cross-attention keys)
    results = run_bench_steps([4], [1], 1, 64, 1, tmp_path / "t5", together=2, model_name="t5")
    assert "the embedded T5" in results["model"] and results["together"][0]["together_ms"]["median"] > 0


def test_t5s_per_row_position_bias_is_its_own_compute_bias_for_each_row_at_any_reach():
    """The relative position bias of rows at their own positions, read from the table of every relative position
    (`DecoderPositions._bias_table`), is bit for bit the module's own `compute_bias` of each row alone: one query
    and several, keys past the table's first reach (it grows), positions far past T5's max_distance."""
    model = AutoModelForSeq2SeqLM.from_pretrained(T5).eval()
    positions = DecoderPositions(model)
    module = positions.biases[0]
    for rows, query, key in (([0, 3, 17, 90], 1, 91), ([5, 300], 1, 301), ([2, 700, 41], 3, 704)):
        with torch.no_grad(), positions.per_row(rows):
            got = module.compute_bias(query, key)
        want = torch.cat([type(module).compute_bias(module, query, key, past_seen_tokens=p) for p in rows])
        assert got.shape == want.shape == (len(rows), model.config.num_heads, query, key)
        assert torch.equal(got, want)
