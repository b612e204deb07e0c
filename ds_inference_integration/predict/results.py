"""A run's results files and its speed metrics: upstream's `save_metrics` with every file written atomically and
stamped with the layout and the run, and the speed metrics counted per replica, not per rank. Called by the Trainer
mixin's overrides (`trainer.DeepSpeedInferenceMixin.save_metrics`, `evaluate`, `predict`)."""

from __future__ import annotations

import datetime
import json
import math
import uuid
from pathlib import Path

from ..run.files import write_text_atomic


def save_metrics(output_dir: str | Path, split: str, metrics: dict, tp_size: int, dp_size: int, run_id: str,
                 combined: bool = True) -> None:
    """`<split>_results.json` stamped with the layout it ran at (`tp_size`, `dp_size`) and this run's `run_id`,
    written atomically; `all_results.json` gathers this run's splits only (an earlier run's are not merged in).
    Scripts write their predictions first and metrics last, so metrics on disk always describe a completed
    output."""
    out = Path(output_dir)
    stamped = {"tp_size": tp_size, "dp_size": dp_size, **metrics, "run_id": run_id}
    write_text_atomic(out / f"{split}_results.json", json.dumps(stamped, indent=4, sort_keys=True))
    if combined:
        path = out / "all_results.json"
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            earlier = {}
        merged = {**(earlier if isinstance(earlier, dict) and earlier.get("run_id") == run_id else {}), **stamped}
        write_text_atomic(path, json.dumps(merged, indent=4, sort_keys=True))


def speed_metrics(metrics: dict, prefix: str, num_samples: int | None, eval_batch_size: int, dp_size: int) -> dict:
    """Steps per second counted in one replica's steps (upstream counts a step per process: a replica's ranks each
    count the same step)."""
    runtime = metrics.get(f"{prefix}_runtime")
    if runtime and num_samples:
        steps = math.ceil(num_samples / (eval_batch_size * dp_size))
        metrics[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)
    return metrics


def new_run_id() -> str:
    """This run's identity, stamped into every results file: a later run into the same --output_dir never merges
    its results with an earlier run's, and `ds-inference summary` shows one run's files only."""
    return f"{datetime.datetime.now():%Y%m%dT%H%M%S.%f}-{uuid.uuid4().hex[:6]}"
