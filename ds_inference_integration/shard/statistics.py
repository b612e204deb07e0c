"""Statistics over a split width, computed over every rank's part: a module between a column-split linear and its
row-parallel one holds 1/tp of the inner features on each rank, so a mean or a standard deviation it takes over
them (`dim=-1`) would be this rank's alone. Gemma 3n's MLP does so in the layers where its config sets an
activation sparsity (the first 10 of 35 in the published E2B and E4B): `_gaussian_topk` cuts each gate activation
below mean + std x 1.645 of the whole inner width. Split, each rank took its own part's statistics: tp 2 gave
logits 1.7 off and other greedy tokens (`policy check`, 2026-12-07). Keeping such MLPs whole would cost every
layer's MLP (a policy names a class, not a layer); here the module's forward runs with its mean, std and var over
the last dim summed across the TP group instead: one small all-reduce each, the rest of the split unchanged.

Which modules: the parent of a row-parallel linear whose own code takes `mean`, `std` or `var` over `dim=-1`, not
an attention (its reductions are over a head's features, whole on a rank). Inside its forward, only a reduction
whose input is as wide as that linear's input part (this rank's inner features) is taken across the ranks.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# torch.mean(x, dim=-1 ...), x.std(-1 ...), x.var(dim=-1 ...)
_OVER_LAST_DIM = re.compile(r"(?:torch\.(?:mean|std|var)\([^()]*?\bdim\s*=\s*-1\b)"
                            r"|(?:\.(?:mean|std|var)\(\s*(?:dim\s*=\s*)?-1\b)")
_MEAN = (torch.mean, torch.Tensor.mean)
_SPREAD = (torch.std, torch.Tensor.std, torch.var, torch.Tensor.var)


class RanksWideStatistics(TorchFunctionMode):
    """mean, std and var over the last dim of a tensor `width` wide (this rank's features) taken over every rank's
    features of `group`: sums and counts all-reduced in fp32, the spread about the whole mean (two all-reduces for
    std/var, one for mean); the result in the input's dtype."""

    def __init__(self, width: int, group):
        super().__init__()
        self.width, self.group = width, group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _MEAN or func in _SPREAD:
            x = args[0] if args else kwargs.get("input")
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(x, torch.Tensor) and x.ndim and x.shape[-1] == self.width and dim in (-1, x.ndim - 1,
                                                                                                   (-1,), [-1]):
                return self._across_ranks(func, x, kwargs)
        return func(*args, **kwargs)

    def _sum(self, values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        from deepspeed import comm as dist

        packed = torch.cat([values, values.new_full(values.shape, float(count))], dim=-1)
        dist.inference_all_reduce(packed, group=self.group)
        return packed[..., :1], packed[..., 1:]

    def _across_ranks(self, func, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        keepdim = kwargs.get("keepdim", False)
        f = x.float()
        total, count = self._sum(f.sum(-1, keepdim=True), x.shape[-1])
        mean = total / count
        if func in _MEAN:
            out = mean
        else:
            correction = kwargs.get("correction")
            if correction is None:
                correction = 1 if kwargs.get("unbiased", True) else 0
            squares, _ = self._sum((f - mean).pow(2).sum(-1, keepdim=True), x.shape[-1])
            out = squares / (count - correction)
            if func in (torch.std, torch.Tensor.std):
                out = out.sqrt()
        out = out.to(x.dtype)
        return out if keepdim else out.squeeze(-1)


def _reduces_over_its_width(module: nn.Module) -> bool:
    from ..policy.schema import class_source

    if "attention" in type(module).__name__.lower() or hasattr(module, "head_dim") or hasattr(module, "num_heads"):
        return False
    return bool(_OVER_LAST_DIM.search(class_source(type(module))))


def statistics_across_ranks(model: nn.Module, group) -> list[str]:
    """Run the forward of every module of the sharded `model` that takes statistics over its split inner features
    (see the module's docstring) with them taken across `group`; returns the classes changed."""
    from deepspeed.module_inject.layers import LinearAllreduce, LmHeadLinearAllreduce

    from .mixers import RowShard

    changed: dict[str, None] = {}
    for parent in model.modules():
        for child in parent.children():
            if (isinstance(child, (LinearAllreduce, RowShard)) and not isinstance(child, LmHeadLinearAllreduce)
                    and _reduces_over_its_width(parent) and "_ranks_wide" not in vars(parent)):
                parent._ranks_wide = True
                parent.forward = _with_statistics(parent.forward, child.weight.shape[1], group)
                changed[type(parent).__name__] = None
    if changed:
        logger.info("deepspeed_inference: mean/std over the split inner features of %s taken across the ranks",
                    ", ".join(changed))
    return list(changed)


def _with_statistics(forward, width: int, group):
    def run(*args, **kwargs):
        with RanksWideStatistics(width, group):
            return forward(*args, **kwargs)

    return run
