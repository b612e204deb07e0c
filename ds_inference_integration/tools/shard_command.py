"""`ds-inference shard MODEL_DIR --tp-size N OUT_DIR`: write a pre-sharded copy of a model directory.

It starts N local ranks (CPU processes when there is no GPU). Each builds the model on `meta`, reads
only its slices of the safetensors checkpoint (shard-aware loading), lets DeepSpeed split it exactly
as `--deepspeed_inference` does, and saves what it holds to `rank-R-of-N.safetensors`. Rank 0 adds
`manifest.json` (tp size, policy and its hash, dtype, the source path and its sha256) and copies the
config and tokenizer files, so OUT_DIR is a model directory: `--model_name_or_path OUT_DIR` with the
same tp size makes every rank read its own file and nothing else.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ..run.ranks import failure_text, start_ranks, wait_ranks


def run_shard(model_dir: str, tp_size: int, out_dir: str, policy: str = "auto", dtype: str = "fp32",
              timeout: float = 1800, trust_remote_code: bool = False) -> int:
    from ..arguments import DTYPES
    from ..load.checkpoint import checkpoint_files
    from ..load.own_code import check_trust
    from ..load.presharded import start_writing

    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        print(f"error: {src} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if checkpoint_files(src) is None:
        print(f"error: {src} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
              "save it with save_pretrained(safe_serialization=True)", file=sys.stderr)
        return 2
    if tp_size < 1:
        print(f"error: --tp-size {tp_size} is invalid: it must be a positive integer", file=sys.stderr)
        return 2
    # a directory with its own code: refused here without the option; with it, the copy carries the code files
    # (every file but the weights is copied) and loads back with the same option
    check_trust(src, trust_remote_code)
    if dtype not in DTYPES:
        print(f"error: --dtype {dtype!r} is invalid; valid: {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    if policy not in ("auto", "autotp", "derive"):
        from ..policy.schema import load_policy

        load_policy(policy)  # a missing or malformed policy file: one line now, before any rank starts
    if out.resolve() == src.resolve():
        print("error: OUT_DIR must differ from MODEL_DIR", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()) and not _presharded_before(out):
        print(f"error: {out} exists and is not a pre-sharded directory; choose an empty or new directory",
              file=sys.stderr)
        return 2
    start_writing(out)  # the old manifest goes first: until the new one is written, the directory does not load
    with tempfile.TemporaryDirectory(prefix="ds_inference_shard_") as status:
        procs = start_ranks(tp_size, "ds_inference_integration.tools.shard_command",
                            ["--worker", str(src), str(out), policy, dtype, status, str(int(trust_remote_code))],
                            log_dir=status)
        codes = wait_ranks(procs, timeout)
        result, error = Path(status, "result.json"), Path(status, "error.txt")
        if not all(c == 0 for c in codes) or not result.is_file():
            print(f"error: {error.read_text().strip() if error.is_file() else failure_text(procs, codes)}",
                  file=sys.stderr)
            return 1
        report = json.loads(result.read_text())
    sizes = ", ".join(f"{f['bytes'] / 2**20:.1f} MiB" for f in report["files"])
    print(f"wrote {out}: {tp_size} rank files ({sizes}), "
          f"policy {report['policy']}, source sha256 {report['source']['sha256'][:12]}")
    return 0


def _presharded_before(out: Path) -> bool:
    """A directory `shard` wrote before, completely or not (a manifest, rank files, or their temporary files)."""
    from ..load.presharded import MANIFEST, RANK_FILE

    return any(p.name == MANIFEST or RANK_FILE.fullmatch(p.name) or (p.name.startswith(".rank-") and
                                                                      p.name.endswith(".tmp"))
               for p in out.iterdir())


def _worker(src: str, out: str, policy_spec: str, dtype_name: str, status: str, trust: str = "0") -> int:
    from ..arguments import DTYPES, DeepSpeedInferenceArguments, InferenceSetupError
    from ..deepspeed_compat import init_deepspeed_comm
    from ..load.loaders import load_model, pending_load, policy_id
    from ..load.own_code import load_config
    from ..load.presharded import write_presharded
    from ..load.skeleton import model_class_for
    from ..policy.derive import policy_for_model
    from ..policy.schema import policy_for_run
    from ..run.ranks import init_rank
    from ..shard.inject import shard_model
    from ..topology import init_process_groups

    topology, device = init_rank(timeout=300)
    try:
        groups = init_process_groups(topology, device.type, timeout=300)
        init_deepspeed_comm(topology)
        dtype = DTYPES[dtype_name]
        trusted = trust == "1"
        config = load_config(src, trusted)
        cls = model_class_for(config, trusted)
        args = DeepSpeedInferenceArguments(deepspeed_inference=True, tp_size=topology.tp_size,
                                           injection_policy=policy_spec)
        policy = None if policy_spec == "autotp" else policy_for_run(policy_spec, config, topology.tp_size)
        try:
            model = load_model(cls, src, config, inference_args=args, dtype=dtype, mode="shard-aware",
                               trust_remote_code=trusted)
        except InferenceSetupError as e:
            if not getattr(e, "needs_conversion", False):
                raise
            # a checkpoint transformers converts at load, not only slices (Kimi-Linear's and OLMo-Hybrid's
            # convolutions, HRM's gqkv_proj, DeepSeek-V4's experts): loaded full on every rank, as a run's `--loading
            # auto` loads it. The command refused it before, naming `--loading full`, an option it does not have.
            if topology.rank == 0:
                why = str(e).split(f"{src}: ", 1)[-1].split("; valid here:", 1)[0]
                print(f"warning: {src}: {why}: loaded full on every rank", file=sys.stderr)
            model = load_model(cls, src, config, inference_args=args, dtype=dtype, mode="full",
                               trust_remote_code=trusted)
        policy = policy_for_model(policy, model, topology.tp_size)
        model, report = shard_model(model, args, topology, groups, policy, dtype, device=device, pending=pending_load(model))
        manifest = write_presharded(model, Path(src), Path(out), topology, groups,
                                    policy_id(report.policy_object or policy), dtype)
        if manifest is not None:
            Path(status, "result.json").write_text(json.dumps(manifest))
    except InferenceSetupError as e:
        if topology.rank == 0:
            Path(status, "error.txt").write_text(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        from ds_inference_integration.run.lifecycle import exit_now

        exit_now(_worker(*sys.argv[2:]))  # no process-group teardown (gloo can abort at interpreter exit)
    print("usage: ds-inference shard MODEL_DIR --tp-size N OUT_DIR", file=sys.stderr)
    sys.exit(2)
