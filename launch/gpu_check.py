#!/usr/bin/env python
"""The GPU check: what a user runs on a one-GPU machine, then the bare engine. No download; one command,
one json file, under 8 minutes on one H200; every part that fails is recorded (with the tail of its
output) and the check goes on.

Sections, in this order (the most important first, so a time-out loses the least):

* examples: `run_translation.py` and `run_generation.py` on the embedded models, each in bf16 and
  fp16, run twice: plain (upstream's path: `--bf16_full_eval`/`--fp16_full_eval`, the Trainer's own
  `generate`) and with `--deepspeed_inference --inference_dtype DT` under the `deepspeed` launcher
  (tp 1). Predictions compared line for line, BLEU side by side.
* loading: `ds-inference bench memory --device cuda --dtype bf16 --tp-size 1` on a ~0.9B Llama built
  from a config: peak GPU memory and time to a ready model for from_pretrained, full, shard-aware and
  pre-sharded loading onto the GPU; tokens compared across the paths.
* kernel_inject: `run_generation.py --deepspeed_inference --replace_with_kernel_inject` (fp16, the
  embedded GPT-2; DeepSpeed JIT-builds its inference kernels first) against the plain fp16 run.
* engine: a ~1.1B Llama under a bare `deepspeed.init_inference`, fp16/bf16 x kernel injection on/off,
  greedy tokens/s and peak GPU memory per batch size.

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

from ds_inference_integration.files import write_text_atomic
from ds_inference_integration.tools.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRANSLATE = ["--predict_with_generate", "--source_lang", "en", "--target_lang", "ro",
             "--source_prefix", "translate English to Romanian: ", "--do_predict",
             "--per_device_eval_batch_size", "16", "--report_to", "none"]
GENERATE = ["--per_device_eval_batch_size", "8", "--report_to", "none"]
LOADING_CONFIG = "2048,16,16,5504,32000"  # ~0.9B parameters, 1.75 GB in bf16
SECTIONS = ("examples", "loading", "kernel_inject", "engine")


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
    args = parser.parse_args()
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
    shares = {"examples": 0.3, "loading": 0.35, "kernel_inject": 0.6, "engine": 1.0}
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
