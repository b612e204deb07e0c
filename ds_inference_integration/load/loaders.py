"""Load only your shard: build the model without initialising it, then read only what this rank keeps.

Three ways to a sharded model, chosen by `load_model` (under `--deepspeed_inference`):

* **pre-sharded**: the model directory was written by `ds-inference shard` (it has `manifest.json`):
  each rank reads its own `rank-R-of-N.safetensors` and nothing else;
* **shard-aware**: the model directory has safetensors weights (one file, or shards with an index):
  each rank reads the replicated tensors whole and, of every tensor DeepSpeed splits, only its rows
  or columns;
* **full** (the naive path, and the fallback): `from_pretrained` on every rank, then `init_inference`.

The first two build a skeleton: parameters on the `meta` device (no memory, no random init),
buffers real (they are computed from the config: rotary frequencies, masks). `shard_model` then
fills it in two steps around `deepspeed.init_inference`, which splits meta tensors as metadata only:

1. before: parameters that no linear layer owns (embeddings, norms, relative position biases) are
   read whole; they are replicated, and DeepSpeed slices the few it splits itself;
2. after: each linear's parameter, now of its shard's shape, is read from the checkpoint. Where its
   rows/columns come from is the one record every split leaves on the parameter (`slices.py`: ours where we
   split, DeepSpeed's own converted into it). Every read is checked against the shape DeepSpeed produced.

Here: `load_model`, and the skeleton's hand-over to step 3 (`PendingLoad`, carried on the skeleton it returns as
`PENDING_ATTRIBUTE`). Beside it, by role: `skeleton.py` (the model built on meta), `keys.py` (which checkpoint
tensor fills each parameter), `readers.py` (the loaders that read them, whole or this rank's part).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import InferenceSetupError
from ..policy.schema import Policy, policy_identity
from ..run.collector import collector_paused
from .checkpoint import SafetensorsCheckpoint
from .keys import NeedsConversion, plan_keys
from .own_code import check_trust, from_pretrained, load_config, never_ask, own_model_class
from .presharded import MANIFEST, check_manifest, read_manifest, verify_in_group
from .readers import Loader, PreShardedLoader, ShardAwareLoader
from .skeleton import build_skeleton, check_model_kind

logger = logging.getLogger(__name__)

# The attribute a skeleton carries out of `load_model`, in the open (`vars(model)` shows it): the skeleton is what
# `load_model` returns and what `setup_inference` (the Trainer's, serve's, a script's) takes, and `setup_inference`
# hands its pending load to `shard_model` as an argument (`pending`), where loading ends and sharding begins;
# `shard_model` takes it off once every weight is read. (It was a module-global registry keyed by the model, which
# `shard_model` looked up from inside: #43.)
PENDING_ATTRIBUTE = "ds_inference_pending_load"


@dataclass
class PendingLoad:
    """What `load_model` leaves on a skeleton for `shard_model` (`PENDING_ATTRIBUTE`): where this rank's weights
    will come from (`loader`, or a pre-sharded directory's `manifest`, checked and opened per rank once the policy
    is known: `open`) and when loading began (for the log line's time to a ready model)."""

    start: float
    loader: Loader | None = None
    manifest: dict | None = None
    model_dir: Path | None = None

    def open(self, tp_size: int, tp_rank: int, policy_identity: str, dtype: torch.dtype, group=None) -> Loader:
        """This rank's loader. A pre-sharded directory is checked here: the manifest against the run, then the rank
        files (`presharded.verify_in_group`, agreed over `group`)."""
        if self.loader is None:
            check_manifest(self.manifest, self.model_dir, tp_size, policy_identity, dtype)
            verify_in_group(self.manifest, self.model_dir, tp_rank, group)
            record = next(r for r in self.manifest["files"] if r["rank"] == tp_rank)
            self.loader = PreShardedLoader(self.model_dir, dtype,
                                           SafetensorsCheckpoint([self.model_dir / record["name"]]))
        return self.loader


def pending_load(model: nn.Module) -> PendingLoad | None:
    """The load `load_model` left on this skeleton, or None (a model with every weight already)."""
    return vars(model).get(PENDING_ATTRIBUTE)


def loaded(model: nn.Module) -> None:
    """Every weight of `model` is read: it is no longer a skeleton."""
    vars(model).pop(PENDING_ATTRIBUTE, None)


def is_skeleton(model: nn.Module) -> bool:
    return pending_load(model) is not None


def _skeleton(model: nn.Module, pending: PendingLoad) -> nn.Module:
    setattr(model, PENDING_ATTRIBUTE, pending)
    return model


def policy_id(policy) -> str:
    """A stable name for the policy a run resolves: autotp, or the policy's name and content hash."""
    if not isinstance(policy, Policy):
        return "autotp" if policy in (None, "autotp") else str(policy)
    return f"{policy.name}:{policy_identity(policy)}"


@collector_paused()  # a full collection inside would walk every object of the process (run/collector.py)
def load_model(model_cls, model_dir: str | Path, config=None, *, inference_args=None, training_args=None,
               dtype: torch.dtype | None = None, mode: str | None = None, **from_pretrained_kwargs) -> nn.Module:
    """`model_cls.from_pretrained`, or under `--deepspeed_inference` a skeleton that `shard_model` fills
    with only this rank's shard (see the module docstring). `mode` (default: `--loading`): auto, full,
    shard-aware, pre-sharded; auto takes the first that the directory allows, in the order pre-sharded,
    shard-aware, full."""
    model_dir = Path(model_dir)
    enabled = inference_args is not None and inference_args.deepspeed_inference
    mode = mode or (inference_args.loading if enabled else "full")
    if mode not in ("auto", "full", "shard-aware", "pre-sharded"):
        raise InferenceSetupError(f"--loading {mode!r} is unknown; valid: auto, full, shard-aware, pre-sharded")
    if enabled and inference_args.replace_with_kernel_inject and mode != "full":
        if mode != "auto":
            raise InferenceSetupError(f"--loading {mode} does not work with --replace_with_kernel_inject; use --loading full")
        mode = "full"
    if dtype is None and inference_args is not None:
        dtype = inference_args.resolve_dtype(fp16=getattr(training_args, "fp16", False),
                                             bf16=getattr(training_args, "bf16", False))
    dtype = dtype or torch.float32
    # a directory with its own code: refused in one line without trust, its own classes with it (`own_code.py`)
    trust = bool(from_pretrained_kwargs.get("trust_remote_code"))
    check_trust(model_dir, trust)
    never_ask()
    config = config or load_config(model_dir, trust)
    builder = model_cls  # what builds the skeleton: the Auto class, or the model's own class it maps the config to
    if hasattr(model_cls, "_model_mapping"):  # an Auto class: one line where it builds no model of this config
        check_model_kind(config, model_cls, model_dir, trust)
        builder = own_model_class(model_cls, config, trust) or model_cls
    start = time.perf_counter()
    reason = None
    if mode in ("auto", "pre-sharded"):
        manifest = read_manifest(model_dir)  # refuses a half-written or foreign-format directory
        if manifest is not None:
            model = build_skeleton(builder, config, dtype, model_dir)
            return _skeleton(model, PendingLoad(start, manifest=manifest, model_dir=model_dir))  # opened per rank
        if mode == "pre-sharded":
            raise InferenceSetupError(f"{model_dir} has no {MANIFEST}: it was not written by `ds-inference shard`")
    if mode in ("auto", "shard-aware"):
        ckpt = SafetensorsCheckpoint.open(model_dir)
        if ckpt is None:
            reason = "no safetensors weights"
        else:
            model = build_skeleton(builder, config, dtype, model_dir)
            plan, reason = plan_keys(model, ckpt)
            if reason is None:
                return _skeleton(model, PendingLoad(start, loader=ShardAwareLoader(model_dir, dtype, ckpt, plan)))
        if mode == "shard-aware":
            refusal = InferenceSetupError(f"--loading shard-aware: {model_dir}: {reason}; valid here: --loading full")
            refusal.needs_conversion = isinstance(reason, NeedsConversion)  # what `--loading auto` loads full
            raise refusal
    if enabled:  # in the run's dtype, as a one-device `from_pretrained(dtype=...)`: buffers made as it makes them
        from_pretrained_kwargs.setdefault("dtype", dtype)
    from_pretrained_kwargs.pop("trust_remote_code", None)
    model = from_pretrained(model_cls, model_dir, trust, config=config, **from_pretrained_kwargs)
    if enabled:
        why = f" ({reason})" if reason else ""
        logger.warning("deepspeed_inference: model loaded full on every rank%s in %.2f s", why, time.perf_counter() - start)
    return model
