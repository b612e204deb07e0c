"""Which rows each rank reads: the data-parallel replicas split the data, the ranks of a TP group share it. Called
by the Trainer mixin's data loaders (`trainer.DeepSpeedInferenceMixin.get_eval_dataloader` / `get_test_dataloader`)
and its streamed predict."""

from __future__ import annotations

from ..errors import InferenceSetupError


def replica_loader(make, dataset, name: str, mesh, eval_dataset, topology, args, dataloader_config):
    """`make(dataset)`: the data loader, prepared by accelerate without batch dispatching under our `mesh`.

    accelerate's dispatcher (`dispatch_batches`, also its default for an IterableDataset) does not split data
    between the replicas of a (dp_shard, tp) mesh: it hands every rank, every replica included, the same batch (it
    refuses TP only for mesh dimensions named dp/fsdp). Without dispatching, each replica fetches its own batches
    (`split_batches` included), and every rank of a TP group the same ones. An IterableDataset cannot be split
    between replicas that way (the last batches would be padded with repeated examples nobody can tell apart), so
    it is refused when there is more than one replica. `name`: the argument's name in the error; `eval_dataset`:
    the Trainer's, read where `dataset` is None or names one of several."""
    from torch.utils.data import IterableDataset

    if mesh is None:
        return make(dataset)
    data = dataset if dataset is not None else eval_dataset
    if isinstance(data, str):  # the name of one of several eval datasets
        data = eval_dataset[data]
    if isinstance(data, IterableDataset) and topology.dp_size > 1:
        raise InferenceSetupError(
            f"{name} is an IterableDataset ({type(data).__name__}), which cannot be split between "
            f"{topology.dp_size} data-parallel replicas; valid: a map-style dataset (datasets.Dataset, "
            f"e.g. from `Dataset.from_generator`), or --tp_size {topology.world_size} (one replica)"
        )
    drops_last(args, topology)
    dispatch = dataloader_config.dispatch_batches
    dataloader_config.dispatch_batches = False
    try:
        return make(dataset)
    finally:
        dataloader_config.dispatch_batches = dispatch


def drops_last(args, topology) -> bool:
    """Whether --dataloader_drop_last is set; refused where it would not drop one process's rows."""
    if not getattr(args, "dataloader_drop_last", False):
        return False
    if topology.dp_size > 1:
        raise InferenceSetupError(
            f"--dataloader_drop_last drops a short last batch of each of {topology.dp_size} data-parallel replicas, "
            "not one process's last batch, so the rows predicted would not be one process's; valid: without "
            f"--dataloader_drop_last, or --tp_size {topology.world_size} (one replica)"
        )
    return True


def full_batches(dataset, args, topology):
    """The rows a predict reads: with --dataloader_drop_last (one replica), those of the full batches only, as
    upstream's loop reads them; else `dataset`."""
    if not drops_last(args, topology):
        return dataset
    full = len(dataset) - len(dataset) % args.eval_batch_size
    return dataset.select(range(full)) if full < len(dataset) else dataset
