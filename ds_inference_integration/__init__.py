"""DeepSpeed tensor-parallel inference for Hugging Face `Trainer.predict`/`evaluate`.

The flow, one folder per step (each folder's __init__ says what is in it):
    arguments, argument_parser -> the --deepspeed_inference flag family, upstream's parser with it
    topology   -> Topology (world = tp x dp), process groups, the mesh accelerate reads
    policy/    -> 1. which linears are row-parallel, how heads are laid out: policies/*.toml checked
                  against the real model (schema), derived where no file exists (derive), checked
                  numerically where nobody has (verify)
    load/      -> 2. the model built on meta; each rank reads only its shard (loaders: load_model;
                  skeleton, keys, readers, checkpoint; presharded: the format of `ds-inference shard`)
    shard/     -> 3. deepspeed.init_inference in place (setup: setup_inference for one rank; inject;
                  attention, experts, mixers: the splits DeepSpeed cannot do)
    predict/   -> 4. the Trainer mixin: same batches per TP group, gather once per replica, rows in
                  input order; lockstep guard, length grouping, streaming and resume, metrics
    run/       -> around every step: how a rank exits, the watchdog, atomic files, the output lock, and
                  starting ranks without a launcher (ranks: the server's replicas and the tools' checks)
    errors     -> the one-line errors; deepspeed_compat: every DeepSpeed-version workaround;
                  extras: the optional packages and the extra that installs each

Our tools (the `ds-inference` commands, the policy checker, the benchmarks) are in
`ds_inference_integration.tools`, apart from this library; the server is `serve/`.
"""

from .arguments import (
    DeepSpeedInferenceArguments,
    parse_args_into_dataclasses,
    prepare_argv,
    translate_legacy_args,
)
from .errors import InferenceSetupError
from .policy.schema import (
    Policy,
    available_policies,
    build_injection_policy,
    check_head_counts,
    load_policy,
    policy_for_run,
    resolve_policy,
)
from .topology import Topology

__version__ = "0.1.0"

# The Trainer classes and the loader import transformers' Trainer (seconds): loaded on first use, so the
# command line (`ds-inference policy list`, ...) does not pay for them.
_LAZY = {
    "InferenceArgumentParser": "argument_parser",
    "load_model": "load.loaders",
    "setup_inference": "shard.setup",
    "InferenceSetup": "shard.setup",
    "LockstepError": "errors",
    "DeepSpeedInferenceMixin": "predict.trainer",
    "DeepSpeedInferenceSeq2SeqTrainer": "predict.trainer",
    "DeepSpeedInferenceTrainer": "predict.trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DeepSpeedInferenceArguments",
    "DeepSpeedInferenceMixin",
    "DeepSpeedInferenceSeq2SeqTrainer",
    "DeepSpeedInferenceTrainer",
    "InferenceArgumentParser",
    "InferenceSetup",
    "InferenceSetupError",
    "LockstepError",
    "Policy",
    "Topology",
    "available_policies",
    "build_injection_policy",
    "check_head_counts",
    "load_model",
    "load_policy",
    "parse_args_into_dataclasses",
    "policy_for_run",
    "prepare_argv",
    "resolve_policy",
    "setup_inference",
    "translate_legacy_args",
]
