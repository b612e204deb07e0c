"""`ds-inference`: the project's command line.

    ds-inference policy list              architectures with a policy file
    ds-inference policy show MODEL_TYPE   print that policy file
    ds-inference summary OUTPUT_DIR       one line from a run's *_results.json: BLEU, samples/s, tp x dp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .arguments import InferenceSetupError
from .policy import available_policies, load_policy, resolve_policy


def _policy_list(_: argparse.Namespace) -> int:
    for model_type, path in sorted(available_policies().items()):
        print(f"{model_type:<16} {path.name:<16} {load_policy(path).description}")
    return 0


def _policy_show(ns: argparse.Namespace) -> int:
    policy = resolve_policy("auto", ns.model_type)
    print(f"# {policy.source}")
    print(policy.source.read_text(encoding="utf-8"), end="")
    return 0


def _summary(ns: argparse.Namespace) -> int:
    out = Path(ns.output_dir)
    lines = []
    for prefix in ("eval", "predict"):
        path = out / f"{prefix}_results.json"
        if path.is_file():
            m = json.loads(path.read_text())
            lines.append(
                f"{prefix}: BLEU {m.get(prefix + '_bleu', float('nan')):.2f} | "
                f"{m.get(prefix + '_samples_per_second', float('nan')):.1f} samples/s | "
                f"{m.get(prefix + '_samples')} examples | tp {m.get('tp_size')} x dp {m.get('dp_size')}"
            )
    if not lines:
        raise InferenceSetupError(f"no eval_results.json or predict_results.json in {out}")
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
    summary = sub.add_parser("summary", help="one line per *_results.json of a run")
    summary.add_argument("output_dir")
    summary.set_defaults(func=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except InferenceSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
