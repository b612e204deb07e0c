"""`ds-inference bench predict`: the streamed predict path (`predict_to_file`) against the accumulate-everything
path (`trainer.predict`, then decode and write, as upstream's run_translation.py does), side by side, on the
embedded translation model with its test set repeated 1x and 10x (`--scales`): peak host RSS per rank and
examples per second, each measurement in fresh rank processes (a process's peak is its own), the two paths
alternating within each repeat; every ratio is given with the min / median / max over the repeats.

    ds-inference bench predict [--scales 1,10] [--repeats 3] [--nprocs 1] [--batch-size 16]

The ranks are started with `ranks.start_ranks`, the one way the tools start local ranks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import InferenceSetupError
from ..run.ranks import failure_text, start_ranks, wait_ranks
from .bench import REPO, example_path, quiet_repeated_warnings, spread

PATHS = ("streaming", "accumulating")
DEFAULT_MODEL = REPO / "examples" / "models" / "t5-num2words-en-ro"
DEFAULT_TEST = REPO / "examples" / "data" / "num2words" / "test.json"
PREFIX = "translate English to Romanian: "


def bench_predict(model: str | None, test_file: str | None, scales: list[int], repeats: int, nprocs: int,
                  batch_size: int, max_examples: int | None, out_dir: Path, timeout: float = 1800) -> int:
    model = Path(model) if model else example_path(DEFAULT_MODEL, "ds-inference bench predict", "--model MODEL_DIR")
    test_file = Path(test_file) if test_file else example_path(DEFAULT_TEST, "ds-inference bench predict",
                                                               "--test-file FILE")
    if not (model / "config.json").is_file():
        raise InferenceSetupError(f"--model {str(model)!r} is not a model directory (no config.json)")
    if not test_file.is_file():
        raise InferenceSetupError(f"--test-file {str(test_file)!r} does not exist")
    if not scales or min(scales) < 1 or repeats < 1 or nprocs < 1 or batch_size < 1:
        raise InferenceSetupError(f"--scales {scales}, --repeats {repeats}, --nprocs {nprocs}, --batch-size "
                                  f"{batch_size}: each must be at least 1")
    from ..extras import optional_import

    for module in ("datasets", "sacrebleu"):  # the ranks import them: said here once, before any rank starts
        optional_import(module, "ds-inference bench predict")
    rows = [line for line in test_file.read_text(encoding="utf-8").splitlines() if line.strip()][:max_examples]
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else every rank warns that it fell back to the CPU
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_predict_") as tmp:
        for scale in scales:
            data = Path(tmp) / f"test_x{scale}.json"
            data.write_text("\n".join(rows * scale) + "\n", encoding="utf-8")
        for repeat in range(repeats):
            for scale in scales:
                # alternate which path goes first, so that a drift of the machine does not favour one
                for path in (PATHS if repeat % 2 == 0 else PATHS[::-1]):
                    work = Path(tmp) / f"{path}_x{scale}_r{repeat}"
                    work.mkdir()
                    procs = start_ranks(nprocs, "ds_inference_integration.tools.bench_predict",
                                        ["--worker", str(work), path, str(model), str(Path(tmp) / f"test_x{scale}.json"),
                                         str(batch_size)], log_dir=work)
                    codes = wait_ranks(procs, timeout)
                    if any(codes):
                        raise RuntimeError(f"bench predict ({path}, x{scale}) failed: {failure_text(procs, codes)}")
                    ranks = [json.loads((work / f"result-{r}.json").read_text()) for r in range(nprocs)]
                    run = {"path": path, "scale": scale, "repeat": repeat, "examples": ranks[0]["examples"],
                           "seconds": max(r["seconds"] for r in ranks),
                           "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
                           "rss_before_mb": [r["rss_before_mb"] for r in ranks], "bleu": ranks[0]["bleu"],
                           "predictions_sha": ranks[0]["predictions_sha"]}
                    run["examples_per_s"] = round(run["examples"] / run["seconds"], 2)
                    runs.append(run)
                    print(f"repeat {repeat} x{scale:<3} {path:<12} {run['examples']:6d} examples "
                          f"{run['seconds']:8.2f} s {run['examples_per_s']:8.2f} ex/s  peak RSS "
                          f"{', '.join(f'{m:.0f}' for m in run['peak_rss_mb'])} MB  BLEU {run['bleu']}", flush=True)
    summary = summarise(runs, scales)
    summary.update(setup={"model": str(model), "test_file": str(test_file), "examples_1x": len(rows),
                          "scales": scales, "repeats": repeats, "nprocs": nprocs, "batch_size": batch_size},
                   runs=runs, command="ds-inference bench predict " + " ".join(sys.argv[3:]))
    (out_dir / "bench_predict.json").write_text(json.dumps(summary, indent=2) + "\n")
    for line in summary["lines"]:
        print(line)
    return 0 if summary["same_output"] else 1


def summarise(runs: list[dict], scales: list[int]) -> dict:
    """Ratios per repeat (each repeat's two paths, or two scales, side by side), then their spread."""
    def pick(path, scale, repeat):
        return next(r for r in runs if (r["path"], r["scale"], r["repeat"]) == (path, scale, repeat))

    repeats = sorted({r["repeat"] for r in runs})
    lo, hi = min(scales), max(scales)
    ratios = {
        f"streaming_peak_rss_x{hi}_over_x{lo}": spread(
            max(pick("streaming", hi, i)["peak_rss_mb"]) / max(pick("streaming", lo, i)["peak_rss_mb"]) for i in repeats),
        f"accumulating_peak_rss_x{hi}_over_x{lo}": spread(
            max(pick("accumulating", hi, i)["peak_rss_mb"]) / max(pick("accumulating", lo, i)["peak_rss_mb"])
            for i in repeats),
    }
    for scale in scales:
        ratios[f"throughput_streaming_over_accumulating_x{scale}"] = spread(
            pick("streaming", scale, i)["examples_per_s"] / pick("accumulating", scale, i)["examples_per_s"]
            for i in repeats)
        ratios[f"peak_rss_streaming_over_accumulating_x{scale}"] = spread(
            max(pick("streaming", scale, i)["peak_rss_mb"]) / max(pick("accumulating", scale, i)["peak_rss_mb"])
            for i in repeats)
    # both paths must produce the same predictions and BLEU at each scale, or the comparison means nothing
    same = all(len({(r["predictions_sha"], r["bleu"]) for r in runs if r["scale"] == s}) == 1 for s in scales)
    lines = [f"{name}: median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}, {v['n']} repeats)"
             for name, v in ratios.items()]
    lines.append("predictions and BLEU identical between the paths at every scale: " + ("yes" if same else "NO"))
    return {"ratios": ratios, "same_output": same, "lines": lines}


# Worker side: one rank of one measurement ---------------------------------------------------------------

def _worker(work: str, path: str, model_dir: str, test_file: str, batch_size: int) -> int:
    import hashlib

    import numpy as np
    import torch
    from transformers import (
        AutoModelForSeq2SeqLM,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainingArguments,
        logging,
    )

    from ..arguments import DeepSpeedInferenceArguments
    from ..load.own_code import from_pretrained, load_tokenizer, trusted
    from ..predict.metrics import CorpusBleu
    from ..predict.trainer import DeepSpeedInferenceSeq2SeqTrainer
    from ..run.memory import PeakRss, memory_mb
    from ..topology import Topology

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    from ..extras import optional_import

    sacrebleu = optional_import("sacrebleu", "ds-inference bench predict")
    datasets = optional_import("datasets", "ds-inference bench predict")
    datasets.disable_progress_bars()
    load_dataset = datasets.load_dataset
    quiet_repeated_warnings()
    topology = Topology.from_env()
    tok = load_tokenizer(model_dir, trusted())
    model = from_pretrained(AutoModelForSeq2SeqLM, model_dir, trusted(), dtype=torch.float32).eval()
    raw = load_dataset("json", data_files={"test": test_file})["test"]

    def encode(batch):
        enc = tok([PREFIX + t["en"] for t in batch["translation"]], max_length=128, truncation=True)
        enc["labels"] = tok(text_target=[t["ro"] for t in batch["translation"]], max_length=128,
                            truncation=True)["input_ids"]
        return enc

    data = raw.map(encode, batched=True, remove_columns=raw.column_names)
    args = Seq2SeqTrainingArguments(output_dir=work, per_device_eval_batch_size=batch_size, predict_with_generate=True,
                                    report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                                    generation_max_length=128)
    trainer = DeepSpeedInferenceSeq2SeqTrainer(
        model=model, args=args, processing_class=tok, data_collator=DataCollatorForSeq2Seq(tok, model=model),
        inference_args=DeepSpeedInferenceArguments(deepspeed_inference=topology.world_size > 1,
                                                   tp_size=topology.world_size))
    predictions = Path(work) / "generated_predictions.txt"
    rss_before = memory_mb("VmRSS")
    with PeakRss() as peak:
        start = time.perf_counter()
        if path == "streaming":
            metrics = trainer.predict_to_file(data, metric=CorpusBleu(), fresh=True)
            bleu = metrics.get("predict_bleu")
        else:  # upstream's run_translation.py: every prediction in memory, then decoded and written at the end
            out = trainer.predict(data, metric_key_prefix="predict")
            bleu = None
            if trainer.is_world_process_zero():
                preds = np.where(out.predictions != -100, out.predictions, tok.pad_token_id)
                lines = [p.strip() for p in tok.batch_decode(preds, skip_special_tokens=True,
                                                              clean_up_tokenization_spaces=True)]
                labels = np.where(out.label_ids != -100, out.label_ids, tok.pad_token_id)
                refs = [x.strip() for x in tok.batch_decode(labels, skip_special_tokens=True)]
                bleu = round(float(sacrebleu.corpus_bleu(lines, [refs]).score), 4)
                predictions.write_text("\n".join(lines) + "\n", encoding="utf-8")
        seconds = time.perf_counter() - start
    sha = hashlib.sha256(predictions.read_bytes()).hexdigest()[:16] if predictions.is_file() else None
    Path(work, f"result-{topology.rank}.json").write_text(json.dumps(
        {"examples": len(data), "seconds": seconds, "peak_rss_mb": peak.mb, "rss_before_mb": round(rss_before, 1),
         "bleu": bleu, "predictions_sha": sha}))
    if topology.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        from ds_inference_integration.run.lifecycle import exit_now

        exit_now(_worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])))  # no teardown
    print("usage: ds-inference bench predict [--scales 1,10] [--repeats 3]", file=sys.stderr)
    sys.exit(2)
