"""Per-head biases made outside the layers (a policy's `head_biases`, `policy/derive/biases.py`): each rank keeps its
heads' part of the module's parameters and buffers (along their one-entry-per-head axis, recorded for shard-aware
loading) and the module's head count attributes become its own, so that the bias it makes holds this rank's heads,
the ones its query rows hold (a contiguous run by rank, as every split here and DeepSpeed's)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InferenceSetupError
from ..load.slices import record
from ..policy.derive.biases import head_axis
from .attention import HeadLayout


def slice_head_biases(model: nn.Module, paths: tuple[str, ...], heads: HeadLayout, source) -> None:
    """Each module at `paths` (from the model) cut to this rank's heads (see the module's docstring)."""
    mine = heads.q_heads()
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise InferenceSetupError(f"policy {source}: head_biases {path!r} names no module of "
                                      f"{type(model).__name__}") from None
        cut = 0
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                axis = None if t is None else head_axis(t, heads.query_heads)
                if axis is None:
                    continue
                with torch.no_grad():
                    part = t.narrow(axis, mine.start, len(mine)).clone()
                if store is module._parameters:
                    part = nn.Parameter(part, requires_grad=False)
                record(part, axis, ((mine.start, mine.stop),), t.shape)
                store[name] = part
                cut += 1
        if not cut:
            raise InferenceSetupError(f"policy {source}: head_biases {path!r} ({type(module).__name__}) holds no "
                                      f"tensor with one entry per head ({heads.query_heads})")
        for name, value in list(vars(module).items()):
            if type(value) is int and value == heads.query_heads:
                setattr(module, name, heads.local_q)
