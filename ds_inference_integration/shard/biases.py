"""Per-head biases made outside the layers (a policy's `head_biases`, `policy/derive/biases.py`): each rank keeps its
heads' part of the module's parameters and buffers (along their one-entry-per-head axis, recorded for shard-aware
loading) and the module's head count attributes become its own, so that the bias it makes holds this rank's heads,
the ones its query rows hold (a contiguous run by rank, as every split here and DeepSpeed's).

A policy's `head_inputs` (a bias for every head made by the model's own forward, passed to each layer) is cut as it
arrives: a forward pre-hook on each layer of the class keeps this rank's heads of the input's head axis."""

from __future__ import annotations

import fnmatch
import inspect

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


def cut_heads(value, axis: int, heads: HeadLayout):
    """`value`'s entries for this rank's heads along `axis` (from the end), where that axis holds every head (or the
    batch and every head flattened together, a multiple of the head count: [batch * heads, 1, keys]); anything else
    as it is (one entry for every head broadcasts to any number; a bias already cut holds fewer)."""
    total = heads.query_heads
    if not isinstance(value, torch.Tensor) or value.ndim < -axis or value.shape[axis] % total:
        return value
    mine = heads.q_heads()
    at = axis % value.ndim
    return value.unflatten(at, (-1, total)).narrow(at + 1, mine.start, len(mine)).flatten(at, at + 1)


def cut_head_inputs(layers: list[nn.Module], entries: dict[str, dict[str, int]], heads: HeadLayout, source) -> None:
    """Each layer of a class in `entries` (a policy's `head_inputs`) cuts those inputs to this rank's heads before
    its forward (see the module's docstring); an input its forward cannot take is one line."""
    found = set()
    for layer in layers:
        wanted = {k: a for pattern, inputs in entries.items() if fnmatch.fnmatchcase(type(layer).__name__, pattern)
                  for k, a in inputs.items()}
        if not wanted:
            continue
        found.update(p for p in entries if fnmatch.fnmatchcase(type(layer).__name__, p))
        params = list(inspect.signature(layer.forward).parameters.values())
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        for key in wanted:
            if not (key.isdigit() or takes_any or any(p.name == key for p in params)):
                names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                raise InferenceSetupError(f"policy {source}: head_inputs {key!r} is no input of "
                                          f"{type(layer).__name__}.forward; valid: {', '.join(names)} (or a "
                                          "positional index)")
        # an input named by keyword may come by position, one named by position may come by keyword
        places = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        positions = {int(k) if k.isdigit() else places.index(k): a for k, a in wanted.items()
                     if k.isdigit() or k in places}
        keywords = {places[int(k)] if k.isdigit() and int(k) < len(places) else k: a for k, a in wanted.items()}

        def before(module, args, kwargs, positions=positions, keywords=keywords):
            args = tuple(cut_heads(a, positions[i], heads) if i in positions else a for i, a in enumerate(args))
            kwargs = {k: cut_heads(v, keywords[k], heads) if k in keywords else v for k, v in kwargs.items()}
            return args, kwargs

        layer.register_forward_pre_hook(before, with_kwargs=True)
    missing = sorted(set(entries) - found)
    if missing:
        raise InferenceSetupError(f"policy {source}: head_inputs of layers.{missing[0]} match no layer of the model")
