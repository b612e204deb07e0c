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
import time
from pathlib import Path

from ..errors import InferenceSetupError
from ..extras import optional_import
from ..load.own_code import trusted
from ..run.memory import PeakRss
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


def spread(values) -> dict:
    """min / median / max of a benchmark's repeats (and how many): one run of `bench generation` gave 4.45x where
    the median of three gave 6.54x, so no ratio is reported without the spread of its repeats."""
    values = sorted(float(v) for v in values)
    return {"min": round(values[0], 4), "median": round(statistics.median(values), 4), "max": round(values[-1], 4),
            "n": len(values)}


def spread_text(s: dict) -> str:
    return f"{s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}, {s['n']} repeats)"


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
    optional_import("datasets", "ds-inference bench guard (it runs examples/run_translation.py)")
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
               # repeat i on over repeat i off (run one after the other), and the spread of those ratios
               "runtime_ratio_on_over_off": spread(a / b for a, b in zip(on, off)),
               "guard_share_of_predict": spread(r["guard_seconds"] / r["predict_runtime"] for r in rows if r["guard"]),
               "median_guard_share_of_predict": share, "nprocs": nprocs,
               "command": f"ds-inference bench guard --repeats {repeats} --nprocs {nprocs}"}
    output.write_text(json.dumps(summary, indent=2))
    print(f"predict on the embedded default, tp {nprocs}, {rows[0]['samples']} examples, {repeats} repeats each")
    print(f"median runtime: guard on {summary['median_runtime_guard_on']:.3f} s, "
          f"off {summary['median_runtime_guard_off']:.3f} s")
    print(f"runtime ratio on / off: {spread_text(summary['runtime_ratio_on_over_off'])}")
    print(f"guard's own time, share of predict time: {spread_text(summary['guard_share_of_predict'])} -> {output}")
    return 0


# Generation: per-sample pipeline vs batched generate vs the Trainer path (single process and tp 2) -------

METHODS = ("pipeline_per_sample", "pipeline_batched", "generate_loop", "trainer", "trainer_streaming", "generate_loop_tp2",
           "trainer_tp2", "trainer_streaming_tp2")
# trainer_streaming_tp2 also reports its paired baseline under this name: the bare loop run in the same two ranks,
# on the same sharded model, alternating with predict_to_file (loop, predict, predict, loop in each launch), so
# that the ratio of the two is not the ratio of two launches (the machine's speed drifts between launches).
PAIRED_TP2_BASELINE = "generate_loop_tp2_paired"
DEFAULT_LM = REPO / "examples" / "models" / "gpt2-num2words-en-ro"
DEFAULT_PROMPTS = REPO / "examples" / "data" / "prompts.txt"


def _in_process(method: str, model, tokenizer, prompts: list[str], batch_size: int, new_tokens: int) -> tuple[float, int]:
    """Seconds and new tokens for one in-process method."""
    import time

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
        count = _generate_loop(model, tokenizer, prompts, batch_size, gen)
        return time.perf_counter() - start, count
    raise ValueError(method)


def _generate_loop(model, tokenizer, prompts: list[str], batch_size: int, gen: dict) -> int:
    """The bare batched `generate` loop (the baseline, in one process and at tp 2); returns the new tokens."""
    import torch

    on = next(model.parameters()).device
    count = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True).to(on)
            out = model.generate(**enc, **gen)
            count += out[:, enc["input_ids"].shape[1]:].numel()
    return count


def _trainer(model, tokenizer, prompts: list[str], batch_size: int, new_tokens: int,
             streaming: bool = False) -> tuple[float, int]:
    """The Trainer path in this process: `predict` (every output kept, as upstream), or with `streaming` the
    path the examples run, `predict_to_file` (outputs decoded and written per batch)."""
    import tempfile
    import time

    import torch
    from transformers import DataCollatorWithPadding, Seq2SeqTrainingArguments

    from ..predict.metrics import GeneratedTokens
    from ..predict.trainer import DeepSpeedInferenceSeq2SeqTrainer

    Dataset = optional_import("datasets", "ds-inference bench generation").Dataset

    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as output_dir:
        args = Seq2SeqTrainingArguments(output_dir=output_dir, per_device_eval_batch_size=batch_size,
                                        predict_with_generate=True, remove_unused_columns=False, report_to=[],
                                        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = DeepSpeedInferenceSeq2SeqTrainer(model=model, args=args, processing_class=tokenizer,
                                                   data_collator=DataCollatorWithPadding(tokenizer))
        dataset = Dataset.from_dict(dict(tokenizer(prompts)))
        start = time.perf_counter()
        if streaming:
            metrics = trainer.predict_to_file(dataset, metric=GeneratedTokens(), fresh=True, **gen)
            seconds = time.perf_counter() - start
            assert metrics["predict_new_tokens"] == len(prompts) * new_tokens, metrics
        else:
            out = trainer.predict(dataset, **gen)
            seconds = time.perf_counter() - start
            assert out.predictions.shape[0] == len(prompts) and out.predictions.shape[1] >= new_tokens
    return seconds, len(prompts) * new_tokens  # min_new_tokens = max_new_tokens


def _trainer_tp2(model_dir: Path, prompts_file: Path, batch_size: int, new_tokens: int, max_prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.txt"  # the same prompts as the other methods (repeated to max_prompts)
        prompts.write_text("\n".join(read_prompts(prompts_file, max_prompts)) + "\n", encoding="utf-8")
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
               str(REPO / "examples" / "run_generation.py"), "--output_dir", tmp, "--model_name_or_path",
               str(model_dir), "--prompts_file", str(prompts), "--max_prompts", str(max_prompts),
               "--per_device_eval_batch_size", str(batch_size), "--max_new_tokens", str(new_tokens),
               "--min_new_tokens", str(new_tokens), "--report_to", "none", "--disable_tqdm", "true",
               "--deepspeed_inference", *(["--trust_remote_code"] if trusted() else [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not _cuda():
            env["OMP_NUM_THREADS"] = str(threads_per_rank(2))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"tp2 run failed: {(proc.stdout + proc.stderr)[-2000:]}")
        return json.loads((Path(tmp) / "predict_results.json").read_text())


def _generate_loop_tp2(model_dir: Path, prompts_file: Path, batch_size: int, new_tokens: int, max_prompts: int) -> dict:
    """The bare batched `generate` loop at tp 2: the baseline of trainer_tp2 (same sharding, same batches on
    both ranks, no Trainer, nothing decoded or written). Two ranks of `_generate_worker`."""
    return _launch_tp2("--generate-worker", "generate_loop_tp2", model_dir, prompts_file, batch_size, new_tokens,
                       max_prompts)


def _paired_tp2(model_dir: Path, prompts_file: Path, batch_size: int, new_tokens: int, max_prompts: int) -> dict:
    """predict_to_file against the bare batched `generate` loop in the same two ranks (one launch): seconds of
    each, the mean of its two runs in the order loop, predict, predict, loop. Two ranks of `_paired_worker`."""
    return _launch_tp2("--paired-worker", "trainer_streaming_tp2", model_dir, prompts_file, batch_size, new_tokens,
                       max_prompts)


def _launch_tp2(worker_flag: str, method: str, model_dir: Path, prompts_file: Path, batch_size: int,
                new_tokens: int, max_prompts: int) -> dict:
    """Two ranks of one of this module's workers, started as the tools start ranks; rank 0's result."""
    from ..run.ranks import failure_text, start_ranks, wait_ranks

    with tempfile.TemporaryDirectory() as tmp:
        procs = start_ranks(2, "ds_inference_integration.tools.bench", [
            worker_flag, str(model_dir), str(prompts_file), str(batch_size), str(new_tokens), str(max_prompts),
            str(Path(tmp) / "result.json")], log_dir=tmp)
        codes = wait_ranks(procs, 900)
        if any(codes):
            raise RuntimeError(f"{method} failed: {failure_text(procs, codes)}")
        return json.loads((Path(tmp) / "result.json").read_text())


def _paired_worker(model_dir: str, prompts_file: str, batch_size: int, new_tokens: int, max_prompts: int,
                   out: str) -> int:
    """One rank of `_paired_tp2`: the Trainer shards the model (as a user's script would), then the bare loop
    runs on the Trainer's sharded model and `predict_to_file` through the Trainer, alternating."""
    import torch
    import torch.distributed as dist
    from transformers import DataCollatorWithPadding, Seq2SeqTrainingArguments

    from ..arguments import DeepSpeedInferenceArguments
    from ..predict.metrics import GeneratedTokens
    from ..predict.trainer import DeepSpeedInferenceSeq2SeqTrainer
    from ..run.memory import memory_mb
    from ..topology import Topology

    quiet_repeated_warnings()
    datasets = optional_import("datasets", "ds-inference bench generation")
    Dataset = datasets.Dataset
    datasets.disable_progress_bars()
    topology = Topology.from_env()
    model, tokenizer = _decoder_for_batches(model_dir)
    prompts = read_prompts(prompts_file, max_prompts)
    with tempfile.TemporaryDirectory(prefix="bench_paired_") as output_dir:
        args = Seq2SeqTrainingArguments(output_dir=output_dir, per_device_eval_batch_size=batch_size,
                                        predict_with_generate=True, remove_unused_columns=False, report_to=[],
                                        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = DeepSpeedInferenceSeq2SeqTrainer(
            model=model, args=args, processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
            inference_args=DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=topology.world_size))
        dataset = Dataset.from_dict(dict(tokenizer(prompts)))
        gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        loop_gen = {**gen, "pad_token_id": tokenizer.pad_token_id}  # the bare loop passes the pad id itself
        _generate_loop(trainer.model, tokenizer, prompts[:2], 2, loop_gen)
        seconds: dict[str, list[float]] = {"loop": [], "predict": []}
        for method in ("loop", "predict", "predict", "loop"):
            dist.barrier()
            start = time.perf_counter()
            if method == "loop":
                count = _generate_loop(trainer.model, tokenizer, prompts, batch_size, loop_gen)
            else:
                metrics = trainer.predict_to_file(dataset, metric=GeneratedTokens(), fresh=True, **gen)
                assert metrics["predict_new_tokens"] == len(prompts) * new_tokens, metrics
            dist.barrier()
            seconds[method].append(time.perf_counter() - start)
        assert count == len(prompts) * new_tokens, count
        peaks = [None] * topology.world_size
        dist.all_gather_object(peaks, round(memory_mb("VmHWM"), 1))
        if topology.rank == 0:
            Path(out).write_text(json.dumps({"loop_seconds": statistics.mean(seconds["loop"]),
                                             "predict_seconds": statistics.mean(seconds["predict"]),
                                             "new_tokens": count, "peak_rss_mb": peaks}))
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _decoder_for_batches(model_dir):
    """A decoder-only model (fp32, eval) and its tokenizer padding on the left, as batched generation needs
    (new tokens follow every prompt directly); a tokenizer without a pad token pads with its EOS token."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..load.own_code import from_pretrained, load_tokenizer, trusted

    tokenizer = load_tokenizer(model_dir, trusted())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return from_pretrained(AutoModelForCausalLM, model_dir, trusted(), dtype=torch.float32).eval(), tokenizer


def read_prompts(prompts_file: str | Path, max_prompts: int) -> list[str]:
    """The file's non-empty lines, repeated in order until there are `max_prompts` of them."""
    lines = [p for p in Path(prompts_file).read_text(encoding="utf-8").splitlines() if p.strip()]
    return [lines[i % len(lines)] for i in range(max_prompts)] if lines else []


def _generate_worker(model_dir: str, prompts_file: str, batch_size: int, new_tokens: int, max_prompts: int,
                     out: str) -> int:
    import torch.distributed as dist

    from ..arguments import DeepSpeedInferenceArguments
    from ..run.ranks import init_rank
    from ..shard.setup import setup_inference

    quiet_repeated_warnings()
    topology, device = init_rank(timeout=300)
    model, tokenizer = _decoder_for_batches(model_dir)
    model = setup_inference(model, DeepSpeedInferenceArguments(deepspeed_inference=True), topology, device).model
    prompts = read_prompts(prompts_file, max_prompts)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    dist.barrier()
    start = time.perf_counter()
    count = _generate_loop(model, tokenizer, prompts, batch_size, gen)
    seconds = time.perf_counter() - start
    from ..run.memory import memory_mb

    peaks = [None] * topology.world_size
    dist.all_gather_object(peaks, round(memory_mb("VmHWM"), 1))
    if topology.rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "new_tokens": count, "peak_rss_mb": peaks}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


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


class _ShowOnce:
    """A logging filter that lets each message through once: transformers 5.24 warns on every `generate` call
    that passes `max_new_tokens` ("Both `max_new_tokens` (=16) and `max_length`(=20) seem to have been set"),
    because its models carry a default `max_length`; a benchmark calls generate hundreds of times."""

    def __init__(self):
        self.seen: set[str] = set()

    def filter(self, record) -> bool:
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def quiet_repeated_warnings() -> None:
    """Each library warning once in this process; our own per-run lines (where the parts go, progress) off.
    For the bench commands' own processes only (cli.py, the workers): it changes logging for the whole process,
    so a function a script or a test may call in its own process (`bench_generation`) does not call it."""
    import logging

    from transformers.utils import logging as hf_logging

    once = _ShowOnce()
    for handler in hf_logging.get_logger().handlers + logging.getLogger().handlers:
        handler.addFilter(once)
    hf_logging.get_logger().addFilter(once)
    logging.getLogger("ds_inference_integration").setLevel(logging.ERROR)


def bench_generation(model_dir: str | None, config_spec: str | None, batch_sizes: list[int], prompts_file: str,
                     max_prompts: int, new_tokens: int, out_dir: Path, methods: list[str], repeats: int = 3,
                     trust_remote_code: bool = False) -> int:
    from ..load.own_code import load_tokenizer, trust_from_here_on

    for module in ("datasets", "matplotlib"):  # before any measurement: the plot comes last
        optional_import(module, "ds-inference bench generation")
    if not Path(prompts_file).is_file():
        if Path(prompts_file) == DEFAULT_PROMPTS:
            example_path(DEFAULT_PROMPTS, "ds-inference bench generation", "--prompts FILE")
        raise InferenceSetupError(f"--prompts {prompts_file!r} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(prompts_file, max_prompts)
    model_dir = model_dir or example_path(DEFAULT_LM, "ds-inference bench generation", "--model MODEL_DIR")
    if "trainer_tp2" in methods:
        example_path(REPO / "examples" / "run_generation.py", "ds-inference bench generation's trainer_tp2",
                     "--methods without trainer_tp2")
    trust_from_here_on(model_dir, trust_remote_code)
    base_tok = load_tokenizer(model_dir, trust_remote_code)
    # absolute: trainer_tp2 runs run_generation.py from the repository, where a path relative to here named nothing
    # ("We couldn't connect to 'https://huggingface.co'" for `--model models/x`)
    models = {"embedded": Path(model_dir).resolve()}
    with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:  # the --config model: removed at the end
        return _bench_generation(models, base_tok, Path(tmp), config_spec, batch_sizes, prompts, prompts_file,
                                 max_prompts, new_tokens, out_dir, methods, repeats)


def _bench_generation(models, base_tok, tmp, config_spec, batch_sizes, prompts, prompts_file, max_prompts,
                      new_tokens, out_dir, methods, repeats) -> int:

    if config_spec:
        models[f"config({config_spec})"] = _config_model(base_tok, tmp / "config_model", config_spec)
    rows = []
    for label, path in models.items():
        model, tokenizer = _decoder_for_batches(path)
        if _cuda():
            model = model.cuda()
        n_params = sum(p.numel() for p in model.parameters())
        _in_process("generate_loop", model, tokenizer, prompts[:2], 2, 2)  # warm-up, untimed
        for bs in batch_sizes:
            todo = [m for m in methods if not (m == "pipeline_per_sample" and bs != batch_sizes[0])]  # no batch size
            timed: dict[str, list] = {m: [] for m in todo}
            peaks: dict[str, float] = {}
            for _ in range(repeats):  # repeats interleaved: repeat i of every method side by side
                for method in todo:
                    if method == "generate_loop_tp2":
                        m = _generate_loop_tp2(path, Path(prompts_file), bs, new_tokens, max_prompts)
                        timed[method].append((m["seconds"], m["new_tokens"]))
                        peaks[method] = m["peak_rss_mb"]
                        continue
                    if method == "trainer_streaming_tp2":
                        m = _paired_tp2(path, Path(prompts_file), bs, new_tokens, max_prompts)
                        timed[method].append((m["predict_seconds"], m["new_tokens"]))
                        timed.setdefault(PAIRED_TP2_BASELINE, []).append((m["loop_seconds"], m["new_tokens"]))
                        peaks[method] = peaks[PAIRED_TP2_BASELINE] = m["peak_rss_mb"]
                        continue
                    if method == "trainer_tp2":
                        m = _trainer_tp2(path, Path(prompts_file), bs, new_tokens, max_prompts)
                        timed[method].append((m["predict_runtime"], m["predict_outputs"] * new_tokens))
                        peaks[method] = [float(x) for x in m["predict_peak_rss_mb_per_rank"].split(",")]
                        continue
                    with PeakRss() as peak:
                        if method.startswith("trainer"):
                            timed[method].append(_trainer(model, tokenizer, prompts, bs, new_tokens,
                                                          streaming=method == "trainer_streaming"))
                        else:
                            timed[method].append(_in_process(method, model, tokenizer, prompts, bs, new_tokens))
                    peaks[method] = [max(peak.mb, *peaks.get(method, [0.0]))]
            for method in timed:
                per_repeat = [count / seconds for seconds, count in timed[method]]
                seconds, count = sorted(timed[method])[len(timed[method]) // 2]
                row = {"model": label, "params_m": round(n_params / 1e6, 2), "method": method,
                       "batch_size": None if method == "pipeline_per_sample" else bs, "seconds": round(seconds, 4),
                       "new_tokens": count, "tokens_per_s": round(statistics.median(per_repeat), 1),
                       "tokens_per_s_spread": spread(per_repeat), "tokens_per_s_repeats": per_repeat,
                       "peak_rss_mb": peaks[method]}
                rows.append(row)
                print(f"{label:<22} {method:<20} bs {str(row['batch_size']):>4}  {row['seconds']:8.3f} s  "
                      f"{row['tokens_per_s']:9.1f} tok/s (min {row['tokens_per_s_spread']['min']:.1f}, "
                      f"max {row['tokens_per_s_spread']['max']:.1f})", flush=True)
    _write_report(rows, out_dir, dict(prompts=len(prompts), new_tokens=new_tokens, batch_sizes=batch_sizes,
                                      repeats=repeats))
    return 0


def _ratio(rows, model, num, den, bs):
    """The ratio of tokens/s per repeat (repeat i of each method, run side by side), as its spread."""
    def runs(method):
        for r in rows:
            if r["model"] == model and r["method"] == method and r["batch_size"] in (bs, None):
                return r["tokens_per_s_repeats"]
        return None
    a, b = runs(num), runs(den)
    return spread(x / y for x, y in zip(a, b)) if a and b else None


def _write_report(rows: list[dict], out_dir: Path, setup: dict) -> None:
    models = sorted({r["model"] for r in rows}, key=lambda m: m != "embedded")
    ratios = {}
    for model in models:
        ratios[model] = {
            "generate_loop_over_pipeline_per_sample_bs8": _ratio(rows, model, "generate_loop", "pipeline_per_sample", 8),
            "trainer_over_generate_loop_bs8": _ratio(rows, model, "trainer", "generate_loop", 8),
            "trainer_streaming_over_generate_loop_bs8": _ratio(rows, model, "trainer_streaming", "generate_loop", 8),
            "trainer_tp2_over_trainer_bs8": _ratio(rows, model, "trainer_tp2", "trainer", 8),
            "trainer_tp2_over_generate_loop_tp2_bs8": _ratio(rows, model, "trainer_tp2", "generate_loop_tp2", 8),
            "trainer_streaming_tp2_over_generate_loop_tp2_paired_bs8": _ratio(rows, model, "trainer_streaming_tp2",
                                                                              PAIRED_TP2_BASELINE, 8),
        }
    (out_dir / "bench.json").write_text(json.dumps({"setup": setup, "rows": rows, "ratios": ratios}, indent=2))
    lines = [f"Prompts: {setup['prompts']}, {setup['new_tokens']} new tokens each (greedy, min = max new tokens); "
             f"every method run {setup.get('repeats', 1)} times, the repeats interleaved (trainer_tp2: one launch "
             "each, its predict runtime); tokens/s and ratios: median (min, max) over the repeats.", ""]
    lines += ["| model | method | batch | seconds | new tokens | tokens/s median (min, max) | peak RSS MB (per rank) |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["tokens_per_s_spread"]
        lines.append(f"| {r['model']} | {r['method']} | {r['batch_size'] or '-'} | {r['seconds']:.3f} | "
                     f"{r['new_tokens']} | {sp['median']:.1f} ({sp['min']:.1f}, {sp['max']:.1f}) | "
                     f"{', '.join(map(str, r['peak_rss_mb']))} |")
    lines += ["", "| model | ratio of tokens/s | median (min, max) over repeats |", "|---|---|---|"]
    for model, rs in ratios.items():
        for name, value in rs.items():
            lines.append(f"| {model} | {name} | {spread_text(value) if value else '-'} |")
    (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    optional_import("matplotlib", "ds-inference bench generation's plot").use("Agg")
    plt = optional_import("matplotlib.pyplot", "ds-inference bench generation's plot")

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


if __name__ == "__main__":
    from ds_inference_integration.run.lifecycle import exit_now  # rank workers: no teardown (lifecycle.exit_now)

    if len(sys.argv) == 8 and sys.argv[1] == "--paired-worker":
        exit_now(_paired_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
                                sys.argv[7]))
    if len(sys.argv) == 8 and sys.argv[1] == "--generate-worker":
        exit_now(_generate_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
                                  sys.argv[7]))
    print("usage: ds-inference bench generation|guard|predict|memory", file=sys.stderr)
    sys.exit(2)
