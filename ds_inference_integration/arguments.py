"""The `--deepspeed_inference` flag family: one dataclass, parsed by `HfArgumentParser` beside
`Seq2SeqTrainingArguments`, validated once before the model loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import InferenceSetupError  # noqa: F401  (also importable from here, as before)

REDUCE_DTYPES = ("model", "fp32")  # --reduce_dtype: the row-parallel sums in the model's dtype, or in fp32

if TYPE_CHECKING:
    import torch

# --inference_dtype's names -> torch's. torch itself is imported where a dtype is made, not here: the package's
# import is what every `ds-inference` command (a server's front, a policy check's starter) and `--help` pay first,
# and torch was 1.9 of the CLI's 2.5 s before its own work (2026-12-06)
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(flag: str) -> torch.dtype:
    """torch's dtype for an --inference_dtype name (fp32, fp16, bf16)."""
    import torch

    return getattr(torch, DTYPE_NAMES[flag])


def __getattr__(name: str):
    """`DTYPES` ({"fp32": torch.float32, ...}), made when first asked for: it needs torch."""
    if name == "DTYPES":
        return {flag: torch_dtype(flag) for flag in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
POLICY_MODES = ("auto", "autotp", "derive")
# torch.distributed keeps a deadline as now + timeout in 64-bit nanoseconds since 1970 (1.8e18 ns now, of 9.2e18):
# two gloo ranks, init_process_group then a broadcast, 2026-12-03: a timeout of 1e9 s works; 9e9 s hangs both ranks
# for good (the sum overflows); 2e10 s works again (it wraps past the overflow). 99999999999 s, typed to mean "no
# timeout", hung both ranks in DeepSpeed's first broadcast. So the flag stops at 1e9 s (31 years).
MAX_TIMEOUT_SECONDS = 10**9
LOADING_MODES = ("auto", "full", "shard-aware", "pre-sharded")


@dataclass
class DeepSpeedInferenceArguments:
    """Options of DeepSpeed tensor-parallel inference for `Trainer.predict`/`evaluate`."""

    deepspeed_inference: bool = field(
        default=False,
        metadata={"help": "Shard the model with deepspeed.init_inference (tensor parallelism) for predict/evaluate."},
    )
    tp_size: int | None = field(
        default=None,
        metadata={"help": "Tensor-parallel group size; must divide the world size. Default: the world size."},
    )
    inference_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Weights dtype for inference: fp32, fp16 or bf16. Default: bf16/fp16 if --bf16/--fp16, else fp32.",
            "choices": list(DTYPE_NAMES),
        },
    )
    injection_policy: str = field(
        default="auto",
        metadata={
            "help": "'auto' (the policies/ file for the model's model_type, else a policy derived from the model), "
            "'derive' (derived even where a file exists), 'autotp' (DeepSpeed's automatic mode), or a path to a "
            "policy file."
        },
    )
    replace_with_kernel_inject: bool = field(
        default=False, metadata={"help": "Use DeepSpeed's fused inference kernels (GPU only)."}
    )
    lockstep_guard: bool = field(
        default=True,
        metadata={"help": "Before each batch, the ranks of a TP group compare a fingerprint of their inputs "
                          "and stop with one clear error if they differ."},
    )
    loading: str = field(
        default="auto",
        metadata={
            "help": "How each rank gets its weights: 'pre-sharded' (a directory from `ds-inference shard`), "
            "'shard-aware' (only its slices of a safetensors checkpoint, model built on meta), 'full' (whole "
            "model on every rank, then split), or 'auto' (the first of these the model directory allows).",
            "choices": list(LOADING_MODES),
        },
    )
    reduce_dtype: str = field(
        default="model",
        metadata={
            "help": "In fp16/bf16: 'fp32' keeps each row-parallel layer's partial product in fp32 and sums the ranks' "
            "partials in fp32, rounding once as one device does; 'model' (default) sums in the model's dtype.",
            "choices": list(REDUCE_DTYPES),
        },
    )
    inference_timeout: int = field(
        default=120,
        metadata={"help": "Seconds any rank waits in a collective before the run fails instead of hanging."},
    )

    def __post_init__(self) -> None:
        if self.tp_size is not None and self.tp_size < 1:
            raise InferenceSetupError(f"--tp_size {self.tp_size} is invalid: it must be a positive integer")
        if self.inference_dtype is not None and self.inference_dtype not in DTYPE_NAMES:
            raise InferenceSetupError(
                f"--inference_dtype {self.inference_dtype!r} is invalid; valid: {', '.join(DTYPE_NAMES)}"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise InferenceSetupError(
                f"--reduce_dtype {self.reduce_dtype!r} is invalid; valid: {', '.join(REDUCE_DTYPES)}"
            )
        if self.loading not in LOADING_MODES:
            raise InferenceSetupError(f"--loading {self.loading!r} is invalid; valid: {', '.join(LOADING_MODES)}")
        if self.replace_with_kernel_inject:
            from .deepspeed_compat import kernel_injection_problem

            problem = kernel_injection_problem()
            if problem:
                raise InferenceSetupError(f"--replace_with_kernel_inject is refused: {problem}")
        if not 0 < self.inference_timeout <= MAX_TIMEOUT_SECONDS:
            raise InferenceSetupError(
                f"--inference_timeout {self.inference_timeout} is out of range; valid: 1 to {MAX_TIMEOUT_SECONDS} "
                f"seconds ({MAX_TIMEOUT_SECONDS // (365 * 86400)} years: the longest wait torch.distributed keeps; give "
                "that for no practical timeout)")
        from .deepspeed_compat import CPU_ALL_REDUCE_ENV, CPU_ALL_REDUCES

        if os.environ.get(CPU_ALL_REDUCE_ENV, "gloo") not in CPU_ALL_REDUCES:  # refused before the model loads
            raise InferenceSetupError(f"{CPU_ALL_REDUCE_ENV}={os.environ[CPU_ALL_REDUCE_ENV]!r} is invalid; "
                                      f"valid: {', '.join(CPU_ALL_REDUCES)}")

    def resolve_dtype(self, fp16: bool = False, bf16: bool = False) -> torch.dtype:
        """The inference dtype: explicit `--inference_dtype`, else the training args' mixed precision, else fp32."""
        return torch_dtype(self.inference_dtype or ("bf16" if bf16 else "fp16" if fp16 else "fp32"))

    def check_device(self, on_gpu: bool, dtype: torch.dtype) -> None:
        """Refuse options the device cannot run, before any heavy work."""
        import torch

        if on_gpu:
            return
        if self.replace_with_kernel_inject:
            raise InferenceSetupError(
                "--replace_with_kernel_inject needs a GPU (DeepSpeed has no CPU kernels); this run is on CPU: "
                "drop the flag to use tensor-parallel sharding without kernel injection"
            )
        if dtype == torch.float16:
            raise InferenceSetupError(
                "--inference_dtype fp16 is not supported on CPU; valid on CPU: fp32, bf16"
            )


def parse_args_into_dataclasses(parser, argv: list[str]) -> tuple:
    """`parser.parse_args_into_dataclasses(argv)` (or a single .json file), with a bad or unknown argument (a
    ValueError from HfArgumentParser or from a dataclass's checks) turned into one `error:` line."""
    import os

    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
        return parser.parse_args_into_dataclasses(args=argv)
    except InferenceSetupError:
        raise
    except ValueError as e:
        raise InferenceSetupError(" ".join(str(e).split())) from None


def world_size_from_env() -> int:
    """The number of ranks the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


_LEGACY_RENAMES = {"--evaluation_strategy": "--eval_strategy"}
_LEGACY_FLAGS = ("--overwrite_output_dir",)


def translate_legacy_args(argv: list[str]) -> tuple[list[str], dict[str, bool]]:
    """Accept options that transformers 5 renamed or dropped, with their old meaning.

    `--evaluation_strategy` becomes `--eval_strategy`; `--group_by_length` becomes
    `--train_sampling_strategy group_by_length` (which also groups prompts by length in predict);
    `--overwrite_output_dir` (dropped) is removed from argv and returned in the second value.
    """
    out, legacy = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, sep, value = arg.partition("=")
        if not sep and name in _BOOL_FLAGS and i + 1 < len(argv) and argv[i + 1].lower() in _BOOL_WORDS:
            sep, value, i = "=", argv[i + 1], i + 1
        on = value.lower() not in ("0", "false", "no") if sep else True
        if name in _LEGACY_RENAMES:
            out.append(_LEGACY_RENAMES[name] + sep + value)
        elif name == "--group_by_length":
            out += ["--train_sampling_strategy", "group_by_length"] if on else []
        elif name in _LEGACY_FLAGS:
            legacy[name.lstrip("-")] = on
        else:
            out.append(arg)
        i += 1
    return out, legacy


_BOOL_FLAGS = ("--group_by_length", "--overwrite_output_dir")
_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def _has_option(argv: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def run_defaults(inference_args: DeepSpeedInferenceArguments, world: int, rank: int) -> dict[str, object]:
    """The training arguments a run of the flag family implies, after checking the layout against the world
    (a bad --tp_size fails here, before any process group or model): `ddp_timeout` from --inference_timeout,
    and `use_cpu` for a multi-rank run on a machine without a GPU (else accelerate makes every rank a world
    of one). The caller keeps whatever the user gave explicitly."""
    import torch

    from .topology import Topology

    defaults: dict[str, object] = {}
    if inference_args.deepspeed_inference:
        Topology.create(world, rank, inference_args.tp_size)
        defaults["ddp_timeout"] = inference_args.inference_timeout
    if world > 1 and not torch.cuda.is_available():
        defaults["use_cpu"] = True
    return defaults


def prepare_argv(argv: list[str]) -> tuple[list[str], dict[str, bool]]:
    """Make a script's argv ready for `HfArgumentParser` with `Seq2SeqTrainingArguments`.

    Runs before `TrainingArguments` exists, because that object starts torch.distributed: legacy options are
    translated; the flag family is parsed and validated, and `run_defaults` added where the command line
    does not give them.
    """
    from transformers import HfArgumentParser

    from .deepspeed_compat import end_ranks_with_the_runner

    end_ranks_with_the_runner()  # a `deepspeed` command that is killed takes its ranks with it
    argv, legacy = translate_legacy_args(argv)
    inference_args, _ = HfArgumentParser((DeepSpeedInferenceArguments,)).parse_known_args(argv)
    defaults = run_defaults(inference_args, world_size_from_env(), int(os.environ.get("RANK", "0")))
    for name, value in defaults.items():
        if not _has_option(argv, f"--{name}"):
            argv = [*argv, f"--{name}"] if value is True else [*argv, f"--{name}", str(value)]
    return argv, legacy
