"""What the pinned DeepSpeed (0.19) gets wrong or does not do with transformers 5, each named with the
DeepSpeed behaviour and the evidence, so that a DeepSpeed upgrade is the review of this file."""

from __future__ import annotations

import importlib.metadata as metadata

# DeepSpeed's fused inference kernels (`replace_with_kernel_inject`) run with none of the architectures they
# list under transformers 5: on an H200 (2026-11-30, deepspeed 0.19.8, transformers 5.24.0, torch 2.11 cu130;
# `launch/gpu_check.py --sections kernel_inject`, its per-architecture matrix) the kernels built and then
# every tiny model failed in its first forward: gpt2 ('DynamicCache' object has no attribute 'dtype'),
# llama and gptj ('tuple' object has no attribute 'size'), opt (asks to merge checkpoints), bloom (refused
# by DeepSpeed itself after transformers 4.43.4), gpt_neox ('GPTNeoXAttention' has no 'hidden_size').
KERNELS_LAST_BROKEN = (0, 19)  # the newest DeepSpeed minor seen failing; a newer one is let through


def _major_minor(package: str) -> tuple[int, int]:
    try:
        parts = metadata.version(package).split(".")
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (metadata.PackageNotFoundError, ValueError, IndexError):
        return (0, 0)


def kernel_injection_problem() -> str | None:
    """Why `--replace_with_kernel_inject` cannot work with the installed versions, or None."""
    ds, tr = _major_minor("deepspeed"), _major_minor("transformers")
    if ds <= KERNELS_LAST_BROKEN and tr >= (5, 0):
        return (f"DeepSpeed {metadata.version('deepspeed')}'s inference kernels do not run with transformers "
                f"{metadata.version('transformers')} (every architecture they list fails in its first forward; "
                "checked on an H200): drop the flag, tensor-parallel sharding works without it")
    return None
