"""Benchmarks, each a side-by-side measurement in one run.

    ds-inference bench guard [--repeats 3] [--nprocs 2]
        predict on the embedded default under the deepspeed launcher, lock-step guard on and off,
        alternating; prints and writes bench_guard.json with the runtimes and the guard's share.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import InferenceSetupError
from ..memory import PeakRss
from ..topology import threads_per_rank

REPO = Path(__file__).resolve().parents[2]  # the checkout: ds_inference_integration/tools/bench.py
RUN_TRANSLATION = REPO / "examples" / "run_translation.py"


def example_path(path: Path, command: str, instead: str = "") -> Path:
    """`path` under the repository's examples/, which a wheel does not install: one line saying so otherwise."""
    if path.exists():
        return path
    raise InferenceSetupError(f"{command} needs {path.relative_to(REPO)} from the repository, which is not "
                              f"installed with the package (not found at {path}): run it from a checkout"
                              + (f", or pass {instead}" if instead else ""))


def _predict(nprocs: int, extra: list[str], out: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), str(RUN_TRANSLATION),
           "--output_dir", str(out), "--do_predict", "--predict_with_generate", "--source_lang", "en",
           "--target_lang", "ro", "--source_prefix", "translate English to Romanian: ",
           "--per_device_eval_batch_size", "16", "--report_to", "none", "--deepspeed_inference", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads((out / "predict_results.json").read_text())


def bench_guard(repeats: int, nprocs: int, output: Path) -> int:
    example_path(RUN_TRANSLATION, "ds-inference bench guard")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for guard in ("true", "false"):
                m = _predict(nprocs, ["--lockstep_guard", guard], Path(tmp) / f"{guard}{i}")
                rows.append({"guard": guard == "true", "repeat": i, "predict_runtime": m["predict_runtime"],
                             "guard_seconds": m.get("predict_lockstep_guard_seconds", 0.0),
                             "samples": m["predict_samples"]})
    on = [r["predict_runtime"] for r in rows if r["guard"]]
    off = [r["predict_runtime"] for r in rows if not r["guard"]]
    share = statistics.median(r["guard_seconds"] / r["predict_runtime"] for r in rows if r["guard"])
    summary = {"rows": rows, "median_runtime_guard_on": statistics.median(on),
               "median_runtime_guard_off": statistics.median(off),
               "runtime_ratio_on_over_off": statistics.median(on) / statistics.median(off),
               "median_guard_share_of_predict": share, "nprocs": nprocs,
               "command": f"ds-inference bench guard --repeats {repeats} --nprocs {nprocs}"}
    output.write_text(json.dumps(summary, indent=2))
    print(f"predict on the embedded default, tp {nprocs}, {rows[0]['samples']} examples, {repeats} repeats each")
    print(f"median runtime: guard on {summary['median_runtime_guard_on']:.3f} s, "
          f"off {summary['median_runtime_guard_off']:.3f} s, ratio {summary['runtime_ratio_on_over_off']:.3f}")
    print(f"guard's own time: {share:.2%} of predict time (median) -> {output}")
    return 0


# Generation: per-sample pipeline vs batched generate vs the Trainer path (single process and tp 2) -------

METHODS = ("pipeline_per_sample", "pipeline_batched", "generate_loop", "trainer", "trainer_tp2")
DEFAULT_LM = REPO / "examples" / "models" / "gpt2-num2words-en-ro"
DEFAULT_PROMPTS = REPO / "examples" / "data" / "prompts.txt"


def _in_process(method: str, model, tokenizer, prompts: list[str], batch_size: int, new_tokens: int) -> tuple[float, int]:
    """Seconds and new tokens for one in-process method."""
    import time

    import torch
    from transformers import pipeline

    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    if method.startswith("pipeline"):
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device=model.device)
        kwargs = {"batch_size": batch_size} if method == "pipeline_batched" else {}
        outputs = pipe(prompts, return_full_text=False, **kwargs, **gen)
        assert len(outputs) == len(prompts)
        return time.perf_counter() - start, len(prompts) * new_tokens  # min_new_tokens = max_new_tokens
    if method == "generate_loop":
        count = 0
        with torch.no_grad():
            for i in range(0, len(prompts), batch_size):
                enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True).to(model.device)
                out = model.generate(**enc, **gen)
                count += out[:, enc["input_ids"].shape[1]:].numel()
        return time.perf_counter() - start, count
    raise ValueError(method)


def _trainer(model, tokenizer, prompts: list[str], batch_size: int, new_tokens: int) -> tuple[float, int]:
    import tempfile
    import time

    import torch
    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Seq2SeqTrainingArguments

    from ..trainer import DeepSpeedInferenceSeq2SeqTrainer

    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as output_dir:
        args = Seq2SeqTrainingArguments(output_dir=output_dir, per_device_eval_batch_size=batch_size,
                                        predict_with_generate=True, remove_unused_columns=False, report_to=[],
                                        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = DeepSpeedInferenceSeq2SeqTrainer(model=model, args=args, processing_class=tokenizer,
                                                   data_collator=DataCollatorWithPadding(tokenizer))
        dataset = Dataset.from_dict(dict(tokenizer(prompts)))
        start = time.perf_counter()
        out = trainer.predict(dataset, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    assert out.predictions.shape[0] == len(prompts) and out.predictions.shape[1] >= new_tokens
    return seconds, len(prompts) * new_tokens  # min_new_tokens = max_new_tokens


def _trainer_tp2(model_dir: Path, prompts_file: Path, batch_size: int, new_tokens: int, max_prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
               str(REPO / "examples" / "run_generation.py"), "--output_dir", tmp, "--model_name_or_path",
               str(model_dir), "--prompts_file", str(prompts_file), "--max_prompts", str(max_prompts),
               "--per_device_eval_batch_size", str(batch_size), "--max_new_tokens", str(new_tokens),
               "--min_new_tokens", str(new_tokens), "--report_to", "none", "--disable_tqdm", "true",
               "--deepspeed_inference"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not _cuda():
            env["OMP_NUM_THREADS"] = str(threads_per_rank(2))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"tp2 run failed: {(proc.stdout + proc.stderr)[-2000:]}")
        return json.loads((Path(tmp) / "predict_results.json").read_text())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _config_model(tokenizer, out: Path, spec: str) -> Path:
    """A random GPT-2 of the size `spec` ("n_embd,n_layer,n_head") with the embedded tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_embd, n_layer, n_head = (int(x) for x in spec.split(","))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=128,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def bench_generation(model_dir: str | None, config_spec: str | None, batch_sizes: list[int], prompts_file: str,
                     max_prompts: int, new_tokens: int, out_dir: Path, methods: list[str], repeats: int = 3) -> int:
    from transformers import AutoTokenizer

    if not Path(prompts_file).is_file():
        if Path(prompts_file) == DEFAULT_PROMPTS:
            example_path(DEFAULT_PROMPTS, "ds-inference bench generation", "--prompts FILE")
        raise InferenceSetupError(f"--prompts {prompts_file!r} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = [p for p in Path(prompts_file).read_text(encoding="utf-8").splitlines() if p.strip()][:max_prompts]
    model_dir = model_dir or example_path(DEFAULT_LM, "ds-inference bench generation", "--model MODEL_DIR")
    if "trainer_tp2" in methods:
        example_path(REPO / "examples" / "run_generation.py", "ds-inference bench generation's trainer_tp2",
                     "--methods without trainer_tp2")
    base_tok = AutoTokenizer.from_pretrained(model_dir)
    models = {"embedded": Path(model_dir)}
    with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:  # the --config model: removed at the end
        return _bench_generation(models, base_tok, Path(tmp), config_spec, batch_sizes, prompts, prompts_file,
                                 max_prompts, new_tokens, out_dir, methods, repeats)


def _bench_generation(models, base_tok, tmp, config_spec, batch_sizes, prompts, prompts_file, max_prompts,
                      new_tokens, out_dir, methods, repeats) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config_spec:
        models[f"config({config_spec})"] = _config_model(base_tok, tmp / "config_model", config_spec)
    rows = []
    for label, path in models.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if _cuda():
            model = model.cuda()
        n_params = sum(p.numel() for p in model.parameters())
        _in_process("generate_loop", model, tokenizer, prompts[:2], 2, 2)  # warm-up, untimed
        for bs in batch_sizes:
            for method in methods:
                if method == "pipeline_per_sample" and bs != batch_sizes[0]:
                    continue  # it has no batch size: measured once
                if method == "trainer_tp2":
                    m = _trainer_tp2(path, Path(prompts_file), bs, new_tokens, max_prompts)
                    seconds, count = m["predict_runtime"], m["predict_outputs"] * new_tokens
                    rss = [float(x) for x in m["predict_peak_rss_mb_per_rank"].split(",")]
                else:
                    runs = []
                    with PeakRss() as peak:
                        for _ in range(repeats):  # the median of `repeats` runs: single runs of < 1 s are noise
                            if method == "trainer":
                                runs.append(_trainer(model, tokenizer, prompts, bs, new_tokens))
                            else:
                                runs.append(_in_process(method, model, tokenizer, prompts, bs, new_tokens))
                    seconds, count = sorted(runs)[len(runs) // 2]
                    rss = [peak.mb]
                row = {"model": label, "params_m": round(n_params / 1e6, 2), "method": method,
                       "batch_size": None if method == "pipeline_per_sample" else bs, "seconds": round(seconds, 4),
                       "new_tokens": count, "tokens_per_s": round(count / seconds, 1), "peak_rss_mb": rss}
                rows.append(row)
                print(f"{label:<22} {method:<20} bs {str(row['batch_size']):>4}  {row['seconds']:8.3f} s  "
                      f"{row['tokens_per_s']:9.1f} tok/s", flush=True)
    _write_report(rows, out_dir, dict(prompts=len(prompts), new_tokens=new_tokens, batch_sizes=batch_sizes,
                                      repeats=repeats))
    return 0


def _ratio(rows, model, num, den, bs):
    def tps(method):
        for r in rows:
            if r["model"] == model and r["method"] == method and r["batch_size"] in (bs, None):
                return r["tokens_per_s"]
        return None
    a, b = tps(num), tps(den)
    return round(a / b, 2) if a and b else None


def _write_report(rows: list[dict], out_dir: Path, setup: dict) -> None:
    models = sorted({r["model"] for r in rows}, key=lambda m: m != "embedded")
    ratios = {}
    for model in models:
        ratios[model] = {
            "generate_loop_over_pipeline_per_sample_bs8": _ratio(rows, model, "generate_loop", "pipeline_per_sample", 8),
            "trainer_over_generate_loop_bs8": _ratio(rows, model, "trainer", "generate_loop", 8),
            "trainer_tp2_over_trainer_bs8": _ratio(rows, model, "trainer_tp2", "trainer", 8),
        }
    (out_dir / "bench.json").write_text(json.dumps({"setup": setup, "rows": rows, "ratios": ratios}, indent=2))
    lines = [f"Prompts: {setup['prompts']}, {setup['new_tokens']} new tokens each (greedy, min = max new tokens); "
             f"in-process methods: median of {setup.get('repeats', 1)} runs; trainer_tp2: one launch, its predict "
             "runtime.", ""]
    lines += ["| model | method | batch | seconds | new tokens | tokens/s | peak RSS MB (per rank) |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['batch_size'] or '-'} | {r['seconds']:.3f} | "
                     f"{r['new_tokens']} | {r['tokens_per_s']:.1f} | {', '.join(map(str, r['peak_rss_mb']))} |")
    lines += ["", "| model | ratio | value |", "|---|---|---|"]
    for model, rs in ratios.items():
        for name, value in rs.items():
            lines.append(f"| {model} | {name} | {value} |")
    (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in METHODS:
            pts = [(r["batch_size"], r["tokens_per_s"]) for r in rows if r["model"] == model and r["method"] == method]
            if not pts:
                continue
            if method == "pipeline_per_sample":  # no batch size: a flat line
                xs = sorted({r["batch_size"] for r in rows if r["batch_size"]})
                ax.plot(xs, [pts[0][1]] * len(xs), "--", label=method)
            else:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("new tokens / s")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
