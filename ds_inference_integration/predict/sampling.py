"""Sampling under tensor parallelism: whether a prediction step draws random numbers (`samples`), and the seed of
each batch (`batch_seed`): equal on the ranks of a TP group, and equal to the single-process run's seed for the same
batch, so that sampled tokens are the same as one process's."""

from __future__ import annotations

import contextlib

import torch


def samples(args, model, gen_kwargs: dict | None) -> bool:
    """Whether generation samples: `do_sample` from the call's generation kwargs, else the model's generation
    config (only with `predict_with_generate`)."""
    if not getattr(args, "predict_with_generate", False):
        return False
    config = getattr(model, "generation_config", None)
    return bool((gen_kwargs or {}).get("do_sample", getattr(config, "do_sample", False)))


@contextlib.contextmanager
def batch_seed(args, topology, batch_index: int, sampling: bool):
    """When `sampling`, one seed per batch of the whole data set (`args.seed` + its index over all replicas). The
    global random state is forked and given back afterwards: a training run that evaluates now and then keeps its
    own random sequence (dropout) instead of restarting it from this seed after every evaluation."""
    if not sampling:
        yield
        return
    device = args.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                               device_type=device.type if device.type == "cuda" else "cuda"):
        torch.manual_seed(args.seed + batch_index * topology.dp_size + topology.dp_rank)
        yield
