"""`ds-inference bench parting`: in bf16, how often the outputs of tp 2 part from one process, with the row-parallel
sums in bf16 (default) and in fp32 (`--reduce_dtype fp32`), beside how often one process parts from itself when
only the batch size changes; and what the fp32 sums cost in predict time, side by side in one run.

Models: a random 26M Llama saved in bf16 (the issue's case: `../shared/research/repro/bf16_parting.sh`), and the two
trained embedded models loaded in bf16 (GPT-2 through run_generation.py, T5 through run_translation.py). Each
line of `generated_predictions.txt` is one output; a parting is a line that differs from one process at batch 8.

    ds-inference bench parting [--repeats 3] [--output bench_parting.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..run.files import write_text_atomic
from ..topology import threads_per_rank
from .bench import REPO, example_path, spread

RUNS = ("one_bs8", "one_bs1", "tp2", "tp2_fp32_sums")


def _random_llama(path: Path) -> Path:
    """The issue's 26M Llama: random, embeddings scaled so that its outputs are not all one token, saved in bf16."""
    import shutil

    import torch
    import transformers as tr

    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    model = tr.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)
    model.to(torch.bfloat16).save_pretrained(path)
    for f in (REPO / "examples" / "models" / "gpt2-num2words-en-ro").glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


def _commands(name: str, model: Path) -> list[str]:
    if name == "t5":
        return [str(REPO / "examples" / "run_translation.py"), "--model_name_or_path", str(model), "--do_predict",
                "--predict_with_generate", "--source_lang", "en", "--target_lang", "ro", "--source_prefix",
                "translate English to Romanian: ", "--max_predict_samples", "200", "--report_to", "none",
                "--bf16", "--per_device_eval_batch_size"]
    new = "48" if name == "llama_26m" else "16"
    return [str(REPO / "examples" / "run_generation.py"), "--model_name_or_path", str(model), "--max_new_tokens", new,
            "--max_prompts", "40" if name == "llama_26m" else "200", "--report_to", "none", "--bf16",
            "--per_device_eval_batch_size"]


def _run(name: str, model: Path, run: str, out: Path) -> dict:
    bin_dir = Path(sys.executable).parent
    batch = "1" if run == "one_bs1" else "8"
    args = [*_commands(name, model), batch, "--output_dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if run.startswith("tp2"):
        cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2", *args, "--deepspeed_inference"]
        cmd += ["--reduce_dtype", "fp32"] if run == "tp2_fp32_sums" else []
        env["OMP_NUM_THREADS"] = str(threads_per_rank(2))
    else:
        cmd = [sys.executable, *args, "--use_cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {run} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    results = json.loads((out / "predict_results.json").read_text())
    return {"lines": (out / "generated_predictions.txt").read_text(encoding="utf-8").splitlines(),
            "seconds": results["predict_runtime"]}


def bench_parting(repeats: int, output: Path) -> int:
    models = {"gpt2_embedded": example_path(REPO / "examples" / "models" / "gpt2-num2words-en-ro",
                                            "ds-inference bench parting"),
              "t5": example_path(REPO / "examples" / "models" / "t5-num2words-en-ro", "ds-inference bench parting")}
    report = {"command": f"ds-inference bench parting --repeats {repeats}", "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench_parting_") as tmp:
        models = {"llama_26m": _random_llama(Path(tmp) / "llama_26m"), **models}
        for name, model in models.items():
            seconds: dict[str, list[float]] = {run: [] for run in RUNS}
            lines: dict[str, list[str]] = {}
            for repeat in range(repeats):
                order = RUNS if repeat % 2 == 0 else RUNS[::-1]  # alternate, so that a drift favours no run
                for run in order:
                    if run == "one_bs1" and repeat:
                        continue  # its partings are all it is for; batch 1 is slow
                    got = _run(name, model, run, Path(tmp) / f"{name}_{run}_{repeat}")
                    seconds[run].append(got["seconds"])
                    if run in lines and got["lines"] != lines[run]:
                        raise RuntimeError(f"{name} {run}: repeat {repeat} gave other outputs than repeat 0")
                    lines[run] = got["lines"]
            ref = lines["one_bs8"]
            row = {"outputs": len(ref)}
            for run in RUNS[1:]:
                row[f"parting_{run}"] = sum(a != b for a, b in zip(lines[run], ref)) + abs(len(lines[run]) - len(ref))
            row["predict_seconds"] = {run: spread(v) for run, v in seconds.items() if v}
            cost = [b / a for a, b in zip(seconds["tp2"], seconds["tp2_fp32_sums"])]
            row["fp32_sums_time_ratio"] = spread(cost)
            report["models"][name] = row
            print(f"{name}: of {len(ref)} outputs, part from one process (batch 8): batch 1 {row['parting_one_bs1']}, "
                  f"tp 2 {row['parting_tp2']}, tp 2 with fp32 sums {row['parting_tp2_fp32_sums']}; fp32 sums take "
                  f"{row['fp32_sums_time_ratio']['median']:.2f}x the predict time (min "
                  f"{row['fp32_sums_time_ratio']['min']:.2f}, max {row['fp32_sums_time_ratio']['max']:.2f}, "
                  f"{len(cost)} repeats)", flush=True)
    write_text_atomic(output, json.dumps(report, indent=1) + "\n")
    return 0
