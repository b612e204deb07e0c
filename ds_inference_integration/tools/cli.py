"""`ds-inference`: the project's command line.

    ds-inference policy list              architectures with a policy file
    ds-inference policy show MODEL_TYPE   print that policy file
    ds-inference policy suggest MODEL_DIR print a policy file for a local model (shipped, or derived)
    ds-inference policy check MODEL_DIR [MODEL_DIR ...] --tp-size N [--policy FILE] [--json FILE] [--dtype D]
                                          shard over N ranks it starts itself, compare with the unsharded model
    ds-inference shard MODEL_DIR --tp-size N OUT_DIR
                                          write a pre-sharded copy: one safetensors file per rank + manifest
    ds-inference summary OUTPUT_DIR       one line from a run's *_results.json: BLEU, samples/s, tp x dp
    ds-inference serve MODEL_DIR --tp_size T [--dp_size R] [--port 8000] [--max_batch_size 32] ...
                                          the sharded model behind an OpenAI-compatible HTTP server, batching
                                          across requests (`ds-inference serve --help` for every flag)
    ds-inference bench guard [--repeats N] the lock-step guard's cost, guard on vs off, side by side
    ds-inference bench generation [--config 512,8,8] per-sample pipeline vs batched generate vs the
                                          Trainer path (1 process and tp 2): bench.json, bench.md, bench.png
    ds-inference bench memory [--config H,L,HEADS,FF,VOCAB] [--device cpu|cuda] [--dtype fp32|fp16|bf16]
                              [--modes single,pre-sharded,...]
                                          peak RSS (and GPU memory) and time to a ready model per loading
                                          path (single process, full, shard-aware, pre-sharded), side by side
    ds-inference bench predict [--scales 1,10] [--nprocs N]
                                          streamed vs accumulate-everything predict: peak RSS per rank and
                                          examples/s at 1x and 10x the test set
    ds-inference bench serve [--models gpt2,t5,gpt2-256] [--concurrency 1,4,16,64] [--requests 64]
                             [--output_lengths A-B] [--arrival_rate R] [--beam_fraction F] [--disconnects N]
                                          the server (tp 2, --tp_size), continuous vs batched vs --max_batch_size 1:
                                          req/s, tokens/s, p50/p99 latency and time to first token, TPOT,
                                          rows/step; with --disconnects, first token after a client leaves
                                          and idle against one process's
    ds-inference bench steps [--lengths 16,256,1024] [--batches 1,8,31]
                                          the step engine in process: admission cost against the rows running
Every bench repeats its measurements (--repeats, default 3) and gives min / median / max beside each ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arguments import REDUCE_DTYPES
from ..errors import InferenceSetupError
from ..policy.schema import available_policies, shipped_policies


def _policy_list(_: argparse.Namespace) -> int:
    rows = sorted((t, p.source.name, p.description) for p in shipped_policies() for t in p.model_types)
    for model_type, name, description in rows:
        print(f"{model_type:<16} {name:<24} {description}")
    return 0


def _policy_show(ns: argparse.Namespace) -> int:
    paths = [p.source for p in shipped_policies() if ns.model_type in p.model_types]
    if not paths:
        raise InferenceSetupError(f"no policy for model_type {ns.model_type!r}; model types with a policy: "
                                  f"{', '.join(sorted(available_policies()))}")
    for path in paths:
        print(f"# {path}")
        print(path.read_text(encoding="utf-8"))
    return 0


def _policy_suggest(ns: argparse.Namespace) -> int:
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # library log lines must not mix into the TOML
        from ..load.own_code import code_files, load_config, own_model_class
        from ..load.skeleton import model_class_for
        from ..policy.derive import derive_policy
        from ..policy.derive.verdicts import table
        from ..policy.schema import policy_for_config, policy_to_toml

        trust = ns.trust_remote_code
        config = load_config(ns.model_dir, trust)
        shipped = policy_for_config(config)
        if shipped is None:
            from accelerate import init_empty_weights
            from transformers import AutoModel

            own = own_model_class(model_class_for(config, trust), config, trust)
            # parameters on meta, buffers real (the rotary tables the derivation's probe reads through); the model's
            # own class where it ships its code, as its Auto class builds it
            with init_empty_weights(include_buffers=False):
                model = own._from_config(config) if own is not None else AutoModel.from_config(config)
            code = f" (the model's own code: {', '.join(code_files(ns.model_dir))})" if own is not None else ""
            trusted = " --trust_remote_code" if own is not None else ""
            derived = derive_policy(model)
            verdicts = "".join(f"#   {line}\n" for line in table(derived.verdicts))
            text = (f"# derived from {type(model).__name__}{code}; check it with: ds-inference policy check "
                    f"{ns.model_dir} --tp-size 2 --policy FILE{trusted}\n# each mechanism's verdict:\n{verdicts}"
                    f"{policy_to_toml(derived)}")
    if shipped is not None:
        text = f"# shipped policy {shipped.source}\n{shipped.source.read_text(encoding='utf-8')}"
    print(text, end="")
    return 0


def _policy_check(ns: argparse.Namespace) -> int:
    from .policy_check import run_check

    return run_check(ns.model_dirs, ns.tp_size, ns.policy, ns.timeout, json_path=ns.json, dtype=ns.dtype,
                     reduce_dtype=ns.reduce_dtype, trust_remote_code=ns.trust_remote_code)


def _sizes_and_names(ns: argparse.Namespace) -> tuple[list[int], list[str] | None]:
    """`--tp-sizes` (each 2 or more) and `--only` of `policy matrix` and `policy sweep`."""
    tp_sizes = _int_list(ns.tp_sizes, "--tp-sizes")
    if not tp_sizes or any(tp < 2 for tp in tp_sizes):
        raise InferenceSetupError(f"--tp-sizes {ns.tp_sizes!r} is invalid: tp sizes of 2 or more, e.g. 2,4")
    return tp_sizes, [n for n in (ns.only or "").split(",") if n] or None


def _policy_sweep(ns: argparse.Namespace) -> int:
    from .sweep import run_sweep

    tp_sizes, only = _sizes_and_names(ns)
    return run_sweep(tp_sizes, ns.out, only, ns.timeout, ns.json_dir)


def _policy_matrix(ns: argparse.Namespace) -> int:
    from .architecture_zoo import run_matrix

    tp_sizes, only = _sizes_and_names(ns)
    return run_matrix(tp_sizes, ns.json_dir, ns.readme, only, ns.timeout, ns.dtype, ns.add or [],
                      ns.trust_remote_code)


def _tiny_model_arguments(parser: argparse.ArgumentParser, only_help: str) -> None:
    parser.add_argument("--tp-sizes", default="2,4")
    parser.add_argument("--only", default=None, help=only_help)
    parser.add_argument("--json-dir", default=None, help="keep the per-tp `policy check --json` reports here")


def _trust_argument(parser: argparse.ArgumentParser) -> None:
    """upstream's `--trust_remote_code` (and its dashed spelling): run the code a model directory ships (its
    `auto_map`); without it such a directory is refused in one line (`load/own_code.py`)."""
    parser.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                        help="run the modeling code a model directory ships (its config.json's auto_map)")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InferenceSetupError(f"{flag} {text!r} is not a comma-separated list of integers, e.g. 1,10") from None


def _bench_predict(ns: argparse.Namespace) -> int:
    from ..load.own_code import trust_from_here_on
    from .bench_predict import bench_predict

    trust_from_here_on(ns.model, ns.trust_remote_code)  # its ranks read it
    return bench_predict(ns.model, ns.test_file, _int_list(ns.scales, "--scales"), ns.repeats, ns.nprocs,
                         ns.batch_size, ns.max_examples, Path(ns.output_dir), ns.timeout)


def _bench_parting(ns: argparse.Namespace) -> int:
    from .bench_parting import bench_parting

    if ns.repeats < 1:
        raise InferenceSetupError(f"--repeats {ns.repeats} is invalid: at least 1")
    return bench_parting(ns.repeats, Path(ns.output))


def _bench_guard(ns: argparse.Namespace) -> int:
    from .bench import bench_guard

    return bench_guard(ns.repeats, ns.nprocs, Path(ns.output))


def _bench_generation(ns: argparse.Namespace) -> int:
    from .bench import DEFAULT_PROMPTS, METHODS, bench_generation, quiet_repeated_warnings

    quiet_repeated_warnings()  # this command's own process: transformers' per-call warnings once

    return bench_generation(ns.model, ns.config, [int(b) for b in ns.batch_sizes.split(",")],
                            ns.prompts or str(DEFAULT_PROMPTS),
                            ns.max_prompts, ns.new_tokens, Path(ns.output_dir),
                            ns.methods.split(",") if ns.methods else list(METHODS), ns.repeats, ns.trust_remote_code)


def _shard(ns: argparse.Namespace) -> int:
    from .shard_command import run_shard

    return run_shard(ns.model_dir, ns.tp_size, ns.out_dir, ns.policy, ns.dtype, ns.timeout, ns.trust_remote_code)


def _bench_memory(ns: argparse.Namespace) -> int:
    from ..load.own_code import trust_from_here_on
    from .bench_memory import MODES, bench_memory

    trust_from_here_on(ns.model, ns.trust_remote_code)  # its ranks read it
    modes = tuple(m for m in ns.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: --modes {bad[0]!r} is not a loading path; valid: {', '.join(MODES)}", file=sys.stderr)
        return 2
    return bench_memory(ns.config, ns.tp_size, Path(ns.output_dir), ns.model, ns.timeout, ns.device, ns.dtype,
                        ns.repeats, modes)


def _serve(ns: argparse.Namespace) -> int:
    if ns.args and ns.args[0] in ("-h", "--help"):
        from transformers import HfArgumentParser

        from ..arguments import DeepSpeedInferenceArguments
        from ..serve.settings import ServeArguments

        parser = HfArgumentParser((ServeArguments, DeepSpeedInferenceArguments), prog="ds-inference serve MODEL_DIR")
        parser.print_help()
        return 0
    if "--worker" in ns.args:  # a worker node's ranks: no HTTP front, no [serve] extra needed
        from ..serve.worker import main as worker_main

        return worker_main(ns.args)
    from ..serve.app import main as serve_main  # the [serve] extra: one line if it is missing

    return serve_main(ns.args)


def _bench_serve(ns: argparse.Namespace) -> int:
    from .bench_serve import parse_lengths, run_bench

    run_bench(ns.models.split(","), _int_list(ns.concurrency, "--concurrency"), ns.requests, ns.repeats, ns.tp_size,
              ns.max_wait_ms, ns.point_timeout, Path(ns.output_dir), ns.modes.split(","),
              parse_lengths(ns.output_lengths), ns.arrival_rate, ns.beam_fraction, ns.disconnects)
    print(f"wrote {ns.output_dir}/bench_serve.json, bench_serve.md, bench_serve.png")
    return 0


def _bench_steps(ns: argparse.Namespace) -> int:
    from .bench_steps import run_bench_steps

    lengths, batches = _int_list(ns.lengths, "--lengths"), _int_list(ns.batches, "--batches")
    if ns.together < 2:
        raise InferenceSetupError(f"--together {ns.together} is too few; valid: 2 or more rows admitted at once")
    run_bench_steps(lengths, batches, ns.repeats, ns.hidden, ns.layers, Path(ns.output_dir), ns.together, ns.model)
    print(f"wrote {ns.output_dir}/bench_steps.json, bench_steps.md")
    return 0


def _summary(ns: argparse.Namespace) -> int:
    """One line per results file of the newest run in OUTPUT_DIR; files of earlier runs are named, not shown."""
    out = Path(ns.output_dir)
    found = {}
    for prefix in ("eval", "predict"):
        path = out / f"{prefix}_results.json"
        if path.is_file():
            try:
                found[prefix] = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                raise InferenceSetupError(f"{path} is not valid JSON") from None
    if not found:
        raise InferenceSetupError(f"no eval_results.json or predict_results.json in {out}")
    newest = max(str(m.get("run_id", "")) for m in found.values())  # run ids start with their start time
    lines = []
    for prefix, m in found.items():
        if str(m.get("run_id", "")) != newest:
            lines.append(f"({prefix}_results.json is from an earlier run ({m.get('run_id', 'unstamped')}): not shown)")
            continue
        lines.append(
            f"{prefix}: BLEU {m.get(prefix + '_bleu', float('nan')):.2f} | "
            f"{m.get(prefix + '_samples_per_second', float('nan')):.1f} samples/s | "
            f"{m.get(prefix + '_samples')} examples | tp {m.get('tp_size')} x dp {m.get('dp_size')} | run {newest}"
        )
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-inference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    policy = sub.add_parser("policy", help="inspect injection policies")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    psub.add_parser("list", help="architectures with a policy file").set_defaults(func=_policy_list)
    show = psub.add_parser("show", help="print the policy file for a model_type")
    show.add_argument("model_type")
    show.set_defaults(func=_policy_show)
    suggest = psub.add_parser("suggest", help="print a policy file for a local model directory")
    suggest.add_argument("model_dir")
    _trust_argument(suggest)
    suggest.set_defaults(func=_policy_suggest)
    check = psub.add_parser("check", help="shard over N ranks and compare with the unsharded model")
    check.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR")
    check.add_argument("--tp-size", type=int, required=True)
    check.add_argument("--policy", default="auto", help="auto (default), autotp, derive, or a policy file")
    check.add_argument("--timeout", type=float, default=300, help="seconds before the ranks are killed")
    check.add_argument("--json", metavar="FILE", help="also write every check's result and figures to FILE")
    check.add_argument("--dtype", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                       help="check in the dtype the run will use; auto (default): the checkpoint's. In fp16/bf16 "
                            "differences are judged against the unsharded model's own rounding noise")
    check.add_argument("--reduce-dtype", default="model", choices=REDUCE_DTYPES,
                       help="the run's --reduce_dtype: fp32 sums the row-parallel partial products in fp32")
    _trust_argument(check)
    check.set_defaults(func=_policy_check)
    matrix = psub.add_parser("matrix", help="policy check on tiny models of every architecture the project checks; "
                                           "docs/policies.md's architecture table")
    _tiny_model_arguments(matrix, "comma-separated zoo names (default: all)")
    matrix.add_argument("--readme", default=None, help="rewrite the table between this file's markers")
    matrix.add_argument("--timeout", type=float, default=1200, help="seconds per tp size before the ranks are killed")
    matrix.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"),
                        help="save the tiny checkpoints in this dtype and check in it (the architecture table: fp32)")
    matrix.add_argument("--add", nargs="+", metavar="MODEL_DIR", default=None,
                        help="also check these model directories (rows after the zoo's; alone, without --only: only "
                             "these)")
    _trust_argument(matrix)
    matrix.set_defaults(func=_policy_matrix)
    sweep = psub.add_parser("sweep", help="policy check on a tiny model of every model type transformers generates "
                                         "with that the architecture table does not hold (docs/sweep.md)")
    _tiny_model_arguments(sweep, "comma-separated model types (default: every one)")
    sweep.add_argument("--out", default=None, help="write the table to this file")
    sweep.add_argument("--timeout", type=float, default=900, help="seconds per launch before the ranks are killed")
    sweep.set_defaults(func=_policy_sweep)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    parting = bsub.add_parser("parting", help="bf16: how often tp 2 parts from one process, with bf16 and fp32 sums")
    parting.add_argument("--repeats", type=int, default=3)
    parting.add_argument("--output", default="bench_parting.json")
    parting.set_defaults(func=_bench_parting)
    guard = bsub.add_parser("guard", help="lock-step guard on vs off, predict on the embedded default")
    guard.add_argument("--repeats", type=int, default=3)
    guard.add_argument("--nprocs", type=int, default=2)
    guard.add_argument("--output", default="bench_guard.json")
    guard.set_defaults(func=_bench_guard)
    gen = bsub.add_parser("generation", help="per-sample pipeline vs batched generate vs the Trainer path")
    gen.add_argument("--model", default=None, help="model directory (default: the embedded GPT-2)")
    gen.add_argument("--config", default=None, help="also a random GPT-2 of n_embd,n_layer,n_head, e.g. 512,8,8")
    gen.add_argument("--batch-sizes", default="1,2,4,8,16")
    gen.add_argument("--prompts", default=None, help="prompts file (default: the repository's examples/data/prompts.txt)")
    gen.add_argument("--max-prompts", type=int, default=32, help="this many prompts: the file's, repeated in order")
    gen.add_argument("--new-tokens", type=int, default=16)
    gen.add_argument("--methods", default=None, help="comma-separated subset of the methods")
    gen.add_argument("--repeats", type=int, default=3,
                     help="every method this many times, interleaved; figures and ratios with their spread")
    gen.add_argument("--output-dir", default="bench_out")
    _trust_argument(gen)
    gen.set_defaults(func=_bench_generation)
    pred = bsub.add_parser("predict", help="streamed vs accumulate-everything predict: peak RSS and throughput "
                                            "at 1x and 10x the test set")
    pred.add_argument("--model", default=None, help="seq2seq model directory (default: the embedded T5)")
    pred.add_argument("--test-file", default=None, help="json-lines translation file (default: the embedded test set)")
    pred.add_argument("--scales", default="1,10", help="the test set repeated this many times, comma-separated")
    pred.add_argument("--repeats", type=int, default=3)
    pred.add_argument("--nprocs", type=int, default=1, help="ranks (tensor parallel over all of them)")
    pred.add_argument("--batch-size", type=int, default=16)
    pred.add_argument("--max-examples", type=int, default=None, help="first N examples of the test file (before repeating)")
    pred.add_argument("--timeout", type=float, default=1800, help="seconds per measurement before the ranks are killed")
    pred.add_argument("--output-dir", default="bench_out")
    _trust_argument(pred)
    pred.set_defaults(func=_bench_predict)
    mem = bsub.add_parser("memory", help="peak RSS and time to ready per loading path, side by side")
    mem.add_argument("--config", default="2048,32,16,5504,8192",
                     help="Llama hidden,layers,heads,intermediate,vocab (default: about 6.3 GB in fp32)")
    mem.add_argument("--model", default=None, help="an existing safetensors model directory instead of --config")
    mem.add_argument("--tp-size", type=int, default=2)
    mem.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where each rank's model goes")
    mem.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"),
                     help="dtype of the built checkpoint and of every loaded model")
    mem.add_argument("--timeout", type=float, default=1200)
    mem.add_argument("--repeats", type=int, default=3, help="every path this many times; ratios with their spread")
    mem.add_argument("--output-dir", default="bench_out")
    mem.add_argument("--modes", default="single,full,shard-aware,shard-aware-get-slice,pre-sharded",
                     help="the loading paths to run, comma-separated (single, the reference, always runs)")
    _trust_argument(mem)
    mem.set_defaults(func=_bench_memory)
    bserve = bsub.add_parser("serve", help="serve (tp 2 by default): the step engine, the batch engine and one request "
                                                 "at a time side by side, at each concurrency")
    bserve.add_argument("--models", default="gpt2,t5", help="models to serve: gpt2, t5 (the embedded ones), "
                        "gpt2-256 (a random 2-layer GPT-2 of 256 positions, built at start)")
    bserve.add_argument("--concurrency", default="1,4,16,64", help="clients at once, comma-separated")
    bserve.add_argument("--requests", type=int, default=64, help="requests per point (each concurrency, each repeat)")
    bserve.add_argument("--repeats", type=int, default=3)
    bserve.add_argument("--tp_size", type=int, default=2)
    bserve.add_argument("--max_wait_ms", type=float, default=20.0)
    bserve.add_argument("--point_timeout", type=float, default=120.0, help="a point stops sending after this long")
    bserve.add_argument("--modes", default="continuous,batched,one_at_a_time",
                        help="servers to compare: continuous (the step engine), continuous_grouped (the step "
                             "engine, --waiting_served_ratio 0.5 --max_waiting_steps 8), batched (--scheduler batch), "
                             "one_at_a_time (--scheduler batch --max_batch_size 1)")
    bserve.add_argument("--output_lengths", default=None,
                        help="A-B: each request's max_tokens drawn from A to B (default: 24 for every request)")
    bserve.add_argument("--arrival_rate", type=float, default=None,
                        help="requests per second, sent at Poisson arrival times (default: each client sends its next "
                             "request as soon as it has its answer)")
    bserve.add_argument("--beam_fraction", type=float, default=0.0,
                        help="share of the requests that are beam requests (4 beams, not streamed)")
    bserve.add_argument("--disconnects", type=int, default=0,
                        help="N: also the time to first token right after a client left a long stream, N times, "
                             "against the idle server's, and the idle server's against one process's")
    bserve.add_argument("--output-dir", default="bench_out")
    bserve.set_defaults(func=_bench_serve)
    bsteps = bsub.add_parser("steps", help="the step engine in this process: an admission's cost against the rows "
                                           "running, a shared decoding step against single-row ones")
    bsteps.add_argument("--lengths", default="16,256,1024", help="prompt tokens of the admitted and running rows")
    bsteps.add_argument("--batches", default="1,8,31", help="rows running when one is admitted (the first is the "
                                                           "baseline of the ratios)")
    bsteps.add_argument("--together", type=int, default=16, help="rows admitted at once, against one alone")
    bsteps.add_argument("--model", default="llama", choices=("llama", "gpt2-256", "t5"),
                        help="a random Llama of --hidden and --layers, or bench serve's model of that name")
    bsteps.add_argument("--hidden", type=int, default=512)
    bsteps.add_argument("--layers", type=int, default=4)
    bsteps.add_argument("--repeats", type=int, default=5)
    bsteps.add_argument("--output-dir", default="bench_out")
    bsteps.set_defaults(func=_bench_steps)
    shard = sub.add_parser("shard", help="write a pre-sharded copy of a model directory (one file per rank)")
    shard.add_argument("model_dir")
    shard.add_argument("--tp-size", type=int, required=True)
    shard.add_argument("out_dir")
    shard.add_argument("--policy", default="auto", help="auto (default), autotp, derive, or a policy file")
    shard.add_argument("--dtype", default="fp32", help="dtype of the rank files: fp32 (default), fp16, bf16")
    shard.add_argument("--timeout", type=float, default=1800)
    _trust_argument(shard)
    shard.set_defaults(func=_shard)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible), sharded over --tp_size ranks",
                           add_help=False)
    serve.add_argument("args", nargs=argparse.REMAINDER, help="MODEL_DIR and the serve flags (--help lists them)")
    serve.set_defaults(func=_serve)
    summary = sub.add_parser("summary", help="one line per *_results.json of a run")
    summary.add_argument("output_dir")
    summary.set_defaults(func=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # its flags are the server's and the flag family's dataclasses (HfArgumentParser)
        ns = argparse.Namespace(args=argv[1:], func=_serve)
    else:
        ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except InferenceSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`ds-inference policy list | head`): end quietly, as a shell tool does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise it again
        return 1


if __name__ == "__main__":
    sys.exit(main())
