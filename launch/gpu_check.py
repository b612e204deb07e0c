#!/usr/bin/env python
"""The GPU check: what a user runs on a one-GPU machine, then the bare engine. No download; one command,
one json file, under 8 minutes on one H200; every part that fails is recorded (with the tail of its
output) and the check goes on.

Sections, in this order (the most important first, so a time-out loses the least):

* examples: `run_translation.py` and `run_generation.py` on the embedded models, each in bf16 and
  fp16, run twice: plain (upstream's path: `--bf16_full_eval`/`--fp16_full_eval`, the Trainer's own
  `generate`) and with `--deepspeed_inference --inference_dtype DT` under the `deepspeed` launcher
  (tp 1). Predictions compared line for line, BLEU side by side.
* tp2_one_gpu: tensor parallelism's GPU path on a one-GPU machine: two ranks share the GPU (NCCL refuses two
  ranks on one device; gloo carries the CUDA tensors: `--ddp_backend gloo`, and `run/ranks.py` picks gloo
  itself where local ranks outnumber GPUs). `run_translation.py` and `run_generation.py` at tp 2 under
  `torchrun` (fp32) against one plain process on the same GPU, line for line; `ds-inference policy check
  --tp-size 2 --dtype bf16` on both embedded models (the half-precision verdict, on CUDA).
* verdict_1b: a model of real shape (Llama-3.2-1B's config, random weights, ~1.2B parameters) saved in bf16,
  through `policy check --tp-size 2 --dtype bf16` (both ranks on the one GPU): partings at near-ties
  reported, anything else failed.
* decode: greedy decode speed against its limit, a ~1.1B Llama in bf16 at batch 1, 8 and 64: plain
  `generate`, the plugin at tp 1 (`shard_model`), and the plugin with a static cache and `torch.compile`
  (CUDA graphs: transformers' CompileConfig, mode reduce-overhead); each with tokens/s and its fraction of
  the memory-bandwidth bound (every decode step reads every weight once: batch x bandwidth / weight bytes,
  bandwidth measured by a device copy and, where known, the GPU's nominal figure); the compiled tokens
  against eager's; the serve step engine (`--scheduler continuous`) on the same rows beside them; a profile of
  batch 1 (the top operators, and how much of the wall time the device is busy).
* loading: `ds-inference bench memory --device cuda --dtype bf16 --tp-size 1` on a ~0.9B Llama built
  from a config: peak GPU memory and time to a ready model for from_pretrained, full, shard-aware and
  pre-sharded loading onto the GPU; tokens compared across the paths.
* kernel_inject: `run_generation.py --deepspeed_inference --replace_with_kernel_inject` (fp16, the
  embedded GPT-2; DeepSpeed JIT-builds its inference kernels first) against the plain fp16 run.
* engine: a ~1.1B Llama under a bare `deepspeed.init_inference`, fp16/bf16 x kernel injection on/off,
  greedy tokens/s and peak GPU memory per batch size.

The smoke mode (`--smoke`, CPU) runs every section's code on tiny inputs: two CPU ranks for tp2_one_gpu,
a tiny model of the same config family for verdict_1b and decode (compiled with torch.compile's `eager`
backend there: the static cache and compile plumbing, not the kernels).

    launch/gpu_check.sh [OUT.json]                    # on the GPU machine
    python launch/gpu_check.py --smoke --out x.json   # CPU smoke run of the same code (tests use it)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ds_inference_integration.run.files import write_text_atomic
from ds_inference_integration.run.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRANSLATE = ["--predict_with_generate", "--source_lang", "en", "--target_lang", "ro",
             "--source_prefix", "translate English to Romanian: ", "--do_predict",
             "--per_device_eval_batch_size", "16", "--report_to", "none"]
GENERATE = ["--per_device_eval_batch_size", "8", "--report_to", "none"]
LOADING_CONFIG = "2048,16,16,5504,32000"  # ~0.9B parameters, 1.75 GB in bf16
SECTIONS = ("examples", "tp2_one_gpu", "decode", "verdict_1b", "loading", "kernel_inject", "engine")
# Llama-3.2-1B's shape (its config.json, without downloading anything): 1.24B parameters, 2.5 GB in bf16
REAL_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
# nominal memory bandwidth, bytes/s, by the name torch gives the GPU (vendors' data sheets)
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.04e12,
                     "A100-SXM4-40GB": 1.56e12, "L40S": 0.864e12, "A10G": 0.6e12}


def run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """One command, bounded; its exit code, seconds and (on failure) the tail of its output."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as e:
        return {"cmd": " ".join(cmd), "exit": "not started", "seconds": 0.0, "output_tail": str(e), "_output": ""}
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
        out = ""
    finally:
        try:
            os.killpg(proc.pid, 9)  # the launcher's ranks too
        except ProcessLookupError:
            pass
    if code == "timeout":
        out, _ = proc.communicate()
    result = {"cmd": " ".join(cmd[1:] if cmd[0] == sys.executable else cmd), "exit": code,
              "seconds": round(time.monotonic() - start, 1)}
    if code != 0:
        result["output_tail"] = (out or "")[-2000:]
    result["_output"] = out or ""
    return result


def launch(script: Path, args: list[str]) -> list[str]:
    """The user's command on a one-GPU machine: `deepspeed --num_gpus 1 script ...`."""
    deepspeed = shutil.which("deepspeed") or "deepspeed"
    return [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()), str(script), *args]


def read_lines(path: Path) -> list[str] | None:
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else None


def compare(plain_dir: Path, plugin_dir: Path) -> dict:
    a, b = read_lines(plain_dir / "generated_predictions.txt"), read_lines(plugin_dir / "generated_predictions.txt")
    if a is None or b is None:
        return {"lines_compared": 0, "identical": False, "why": "a run wrote no generated_predictions.txt"}
    same = sum(x == y for x, y in zip(a, b))
    result = {"lines_compared": len(a), "lines_identical": same, "identical": len(a) == len(b) == same}
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is not None:
        result["first_difference"] = {"line": first + 1, "plain": a[first][:200], "plugin": b[first][:200]}
    return result


def metric(out_dir: Path, key: str):
    p = out_dir / "predict_results.json"
    return json.loads(p.read_text()).get(key) if p.is_file() else None


def examples_section(work: Path, dtypes: list[str], smoke: bool, deadline: float) -> dict:
    """Plain vs plugin, both examples, every dtype; the runs are independent, so they run side by side."""
    limit_t = ["--max_predict_samples", "12"] if smoke else []
    limit_g = ["--max_prompts", "8", "--max_new_tokens", "8"] if smoke else []
    jobs = {}
    for name, script, args in (("translation", EXAMPLES / "run_translation.py", [*TRANSLATE, *limit_t]),
                               ("generation", EXAMPLES / "run_generation.py", [*GENERATE, *limit_g])):
        for dt in dtypes:
            plain, plugin = work / f"{name}_{dt}_plain", work / f"{name}_{dt}_plugin"
            cast = [f"--{dt}_full_eval"] if dt != "fp32" else []
            on_cpu = ["--use_cpu"] if smoke else []  # bf16 without a GPU: the Trainer wants it said
            jobs[(name, dt, "plain")] = (plain, [sys.executable, str(script), "--output_dir", str(plain), *args,
                                                 *cast, *on_cpu])
            jobs[(name, dt, "plugin")] = (plugin, launch(script, ["--output_dir", str(plugin), *args,
                                                                  "--deepspeed_inference", "--inference_dtype", dt]))
    workers = 8 if not smoke else 2
    env = {"OMP_NUM_THREADS": "1"} if smoke else {}
    with ThreadPoolExecutor(workers) as pool:
        futures = {k: pool.submit(run, cmd, deadline - time.monotonic(), env) for k, (_, cmd) in jobs.items()}
        done = {k: f.result() for k, f in futures.items()}
    rows = []
    for name in ("translation", "generation"):
        for dt in dtypes:
            plain_dir, plugin_dir = jobs[(name, dt, "plain")][0], jobs[(name, dt, "plugin")][0]
            p, q = done[(name, dt, "plain")], done[(name, dt, "plugin")]
            row = {"script": name, "dtype": dt, "plain": _public(p), "plugin": _public(q),
                   **compare(plain_dir, plugin_dir)}
            if name == "translation":
                row["bleu_plain"], row["bleu_plugin"] = metric(plain_dir, "predict_bleu"), metric(plugin_dir, "predict_bleu")
            row["ok"] = p["exit"] == 0 and q["exit"] == 0 and row["identical"] and \
                row.get("bleu_plain") == row.get("bleu_plugin")
            rows.append(row)
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


def torchrun(script: Path, args: list[str], nproc: int = 2) -> list[str]:
    """`torchrun --nproc_per_node N script ...`: two ranks on a one-GPU machine (the deepspeed launcher gives
    each rank its own GPU, and refuses more ranks than GPUs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), str(script), *args]


def tp2_one_gpu_section(work: Path, smoke: bool, deadline: float) -> dict:
    """Both examples at tp 2, two ranks on the one GPU (gloo), against one plain process on it; then `policy check`
    at tp 2 in bf16 on the embedded models."""
    limit_t = ["--max_predict_samples", "12" if smoke else "64"]
    limit_g = ["--max_prompts", "8" if smoke else "32", "--max_new_tokens", "8" if smoke else "24"]
    env = {"OMP_NUM_THREADS": "1"} if smoke else {}
    jobs = {}
    for name, script, args in (("translation", EXAMPLES / "run_translation.py", [*TRANSLATE, *limit_t]),
                               ("generation", EXAMPLES / "run_generation.py", [*GENERATE, *limit_g])):
        plain, plugin = work / f"tp2_{name}_plain", work / f"tp2_{name}_plugin"
        jobs[(name, "plain")] = (plain, [sys.executable, str(script), "--output_dir", str(plain), *args])
        jobs[(name, "plugin")] = (plugin, torchrun(script, ["--output_dir", str(plugin), *args, "--deepspeed_inference",
                                                            "--tp_size", "2", "--ddp_backend", "gloo"]))
    with ThreadPoolExecutor(2) as pool:  # a plain run beside a tp 2 run: three processes on the GPU at most
        futures = {k: pool.submit(run, cmd, deadline - time.monotonic(), env) for k, (_, cmd) in jobs.items()}
        done = {k: f.result() for k, f in futures.items()}
    rows = []
    for name in ("translation", "generation"):
        p, q = done[(name, "plain")], done[(name, "plugin")]
        row = {"script": name, "dtype": "fp32", "tp": 2, "plain": _public(p), "plugin": _public(q),
               **compare(jobs[(name, "plain")][0], jobs[(name, "plugin")][0])}
        row["ok"] = p["exit"] == 0 and q["exit"] == 0 and row["identical"]
        rows.append(row)
    check = policy_check_run(work / "tp2_policy_check.json", [str(EXAMPLES / "models" / m) for m in
                                                               ("gpt2-num2words-en-ro", "t5-num2words-en-ro")],
                             deadline, env)
    return {"rows": rows, "policy_check": check, "ok": all(r["ok"] for r in rows) and check["ok"]}


def policy_check_run(report: Path, model_dirs: list[str], deadline: float, env: dict | None = None) -> dict:
    """`ds-inference policy check MODEL... --tp-size 2 --dtype bf16`; its verdict per check, from its json."""
    r = run([sys.executable, "-m", "ds_inference_integration.tools.cli", "policy", "check", *model_dirs,
             "--tp-size", "2", "--dtype", "bf16", "--json", str(report),
             "--timeout", str(int(max(30, deadline - time.monotonic() - 10)))], deadline - time.monotonic(), env)
    result = {"run": _public(r)}
    if report.is_file():
        data = json.loads(report.read_text())
        result.update(passed=data["passed"], total=data["total"],
                      checks=[{k: c.get(k) for k in ("model", "check", "passed", "line")} for c in data["checks"]],
                      partings_at_near_ties=sum("near-tie" in (c.get("line") or "") for c in data["checks"]))
    result["ok"] = r["exit"] == 0 and result.get("passed") == result.get("total", -1)
    return result


def verdict_1b_section(work: Path, smoke: bool, deadline: float) -> dict:
    """A real-shape ~1B Llama (random weights) saved in bf16, through the half-precision verdict at tp 2."""
    model_dir = work / "llama_1b_bf16"
    build = run([sys.executable, str(Path(__file__).resolve()), "--build-1b", str(model_dir),
                 *(["--smoke"] if smoke else [])], deadline - time.monotonic())
    result = {"build": _public(build), "config": "tiny (smoke)" if smoke else "Llama-3.2-1B shape"}
    if build["exit"] != 0:
        result["ok"] = False
        return result
    result["parameters"] = json.loads((model_dir / "parameters.json").read_text())["parameters"]
    result.update(policy_check_run(work / "verdict_1b.json", [str(model_dir)], deadline,
                                   {"OMP_NUM_THREADS": "1"} if smoke else {}))
    shutil.rmtree(model_dir, ignore_errors=True)  # 2.5 GB
    return result


def build_1b(out: Path, smoke: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(REAL_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512) if smoke else REAL_1B
    config = LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"):  # seconds on the GPU
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    write_json(out / "parameters.json", {"parameters": sum(p.numel() for p in model.parameters())})


def decode_section(work: Path, smoke: bool, deadline: float) -> dict:
    out = work / "decode.json"
    r = run([sys.executable, str(Path(__file__).resolve()), "--decode-worker", str(out),
             *(["--smoke"] if smoke else [])], deadline - time.monotonic(), {"OMP_NUM_THREADS": "1"} if smoke else {})
    result = {"run": _public(r)}
    if out.is_file():
        result.update(json.loads(out.read_text()))
    rows = result.get("rows", [])
    result["ok"] = r["exit"] == 0 and bool(rows) and all("error" not in x for x in rows) and \
        all(x.get("tokens_equal_eager", True) for x in rows)
    return result


def loading_section(work: Path, smoke: bool, deadline: float) -> dict:
    device = "cpu" if smoke else "cuda"
    config = "64,2,4,128,256" if smoke else LOADING_CONFIG
    out = work / "loading"
    r = run([sys.executable, "-m", "ds_inference_integration.tools.cli", "bench", "memory", "--device", device,
             "--dtype", "bf16", "--tp-size", "1", "--config", config, "--output-dir", str(out),
             "--repeats", "1",  # one pass: the GPU check has 8 minutes for everything
             "--timeout", str(int(max(30, deadline - time.monotonic())))],
            deadline - time.monotonic(), {"OMP_NUM_THREADS": "1"} if smoke else {})
    result = {"run": _public(r)}
    report = out / "bench_memory.json"
    if report.is_file():
        data = json.loads(report.read_text())
        keep = ("mode", "ready_s", "generate_s", "peak_gpu_mb", "peak_gpu_mb_at_ready", "peak_rss_mb",
                "logits_max_abs_diff_vs_single", "tokens")
        result.update({"checkpoint_mb": data["checkpoint_mb"], "config": config, "device": device,
                       "shard_command_s": data["shard_command_s"], "tokens_identical": data["tokens_identical"],
                       "rows": [{k: row[k] for k in keep if k in row} for row in data["rows"]],
                       "ratios": data["ratios"]})
    result["ok"] = r["exit"] == 0 and result.get("tokens_identical") is True
    return result


def kernel_inject_section(work: Path, smoke: bool, deadline: float) -> dict:
    """The plugin with DeepSpeed's kernels against the plain fp16 run of the examples section, or, where they
    cannot run, its one-line refusal; then (GPU) a per-architecture matrix of the bare kernels, which says
    whether a new DeepSpeed lifts the refusal in `deepspeed_compat`."""
    dt = "bf16" if smoke else "fp16"
    plugin = work / "generation_kernel_inject"
    args = [*GENERATE, *(["--max_prompts", "8", "--max_new_tokens", "8"] if smoke else [])]
    env = {"TORCH_CUDA_ARCH_LIST": cuda_arch_list(), "MAX_JOBS": str(os.cpu_count() or 8)}
    r = run(launch(EXAMPLES / "run_generation.py", ["--output_dir", str(plugin), *args, "--deepspeed_inference",
                                                     "--inference_dtype", dt, "--replace_with_kernel_inject"]),
            deadline - time.monotonic(), env)
    result = {"dtype": dt, "run": _public(r)}
    errors = [line for line in r["_output"].splitlines() if line.startswith("error:")]
    if r["exit"] != 0:
        # where DeepSpeed's kernels cannot run (no GPU, or a DeepSpeed/transformers pair seen failing) the run
        # must be refused in one line naming the flag, before any model loads
        result["refused"] = errors[:1]
        result["ok"] = r["exit"] == 2 and len(errors) == 1 and "--replace_with_kernel_inject" in errors[0]
    else:
        result.update(compare(work / f"generation_{dt}_plain", plugin))
        result["tokens_per_s_plain"] = metric(work / f"generation_{dt}_plain", "predict_new_tokens_per_second")
        result["tokens_per_s_kernel_inject"] = metric(plugin, "predict_new_tokens_per_second")
        # fused kernels round differently from torch's: the check is that it runs and how close it stays
        result["ok"] = result.get("lines_compared", 0) > 0
    if smoke:
        return result
    matrix = work / "inject_matrix.json"  # which architectures DeepSpeed's kernels run at all, this stack
    m = run([sys.executable, str(Path(__file__).resolve()), "--inject-matrix-worker", str(matrix)],
            deadline - time.monotonic(), env)
    result["matrix_run"] = _public(m)
    if matrix.is_file():
        result["matrix"] = json.loads(matrix.read_text())
    return result


def cuda_arch_list() -> str:
    """This GPU's architecture alone (the JIT build is then one target, minutes fewer), without the 'a' suffix:
    DeepSpeed 0.19's `compute_capability_args` parses each entry as numbers and fails on '9.0a' (seen on the
    H200 machine, whose environment sets it)."""
    import torch

    if not torch.cuda.is_available():
        return "9.0"
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def engine_section(work: Path, smoke: bool, deadline: float, skip_inject: bool) -> dict:
    out = work / "engine.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker", str(out)]
    if smoke:
        cmd.append("--smoke")
    if skip_inject:
        cmd.append("--no-inject")
    r = run(cmd, deadline - time.monotonic(), {"TORCH_CUDA_ARCH_LIST": cuda_arch_list(),
                                                "MAX_JOBS": str(os.cpu_count() or 8)})
    result = {"run": _public(r)}
    if out.is_file():
        result.update(json.loads(out.read_text()))
    runs = result.get("runs", [])
    result["ok"] = r["exit"] == 0 and bool(runs) and all("error" not in x for x in runs if not x.get("skipped"))
    return result


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_")}


# --- kernel injection per architecture: tiny random models, fp16, plain generate vs injected ---------------

INJECT_TYPES = ("gpt2", "llama", "opt", "bloom", "gpt_neox", "gptj")


def inject_matrix_worker(out: Path) -> None:
    import copy

    import deepspeed
    import torch
    import transformers as tr

    world_of_one()
    small = dict(vocab_size=256)
    configs = {
        "gpt2": lambda: tr.GPT2Config(n_embd=256, n_layer=2, n_head=4, n_positions=64, **small),
        "llama": lambda: tr.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, **small),
        "opt": lambda: tr.OPTConfig(hidden_size=256, ffn_dim=512, num_hidden_layers=2, num_attention_heads=4,
                                    word_embed_proj_dim=256, **small),
        "bloom": lambda: tr.BloomConfig(hidden_size=256, n_layer=2, n_head=4, **small),
        "gpt_neox": lambda: tr.GPTNeoXConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                             num_attention_heads=4, **small),
        "gptj": lambda: tr.GPTJConfig(n_embd=256, n_layer=2, n_head=4, rotary_dim=32, n_positions=64, **small),
    }
    rows = []
    for name in INJECT_TYPES:
        row = {"model_type": name}
        try:
            torch.manual_seed(0)
            model = tr.AutoModelForCausalLM.from_config(configs[name]()).to("cuda", torch.float16).eval()
            ids = torch.randint(3, 256, (2, 12), device="cuda")
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                plain = model.generate(input_ids=ids, **kw)
                injected = deepspeed.init_inference(copy.deepcopy(model), dtype=torch.float16,
                                                    replace_with_kernel_inject=True).module
                got = injected.generate(input_ids=ids, **kw)
            row.update(ok=True, tokens_identical=bool(torch.equal(plain, got)),
                       tokens_agree=round(float((plain == got).float().mean()), 3))
        except Exception as e:  # record and go on
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(out, {"rows": rows})


# --- decode worker: speed against the memory-bandwidth bound, in its own process -----------------------------

def decode_worker(out: Path, smoke: bool) -> None:
    """Plain generate, the plugin at tp 1, the plugin with a static cache compiled (CUDA graphs), per batch size:
    tokens/s and the fraction of the bound; then where batch 1's time goes."""
    import torch
    from transformers import CompileConfig, LlamaForCausalLM

    from ds_inference_integration.arguments import DeepSpeedInferenceArguments
    from ds_inference_integration.deepspeed_compat import init_deepspeed_comm
    from ds_inference_integration.policy.derive import policy_for_model
    from ds_inference_integration.policy.schema import policy_for_run
    from ds_inference_integration.shard.inject import shard_model
    from ds_inference_integration.topology import ProcessGroups, Topology

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    world_of_one()
    cfg = engine_config(smoke)
    batch_sizes, prompt_len, new_tokens = ([1, 2], 8, 4) if smoke else ([1, 8, 64], 64, 64)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name() if cuda else "cpu"
    measured = copy_bandwidth(device)
    nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in name), None)
    bound_bw = nominal or measured
    report = {"device": name, "dtype": str(dtype).removeprefix("torch."), "weight_bytes": weight_bytes,
              "prompt_len": prompt_len, "new_tokens": new_tokens, "bandwidth_measured_bytes_s": measured,
              "bandwidth_nominal_bytes_s": nominal, "rows": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed_generate(m, ids, **kw):
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
        with torch.no_grad():
            m.generate(input_ids=ids, **kw)  # warm-up: the same lengths, so a static cache compiles once, here
            sync()
            start = time.perf_counter()
            tokens = m.generate(input_ids=ids, **kw)
            sync()
        return tokens, time.perf_counter() - start

    prompts = {bs: torch.randint(3, cfg.vocab_size, (bs, prompt_len), device=device) for bs in batch_sizes}
    eager = {}
    for bs in batch_sizes:  # plain transformers first, before the plugin touches the model
        tokens, seconds = timed_generate(model, prompts[bs])
        report["rows"].append(decode_row("plain generate", bs, new_tokens, seconds, weight_bytes, bound_bw))
        eager[bs] = tokens
    write_json(out, report)
    init_deepspeed_comm(Topology(world_size=1, rank=0, tp_size=1))
    args = DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=1)
    model, _ = shard_model(model, args, Topology(world_size=1, rank=0, tp_size=1), ProcessGroups(None, None, None),
                           policy_for_model(policy_for_run("auto", model.config, 1), model, 1), dtype, device=device)
    compile_config = CompileConfig(backend="eager" if smoke else "inductor", mode=None if smoke else "reduce-overhead")
    compile_config._compile_all_devices = smoke  # transformers compiles on GPUs only unless told
    for label, kw in (("plugin tp 1", {}),
                      ("plugin tp 1, static cache + torch.compile",
                       {"cache_implementation": "static", "compile_config": compile_config})):
        for bs in batch_sizes:
            entry = {"path": label, "batch_size": bs}
            try:
                tokens, seconds = timed_generate(model, prompts[bs], **kw)
                entry = decode_row(label, bs, new_tokens, seconds, weight_bytes, bound_bw)
                entry["tokens_equal_eager"] = bool(torch.equal(tokens, eager[bs]))
            except Exception as e:  # record and go on: one failing path must not lose the others
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            report["rows"].append(entry)
            print(json.dumps(entry), flush=True)
            write_json(out, report)
    for bs in batch_sizes:  # the server's step engine (issue #42) against generate's batch, the same rows
        entry = {"path": "plugin tp 1, step engine", "batch_size": bs}
        try:
            tokens, seconds = timed_steps(model, prompts[bs], new_tokens, device, sync)
            entry = decode_row("plugin tp 1, step engine", bs, new_tokens, seconds, weight_bytes, bound_bw)
            entry["tokens_equal_eager"] = tokens == eager[bs][:, prompt_len:].tolist()
        except Exception as e:  # record and go on
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        report["rows"].append(entry)
        print(json.dumps(entry), flush=True)
        write_json(out, report)
    eager_speed = {r["batch_size"]: r["tokens_per_s"] for r in report["rows"]
                   if r["path"] == "plugin tp 1" and "tokens_per_s" in r}
    report["compiled_faster_at"] = [r["batch_size"] for r in report["rows"] if "compile" in r["path"]
                                    and r.get("tokens_per_s", 0) > eager_speed.get(r["batch_size"], float("inf"))]
    report["profile_batch_1"] = profile_decode(model, prompts[batch_sizes[0]], cuda)
    write_json(out, report)


def timed_steps(model, ids, new_tokens: int, device, sync) -> tuple[list[list[int]], float]:
    """The rows of `ids` through the serve step engine (prefilled together, then one decoding step at a time), greedy,
    `new_tokens` each: each row's new tokens and the seconds of the second of two runs (the first warms up)."""
    import torch

    from ds_inference_integration.serve.steps import Kept, StepEngine
    from ds_inference_integration.serve.wire import Admit, BatchKey, RowSpec
    from ds_inference_integration.tools.bench_steps import TokenIds

    for _ in range(2):
        engine, kept = StepEngine(model, TokenIds(), device, ids.shape[0]), Kept()
        engine.take(Admit(0, BatchKey(), tuple(RowSpec(tuple(row), max_new_tokens=new_tokens, ignore_eos=True, id=i)
                                              for i, row in enumerate(ids.tolist()))))
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            while engine.busy():
                engine.step(kept)
        sync()
        seconds = time.perf_counter() - start
    return [kept.rows[i][0][0] for i in range(ids.shape[0])], seconds


def decode_row(path: str, batch: int, new_tokens: int, seconds: float, weight_bytes: int, bandwidth: float) -> dict:
    """Tokens/s and its fraction of the bound: a decode step reads every weight once, so steps/s is at most
    bandwidth / weight bytes, and tokens/s at most batch x that (the KV cache's reads left out: a bound)."""
    tps = batch * new_tokens / seconds
    bound = batch * bandwidth / weight_bytes
    return {"path": path, "batch_size": batch, "seconds": round(seconds, 4), "tokens_per_s": round(tps, 1),
            "bound_tokens_per_s": round(bound, 1), "fraction_of_bound": round(tps / bound, 4)}


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write), best of 5: what the bound is measured against where the
    GPU's nominal figure is unknown."""
    import torch

    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n / best


def profile_decode(model, ids, cuda: bool, steps: int = 8) -> dict:
    """Where batch 1's decode time goes: the operators with the most self time (device time on a GPU), and the
    share of the wall time the device is busy (the rest is Python and kernel launches)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        start = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:8]
    busy = sum(getattr(e, key, 0) for e in events) / 1e6
    return {"steps": steps, "wall_s": round(wall, 4), "per_step_ms": round(1e3 * wall / steps, 2),
            "device_busy_fraction": round(busy / wall, 3) if cuda else None,
            "top_ops": [{"op": e.key, "self_ms": round(getattr(e, key, 0) / 1e3, 2), "calls": e.count} for e in top]}


# --- engine worker: the bare DeepSpeed engine, in its own process --------------------------------------------

def engine_worker(out: Path, smoke: bool, no_inject: bool) -> None:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    world_of_one()
    batch_sizes = [1, 4] if smoke else [1, 8, 64]
    new_tokens, prompt_len = (4, 8) if smoke else (64, 64)
    cfg = engine_config(smoke)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "prompt_len": prompt_len,
              "new_tokens": new_tokens, "torch": torch.__version__, "runs": []}
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16} if cuda else {"fp32": torch.float32}
    for dtype_name, dtype in dtypes.items():
        for kernel_inject in (False, True):
            entry = {"dtype": dtype_name, "kernel_inject": kernel_inject}
            start = time.perf_counter()
            if kernel_inject and (no_inject or not cuda):
                entry["skipped"] = ("no GPU" if not cuda else
                                    "DeepSpeed's kernels did not build or run in the kernel_inject section")
            else:
                try:
                    entry["rows"] = engine_config_run(cfg, dtype, kernel_inject, batch_sizes, prompt_len,
                                                      new_tokens, device)
                except Exception as e:  # record and go on: one failing mode must not lose the others
                    entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            entry["seconds"] = round(time.perf_counter() - start, 1)
            report["runs"].append(entry)
            print(json.dumps(entry), flush=True)
            write_json(out, report)


def engine_config(smoke: bool):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=256)
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)  # ~1.1B


def engine_config_run(cfg, dtype, kernel_inject: bool, batch_sizes, prompt_len: int, new_tokens: int,
                      device) -> list[dict]:
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds, not minutes, for 1B parameters
        model = LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    if kernel_inject or device.type == "cuda":
        model = deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=kernel_inject).module
    cuda = device.type == "cuda"
    rows = []
    for bs in batch_sizes:
        ids = torch.randint(3, cfg.vocab_size, (bs, prompt_len), device=device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append({"batch_size": bs, "seconds": round(seconds, 4), "new_tokens": bs * new_tokens,
                     "tokens_per_s": round(bs * new_tokens / seconds, 1),
                     "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None})
    del model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def world_of_one() -> None:
    """The environment of rank 0 of a world of one, for `init_inference`, which starts torch.distributed itself
    when no launcher did."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(k, v)


def write_json(path: Path, data: dict) -> None:
    """Atomically (the package's writer): a check killed at its time limit leaves the last complete report."""
    write_text_atomic(path, json.dumps(data, indent=2))


def environment() -> dict:
    import importlib.metadata as md

    import torch

    versions = {}
    for name in ("torch", "transformers", "deepspeed", "accelerate", "datasets", "safetensors"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cuda": torch.version.cuda, "versions": versions, "python": sys.version.split()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny inputs: tests the check itself")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole check")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--engine-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-inject", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inject-matrix-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build-1b", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_worker:
        decode_worker(Path(args.decode_worker), args.smoke)
        return 0
    if args.build_1b:
        build_1b(Path(args.build_1b), args.smoke)
        return 0
    if args.inject_matrix_worker:
        inject_matrix_worker(Path(args.inject_matrix_worker))
        return 0
    if args.engine_worker:
        engine_worker(Path(args.engine_worker), args.smoke, args.no_inject)
        return 0
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"error: --sections {','.join(bad)} is invalid; valid: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("error: no GPU visible (torch.cuda.is_available() is False); run with --smoke for the CPU check",
              file=sys.stderr)
        return 2
    start = time.monotonic()
    end = start + args.budget
    # seconds each section may take at most, from what is left (the last gets the rest)
    shares = {"examples": 0.2, "tp2_one_gpu": 0.2, "decode": 0.3, "verdict_1b": 0.3, "loading": 0.35,
              "kernel_inject": 0.6, "engine": 1.0}
    dtypes = ["bf16"] if args.smoke else ["bf16", "fp16"]
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"smoke": args.smoke, "budget_s": args.budget, **environment(), "sections": {}}
    write_json(out, report)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        for name in sections:
            left = end - time.monotonic()
            if left < 20:
                report["sections"][name] = {"ok": False, "skipped": f"time budget spent ({args.budget:.0f} s)"}
                write_json(out, report)
                continue
            deadline = time.monotonic() + left * (shares[name] if name != sections[-1] else 1.0)
            t0 = time.monotonic()
            try:
                if name == "examples":
                    result = examples_section(work, dtypes, args.smoke, deadline)
                elif name == "tp2_one_gpu":
                    result = tp2_one_gpu_section(work, args.smoke, deadline)
                elif name == "decode":
                    result = decode_section(work, args.smoke, deadline)
                elif name == "verdict_1b":
                    result = verdict_1b_section(work, args.smoke, deadline)
                elif name == "loading":
                    result = loading_section(work, args.smoke, deadline)
                elif name == "kernel_inject":
                    if "examples" not in sections and not args.smoke:
                        examples_section(work, ["fp16"], args.smoke, deadline)  # its plain fp16 reference
                    result = kernel_inject_section(work, args.smoke, deadline)
                else:
                    ki = report["sections"].get("kernel_inject") or {}
                    ran = [row for row in (ki.get("matrix") or {}).get("rows", []) if row.get("ok")]
                    result = engine_section(work, args.smoke, end, skip_inject=bool(ki) and not ran)
            except Exception as e:  # record and go on: one failing section must not lose the others
                result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            result["seconds"] = round(time.monotonic() - t0, 1)
            report["sections"][name] = result
            print(f"{name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s", flush=True)
            write_json(out, report)
    report["seconds"] = round(time.monotonic() - start, 1)
    report["ok"] = all(s.get("ok") for s in report["sections"].values())
    write_json(out, report)
    print(f"wrote {out}: {'all sections ok' if report['ok'] else 'some sections failed'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
