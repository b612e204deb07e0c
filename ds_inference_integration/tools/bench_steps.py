"""`ds-inference bench steps`: what the step engine's admission and decoding step cost, in this process (one rank,
no server), on a random Llama built from a config (grouped-query attention, rotary positions; no download).

- admission: the time to admit one row of L prompt tokens (its prefill alone and the copy into its slot) while B
  rows are running, for each L and B; the claim checked: the cost grows with the admitted row (L), not with the
  batch (B). Reported as the ratio of each B's time to B=1's at the same L.
- decoding step: the time of one step for B running rows of ~L tokens, against B single-row steps (the speed-up a
  shared step gives).
- rows admitted together: the time to admit `--together` N rows at once (prompts of L/4 to L tokens, prefilled in
  one forward) beside one running row, against one row of L tokens admitted alone: what an admission of N costs
  against one.

Each figure is the median of `--repeats` (with min-max), every configuration measured in one run, alternating.

    ds-inference bench steps [--lengths 16,256,1024] [--batches 1,8,31] [--together 16] [--repeats 5]
                             [--model llama|gpt2-256|t5]

An encoder-decoder's admission, once rows run, is its rows' encoder and their cross-attention keys written into
their slots: their first decoder step is the next decoding step's, shared with the running rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..run.files import write_text_atomic
from .bench import spread


def _model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=8192, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return AutoModelForCausalLM.from_config(config).eval()


class TokenIds:
    """What the step engine asks of a tokenizer where rows are token ids without stop strings (the GPU check's
    decode section uses it too)."""

    pad_token_id = 0

    def __len__(self):
        return 1 << 30

    def decode(self, ids, **kwargs):
        return ""


def _admission(engine, rows) -> None:
    """Rows admitted as a step admits them: prefilled (`StepEngine._admit`), each given its first token."""
    from ..serve.steps import Kept

    answers = Kept()
    first, _ = engine._admit(rows, answers)
    for row, logits, _ in first:
        engine._next(row, logits, {}, answers)


# `--model`: the random Llama (`--hidden`, `--layers`), or one of `bench serve`'s models
MODELS = ("llama", "gpt2-256", "t5")


def _served_model(name: str):
    """`bench serve`'s model of that name, as it serves it: gpt2-256 (built from the embedded GPT-2's config, random
    weights, seed 0) or the embedded T5."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from .bench import REPO

    models = REPO / "examples" / "models"
    if name == "t5":
        return AutoModelForSeq2SeqLM.from_pretrained(models / "t5-num2words-en-ro").eval(), "the embedded T5"
    config = AutoConfig.from_pretrained(models / "gpt2-num2words-en-ro", n_layer=2, n_positions=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), "gpt2-256 (bench serve's: GPT-2 width 128, 2 layers)"


def run_bench_steps(lengths: list[int], batches: list[int], repeats: int, hidden: int, layers: int,
                    output_dir: Path, together: int = 16, model_name: str = "llama") -> dict:
    import torch

    from ..serve.steps import Kept, StepEngine
    from ..serve.wire import Admit, BatchKey, RowSpec

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if model_name == "llama":
        vocab = 1024
        model = _model(hidden, layers, vocab)
        described = f"random Llama, hidden {hidden}, {layers} layers"
    else:
        model, described = _served_model(model_name)
        vocab = model.config.vocab_size
    capacity = max(max(batches), together) + 1
    key = BatchKey()

    def prompt(n, salt):
        return tuple((7 * i + salt) % (vocab - 3) + 3 for i in range(n))

    def engine_with(b: int, length: int) -> StepEngine:
        engine = StepEngine(model, TokenIds(), "cpu", capacity)
        engine.take(Admit(0, key, tuple(RowSpec(prompt(length, r), max_new_tokens=10_000, ignore_eos=True, id=r)
                                        for r in range(b))))
        engine.step(Kept())  # b rows prefilled and running, each with its first token
        return engine

    admission = {(length, b): [] for length in lengths for b in batches}
    step = {(length, b): [] for length in lengths for b in batches}
    joint = {(length, n): [] for length in lengths for n in (1, together)}
    for _ in range(repeats):
        for length in lengths:
            for n in (1, together):  # n rows admitted at once beside one running row
                engine = engine_with(1, length)
                for layer in engine.cache.attention:
                    layer.grow(2 * length + 8)
                sizes = [length] if n == 1 else [max(1, length // 4 + (length - length // 4) * r // (n - 1))
                                                  for r in range(n)]
                engine.take(Admit(1, key, tuple(RowSpec(prompt(size, 50 + r), max_new_tokens=10_000,
                                                        ignore_eos=True, id=10_000 + r) for r, size in enumerate(sizes))))
                rows = [engine.waiting.popleft() for _ in sizes]
                start = time.perf_counter()
                _admission(engine, rows)
                joint[(length, n)].append((time.perf_counter() - start) * 1000)
            for b in batches:
                engine = engine_with(b, length)
                for layer in engine.cache.attention:
                    layer.grow(2 * length + 8)  # no growth inside the timed parts
                start = time.perf_counter()
                engine.step(Kept())  # one decoding step of b rows
                step[(length, b)].append((time.perf_counter() - start) * 1000)
                engine.take(Admit(1, key, (RowSpec(prompt(length, 99), max_new_tokens=10_000, ignore_eos=True,
                                                   id=10_000),)))
                start = time.perf_counter()
                _admission(engine, [engine.waiting.popleft()])  # the admission alone, no decoding step after it
                admission[(length, b)].append((time.perf_counter() - start) * 1000)
    results = {"command": "ds-inference bench steps " + " ".join(sys.argv[3:]), "date": time.strftime("%Y-%m-%d"),
               "model": f"{described}, fp32, 1 rank",
               "threads": torch.get_num_threads(), "repeats": repeats, "points": []}
    for length in lengths:
        for b in batches:
            results["points"].append({
                "prompt_tokens": length, "running_rows": b,
                "admission_ms": spread(admission[(length, b)]),
                "admission_vs_one_running": spread([a / o for a, o in zip(admission[(length, b)],
                                                                          admission[(length, batches[0])])]),
                "step_ms": spread(step[(length, b)]),
                "step_per_row_vs_alone": spread([s / b / o for s, o in zip(step[(length, b)],
                                                                           step[(length, batches[0])])])})
    results["together"] = [{"prompt_tokens": length, "rows": together,
                            "one_ms": spread(joint[(length, 1)]), "together_ms": spread(joint[(length, together)]),
                            "together_vs_one": spread([t / o for t, o in zip(joint[(length, together)],
                                                                             joint[(length, 1)])])}
                           for length in lengths]
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output_dir / "bench_steps.json", json.dumps(results, indent=1) + "\n")
    write_text_atomic(output_dir / "bench_steps.md", _table(results))
    return results


def _table(results: dict) -> str:
    lines = [f"`{results['command']}` ({results['date']}, {results['model']}, {results['threads']} threads, medians "
             f"of {results['repeats']} with min-max)", "",
             "| prompt tokens | running rows | admission ms | admission / with 1 running | step ms | step per row / "
             "alone |", "|---|---|---|---|---|---|"]
    def f(s, scale=1.0):
        return f"{s['median'] * scale:.2f} ({s['min'] * scale:.2f}-{s['max'] * scale:.2f})"

    for p in results["points"]:
        lines.append(f"| {p['prompt_tokens']} | {p['running_rows']} | {f(p['admission_ms'])} | "
                     f"{f(p['admission_vs_one_running'])} | {f(p['step_ms'])} | {f(p['step_per_row_vs_alone'])} |")
    if results.get("together"):
        n = results["together"][0]["rows"]
        lines += ["", f"| prompt tokens (L) | one row of L, ms | {n} rows of L/4 to L together, ms | together / one |",
                  "|---|---|---|---|"]
        for t in results["together"]:
            lines.append(f"| {t['prompt_tokens']} | {f(t['one_ms'])} | {f(t['together_ms'])} | "
                         f"{f(t['together_vs_one'])} |")
    return "\n".join(lines) + "\n"
