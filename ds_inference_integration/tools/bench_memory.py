"""`ds-inference bench memory`: peak host memory and time to a ready model, per loading path, side by side.

On one `--config`-built Llama saved as safetensors (default about 6.3 GB in fp32), in one run:

* single: one process, `from_pretrained` (the reference: a full load);
* full (naive): tp ranks, each `from_pretrained` then `deepspeed.init_inference`;
* shard-aware: tp ranks, model built on meta, each reads only its slices of the checkpoint;
* shard-aware-get-slice: the same, with every read through safetensors' `get_slice` alone (what the
  reader would be without its own positioned reads for column selections and dtype changes);
* pre-sharded: tp ranks, each reads its own file written by `ds-inference shard` (timed too).

Every rank is its own process; peak RSS is the process's high-water mark (VmHWM), which includes
the interpreter and imported libraries (the post-import RSS is reported too), taken after a first
greedy generation (8 new tokens): by then every weight has been used, so weights that are mapped
from the checkpoint file rather than copied (`from_pretrained` does this, and so do we for
contiguous slices) are resident and counted. Time to ready runs from the start of loading (after
imports and process-group start) to a sharded model; the first generation is timed separately, so a
path that defers reads to first use shows it there. The run fails if any path's tokens differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..run.memory import memory_mb
from ..run.ranks import failure_text, start_ranks, wait_ranks
from .bench import spread

MODES = ("single", "full", "shard-aware", "shard-aware-get-slice", "pre-sharded")
GET_SLICE = "shard-aware-get-slice"  # shard-aware, every read through safetensors' get_slice (no own reads)


def _read_with_get_slice(self, name, rows=None, cols=None, dtype=None, view=False):
    """`SafetensorsCheckpoint.read` done with safetensors' `get_slice` alone (what the reader would be without
    its own positioned reads): the side-by-side measurement behind keeping them for column selections and
    dtype changes (load/checkpoint.py's docstring)."""
    import torch

    e = self.entries[name]
    handle = self._handles[e.file]
    if not e.shape:
        t = handle.get_tensor(name)
    else:
        sl = handle.get_slice(name)
        parts = []
        for a, b in rows or [(0, e.shape[0])]:
            if cols is None:
                parts.append(sl[a:b])
            else:
                parts.append(torch.cat([sl[a:b, c0:c1] for c0, c1 in cols], dim=1))
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
    self.bytes_read += t.numel() * t.element_size()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if view and cols is None else t.contiguous()
NEW_TOKENS = 8


def build_config_model(spec: str, out: Path, dtype_name: str = "fp32") -> Path:
    """A random Llama of hidden,layers,heads,intermediate,vocab, saved as safetensors in `dtype_name` (tied
    embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab = (int(x) for x in spec.split(","))
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    from ..arguments import DTYPES

    model.to(DTYPES[dtype_name]).save_pretrained(out, max_shard_size="2GB")
    return out


def _worker(mode: str, model_dir: str, out_json: str, device_name: str = "cpu", dtype_name: str = "fp32") -> int:
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    from ..arguments import DTYPES, DeepSpeedInferenceArguments
    from ..deepspeed_compat import init_deepspeed_comm
    from ..load.loaders import load_model, pending_load
    from ..policy.derive import policy_for_model
    from ..policy.schema import policy_for_run
    from ..run.ranks import init_rank
    from ..shard.inject import shard_model
    from ..topology import Topology, init_process_groups

    importlib.import_module("deepspeed")  # every mode imports the same libraries
    # and the model class's own module, before any clock starts: importing transformers' modeling_llama (and what
    # it pulls in: torch._dynamo, generation, the loss modules, scipy) took 1.6 of the 2.25 s that a pre-sharded
    # rank's load_model + shard_model took under cProfile (6.3 GB Llama, tp 2, 2026-12-04), and one process's
    # from_pretrained paid the same inside its clock: the ratios measured Python's imports, not the loading.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..load.own_code import from_pretrained, load_config, trusted

    config = load_config(model_dir, trusted())
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:  # (a model of its own code: its module imported by load_config)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    # and what the sharding imports on first use, once per process: DeepSpeed's expert-parallel and Triton modules
    # (`init_inference`), transformers' GPT-2 (DeepSpeed's AutoTP compares every layer class with GPT2Block), our
    # policy verifier: 0.05 s of a pre-sharded rank's 0.34 s (a 32-layer Llama, tp 2, cProfile, 2026-12-04)
    for module in ("deepspeed.inference.engine", "deepspeed.module_inject.auto_ep_layer",
                   "transformers.models.gpt2.modeling_gpt2", "ds_inference_integration.policy.verify"):
        importlib.import_module(module)

    device, dtype = torch.device(device_name), DTYPES[dtype_name]
    cuda = device.type == "cuda"
    if mode == "single":  # no process group: the baseline is a plain from_pretrained
        topology = Topology.from_env()
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    else:
        topology, device = init_rank(timeout=600, device_type=device.type)
    if cuda:
        torch.zeros(1, device=device)  # the CUDA context exists before the clock starts, on every path
    baseline = memory_mb("VmRSS")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    config = load_config(model_dir, trusted())
    if mode == "single":
        model = from_pretrained(AutoModelForCausalLM, model_dir, trusted(), dtype=dtype).to(device).eval()
        report = ""
    else:
        groups = init_process_groups(topology, device.type, timeout=600)
        init_deepspeed_comm(topology)
        start = time.perf_counter()
        args = DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=topology.tp_size)
        policy = policy_for_run("auto", config, topology.tp_size)
        if mode == GET_SLICE:
            from ..load.checkpoint import SafetensorsCheckpoint

            SafetensorsCheckpoint.read = _read_with_get_slice
        model = load_model(AutoModelForCausalLM, model_dir, config, inference_args=args, dtype=dtype,
                           mode="shard-aware" if mode == GET_SLICE else mode, trust_remote_code=trusted())
        model, shard = shard_model(model, args, topology, groups, policy_for_model(policy, model, topology.tp_size),
                                   dtype, device=device, pending=pending_load(model))
        report = str(shard)
    sync()
    ready = time.perf_counter() - start
    peak_ready = memory_mb("VmHWM")
    gpu_at_ready = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]], device=device)
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    sync()
    first_generate = time.perf_counter() - start
    with torch.no_grad():  # the next-token logits of the prompt: how far each path is from the reference
        logits = model(input_ids=ids).logits[0, -1].float().cpu()
    torch.save(logits, out_json + ".logits.pt")
    gpu = {"peak_gpu_mb_at_ready": round(gpu_at_ready, 1),
           "peak_gpu_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)} if cuda else {}
    Path(out_json).write_text(json.dumps({
        "mode": mode, "rank": topology.rank, "ready_s": round(ready, 3), "generate_s": round(first_generate, 3),
        "baseline_rss_mb": round(baseline, 1), "peak_rss_at_ready_mb": round(peak_ready, 1),
        "peak_rss_mb": round(memory_mb("VmHWM"), 1), **gpu, "tokens": tokens[0].tolist(), "report": report}))
    return 0


def _run_mode(mode: str, model_dir: Path, tp: int, work: Path, timeout: float, device: str, dtype: str) -> list[dict]:
    outs = [work / f"{mode}_{r}.json" for r in range(1 if mode == "single" else tp)]
    if mode == "single":
        proc = subprocess.run([sys.executable, "-m", "ds_inference_integration.tools.bench_memory", "--worker", mode,
                               str(model_dir), str(outs[0]), device, dtype], timeout=timeout, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"single-process load failed: {proc.stderr[-1500:]}")
    else:
        procs = start_ranks(tp, "ds_inference_integration.tools.bench_memory",
                            ["--worker", mode, str(model_dir), str(work / f"{mode}_{{rank}}.json"), device, dtype],
                            log_dir=work)
        codes = wait_ranks(procs, timeout)
        if any(codes):
            raise RuntimeError(f"{mode} failed: {failure_text(procs, codes)}")
    return [json.loads(p.read_text()) for p in outs]


def _ratios(rows: list[dict], modes: tuple[str, ...] = MODES) -> dict:
    """One repeat's ratios: the worst rank of each path over the single process (and over the full load, where
    it ran)."""
    single = next(r for r in rows if r["mode"] == "single")
    paths = [m for m in modes if m != "single"]

    def worst(mode, key):
        return max(r[key] for r in rows if r["mode"] == mode)

    def both(r):
        return r["ready_s"] + r["generate_s"]

    ratios = {
        "peak_rss_per_rank_over_single": {m: worst(m, "peak_rss_mb") / single["peak_rss_mb"] for m in paths},
        # the same without what the interpreter and libraries hold before loading starts
        "model_rss_per_rank_over_single": {
            m: max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in rows if r["mode"] == m)
            / (single["peak_rss_mb"] - single["baseline_rss_mb"]) for m in paths},
        "ready_time_over_single": {m: worst(m, "ready_s") / single["ready_s"] for m in paths},
        "ready_plus_first_generate_over_single": {
            m: max(both(r) for r in rows if r["mode"] == m) / both(single) for m in paths},
    }
    if "full" in paths:
        full_both = max(both(r) for r in rows if r["mode"] == "full")
        ratios["ready_time_over_full"] = {m: worst(m, "ready_s") / worst("full", "ready_s") for m in paths}
        ratios["ready_plus_first_generate_over_full"] = {
            m: max(both(r) for r in rows if r["mode"] == m) / full_both for m in paths}
    if "peak_gpu_mb" in single:
        ratios["peak_gpu_per_rank_over_single"] = {m: worst(m, "peak_gpu_mb") / single["peak_gpu_mb"] for m in paths}
    return ratios


def bench_memory(config_spec: str, tp: int, out_dir: Path, model_dir: str | None = None,
                 timeout: float = 1200, device: str = "cpu", dtype: str = "fp32", repeats: int = 3,
                 modes: tuple[str, ...] = MODES) -> int:
    """`device` cuda puts each rank's model on its GPU (NCCL) and adds peak GPU memory (allocated by torch) to
    every row; `dtype` is the dtype of the built checkpoint and of every loaded model; `modes` the paths run
    (single, the reference, always)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = ("single", *(m for m in MODES[1:] if m in modes))
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as work:  # the model and its copies: gigabytes
        return _bench_memory(config_spec, tp, out_dir, model_dir, timeout, Path(work), device, dtype, repeats, modes)


def _bench_memory(config_spec: str, tp: int, out_dir: Path, model_dir: str | None, timeout: float, work: Path,
                  device: str = "cpu", dtype: str = "fp32", repeats: int = 3, modes: tuple[str, ...] = MODES) -> int:
    from .shard_command import run_shard

    t0 = time.perf_counter()
    src = Path(model_dir) if model_dir else work / "model"
    if not model_dir:  # in a child process: this one stays small, and so do the ranks it starts
        subprocess.run([sys.executable, "-m", "ds_inference_integration.tools.bench_memory", "--build", config_spec,
                        str(src), dtype], check=True, timeout=timeout)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"model: {src} ({size / 2**20:.0f} MiB of safetensors; built in {time.perf_counter() - t0:.0f} s)", flush=True)
    presharded = work / f"presharded_tp{tp}"
    t0 = time.perf_counter()
    if "pre-sharded" in modes and run_shard(str(src), tp, str(presharded), dtype=dtype, timeout=timeout) != 0:
        return 1
    shard_seconds = time.perf_counter() - t0
    # The files just written go to disk first: the kernel writing back 12 GB of them (the model, then its rank
    # files) while the first repeats ran took CPU from the paths being timed (2 cores; pre-sharded ready over one
    # process: 0.95x (0.73, 1.13) in 3 repeats right after writing, 0.69x (0.58, 0.84) in 8 alternating repeats
    # on the same files minutes later, 2026-12-04).
    os.sync()
    rows = []
    import torch

    for repeat in range(repeats):  # every path once per repeat: each ratio per repeat, then their spread
        for mode in modes:
            for r in _run_mode(mode, presharded if mode == "pre-sharded" else src, tp, work, timeout, device, dtype):
                r["repeat"] = repeat
                rows.append(r)
                print(f"repeat {repeat} {mode:<12} rank {r['rank']}: peak RSS {r['peak_rss_mb']:8.1f} MB (after "
                      f"imports {r['baseline_rss_mb']:.1f}), ready in {r['ready_s']:.2f} s, first generate "
                      f"{r['generate_s']:.2f} s", flush=True)
        reference = torch.load(work / "single_0.json.logits.pt")  # this repeat's files, before the next overwrites
        for r in rows:
            if r["repeat"] == repeat:
                logits = torch.load(work / f"{r['mode']}_{r['rank']}.json.logits.pt")
                r["logits_max_abs_diff_vs_single"] = float((logits - reference).abs().max())
    single = next(r for r in rows if r["mode"] == "single")
    tokens_same = all(r["tokens"] == single["tokens"] for r in rows)
    per_repeat = [_ratios([r for r in rows if r["repeat"] == i], modes) for i in range(repeats)]
    ratios = {name: {m: spread(rs[name][m] for rs in per_repeat) for m in per_repeat[0][name]}
              for name in per_repeat[0]}
    result = {"model_dir": str(src), "checkpoint_mb": round(size / 2**20, 1), "config": config_spec, "tp": tp,
              "device": device, "dtype": dtype, "repeats": repeats,
              "shard_command_s": round(shard_seconds, 2), "rows": rows, "ratios": ratios,
              "tokens_identical": tokens_same}
    (out_dir / "bench_memory.json").write_text(json.dumps(result, indent=2))
    lines = [f"Model: {config_spec or model_dir}, {size / 2**20:.0f} MiB {dtype} safetensors; tp {tp} on {device}; "
             f"`ds-inference shard` took {shard_seconds:.1f} s.", "",
             "| repeat | path | rank | peak RSS MB | RSS after imports MB | ready s | first generate s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['repeat']} | {r['mode']} | {r['rank']} | {r['peak_rss_mb']:.0f} | {r['baseline_rss_mb']:.0f} "
                     f"| {r['ready_s']:.2f} | {r['generate_s']:.2f} |")
    lines += ["", f"Greedy tokens identical across all paths and repeats: {tokens_same}", "",
              f"Ratios, worst rank of each path, median (min, max) over {repeats} repeats:", "",
              "| ratio | " + " | ".join(modes[1:]) + " |", "|---|" + "---|" * len(modes[1:])]
    for name, by_mode in ratios.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{v['median']:.2f} ({v['min']:.2f}, {v['max']:.2f})" for v in by_mode.values()) + " |")
    if "peak_gpu_mb" in single:
        lines.append("Peak GPU memory (torch allocated) per rank, MB: " + ", ".join(
            f"{r['mode']} rank {r['rank']} {r['peak_gpu_mb']:.0f} (at ready {r['peak_gpu_mb_at_ready']:.0f})"
            for r in rows))
    (out_dir / "bench_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if tokens_same else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--build":
        build_config_model(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        from ds_inference_integration.run.lifecycle import exit_now

        rank = os.environ.get("RANK", "0")  # no process-group teardown, as the other tools' rank workers leave
        exit_now(_worker(sys.argv[2], sys.argv[3], sys.argv[4].replace("{rank}", rank), sys.argv[5], sys.argv[6]))
    print("usage: ds-inference bench memory [--config H,L,HEADS,FF,VOCAB] [--tp-size N]", file=sys.stderr)
    sys.exit(2)
