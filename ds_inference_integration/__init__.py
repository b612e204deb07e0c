"""DeepSpeed tensor-parallel inference for Hugging Face `Trainer.predict`/`evaluate`.

The flow, one module per step:
    arguments  -> DeepSpeedInferenceArguments (the --deepspeed_inference flag family);
                  argument_parser: InferenceArgumentParser, upstream's parser with them prepared
    topology   -> Topology (world = tp x dp), process groups, the mesh accelerate reads
    policy     -> policies/*.toml, validated against the real model
    loading    -> the model built on meta; each rank reads only its shard (checkpoint: the reader,
                  presharded: the directory format of `ds-inference shard`)
    inference_setup -> setup_inference: all of the above for one rank, with or without a Trainer
    inject     -> deepspeed.init_inference, in place (attention: head splits DeepSpeed cannot do;
                  verify_policy: a policy nobody checked, checked)
    trainer    -> same batches per TP group, gather once per replica, rows in input order
                  (lockstep: the guard; length_grouping: --group_by_length in predict)
                  (files: atomic outputs; watchdog: a rank that stops answering ends the run;
                  lifecycle: how a rank exits)
    errors     -> the one-line errors; deepspeed_compat: every DeepSpeed-version workaround

Our tools (the `ds-inference` commands, the policy checker, the benchmarks, rank launching) are in
`ds_inference_integration.tools`, apart from this library.
"""

from .arguments import (
    DeepSpeedInferenceArguments,
    parse_args_into_dataclasses,
    prepare_argv,
    translate_legacy_args,
)
from .errors import InferenceSetupError
from .policy import (
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
    "load_model": "loading",
    "setup_inference": "inference_setup",
    "InferenceSetup": "inference_setup",
    "LockstepError": "errors",
    "DeepSpeedInferenceMixin": "trainer",
    "DeepSpeedInferenceSeq2SeqTrainer": "trainer",
    "DeepSpeedInferenceTrainer": "trainer",
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
