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

REPO = Path(__file__).resolve().parent.parent
RUN_TRANSLATION = REPO / "examples" / "run_translation.py"


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
