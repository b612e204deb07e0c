#!/usr/bin/env python
"""GPU check (prepared for one H200, no download, < 8 minutes): a ~1B-parameter Llama-style model
built from a config, fp16 and bf16, with and without DeepSpeed kernel injection, batch sizes 1-64;
greedy generation tokens/s and peak GPU memory, written to one json file. Each configuration that
fails is recorded with its error instead of stopping the run.

    launch/gpu_check.sh [OUT.json]            # on the GPU machine
    python launch/gpu_check.py --tiny --out x.json   # CPU smoke test of the script itself
"""

import argparse
import json
import time

import torch


def build(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=256)
    else:  # ~1.1B parameters
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return cfg, model


def run_config(cfg, dtype, kernel_inject: bool, batch_sizes, prompt_len: int, new_tokens: int, device) -> list[dict]:
    import deepspeed
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds, not minutes, for 1B parameters
        model = LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    if kernel_inject or device.type == "cuda":
        model = deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=kernel_inject).module
    rows = []
    for bs in batch_sizes:
        ids = torch.randint(3, cfg.vocab_size, (bs, prompt_len), device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append({"batch_size": bs, "seconds": round(seconds, 4), "new_tokens": bs * new_tokens,
                     "tokens_per_s": round(bs * new_tokens / seconds, 1),
                     "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, to test the script")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, meta_model = build(args.tiny)
    n_params = sum(p.numel() for p in meta_model.parameters())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16} if device.type == "cuda" else {"fp32": torch.float32}
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "params": n_params,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch": torch.__version__, "runs": []}
    for dtype_name, dtype in dtypes.items():
        for kernel_inject in (False, True):
            entry = {"dtype": dtype_name, "kernel_inject": kernel_inject}
            start = time.perf_counter()
            try:
                entry["rows"] = run_config(cfg, dtype, kernel_inject, batch_sizes, args.prompt_len, args.new_tokens, device)
            except Exception as e:  # record and go on: one failing mode must not lose the others
                entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            entry["seconds"] = round(time.perf_counter() - start, 1)
            report["runs"].append(entry)
            print(json.dumps(entry), flush=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
