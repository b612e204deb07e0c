"""One process's rows from the replicas: the gather over the data-parallel group only (TP peers hold identical
rows), the rows accelerate padded onto the last batches taken off again, and a batch's loss weighed as one process
weighs it. Called by the Trainer mixin (`trainer.DeepSpeedInferenceMixin`), whose overrides say where upstream's
loop calls in."""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply


class BatchLoss(torch.Tensor):
    """A batch's loss on its way from prediction_step to the loop's gather (`gather_batch_loss`)."""


def replica_gather(data, dp: int, group, gradient_state, local_batch_examples: int, eval_batch_size: int):
    """Gather over the data-parallel group only (TP peers hold identical rows), then drop the padding accelerate
    added to even out the last batch, as `gather_for_metrics` does. `local_batch_examples`: the examples of this
    rank's last batch (a prediction's rows per example are counted against it)."""
    if dp == 1:
        return data

    def gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if t.ndim == 0:
            t = t[None]
        parts = [torch.empty_like(t) for _ in range(dp)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)

    if isinstance(data, BatchLoss):
        return gather_batch_loss(data.as_subclass(torch.Tensor), gather, gradient_state, eval_batch_size)
    gathered = recursively_apply(gather, data)
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        # `remainder` examples of the last gathered batch are real; each example has `per` rows in `t`
        # (k generated sequences, or 1 label row), counted against this rank's batch, not the batch size
        local = max(1, local_batch_examples)

        def trim(t: torch.Tensor, local_rows: int) -> torch.Tensor:
            per = local_rows // local if local_rows % local == 0 else 1
            return t[:gradient_state.remainder * per]

        gathered = apply_pairs(trim, gathered, data)
    return gathered


def gather_batch_loss(losses: torch.Tensor, gather, gradient_state, eval_batch_size: int) -> torch.Tensor:
    """The loop's `loss.repeat(batch_size)` of every replica. One process repeats each batch's loss by the loader's
    batch size, its short last batch too, so eval_loss is the mean of the batch losses; the replicas' batches
    are one process's batches (see `real_rows`), so keeping every replica's repeats, except those of a last
    batch made of padding alone, gives one process's mean. Trimming to the remainder's rows, as for the
    predictions, weighed the short last batch by its row count instead (eval_loss 6.1062e-4 against one
    process's 6.1190e-4: 37 examples, batch 8, dp 2 x tp 2, 2026-12-03)."""
    gathered = gather(losses)
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        gathered = gathered[:-(-gradient_state.remainder // eval_batch_size) * losses.shape[0]]
    return gathered


def real_rows(examples: int | None, batch_index: int, dp: int, dp_rank: int, batch_size: int,
              split_batches: bool) -> int | None:
    """How many rows of this replica's batch `batch_index` are examples of the `examples`, when the loop may have
    padded it (None: all are).

    With more than one replica accelerate evens out the last batches (`even_batches`): a short last batch is
    completed with examples from the start of the data, and a replica with nothing left gets a batch made of
    them. The gather drops those rows afterwards, but they were computed: a padded batch's loss is the mean
    over its repeats too, and sampling draws random numbers for every row, so eval_loss and sampled tokens
    parted from one process's (37 examples, batch 8, dp 2 x tp 2: eval_loss 6.0795e-4 against 6.1190e-4,
    2026-12-03). So a padded batch runs on its real rows only (a batch of padding alone on its first row,
    for the collectives' sake), and is padded back to its row count for the gather. Global batch g =
    (this replica's step) x dp + dp_rank holds examples g*B .. g*B+B-1 of the data, as one process's."""
    if examples is None or dp == 1 or split_batches:
        return None
    start = (batch_index * dp + dp_rank) * batch_size
    return max(0, min(batch_size, examples - start))


def check_row_counts(output, examples: int, per_example: int) -> None:
    """Exactly one process's rows came back: `per_example` prediction rows and one label row per example."""
    for name, rows, per in (("predictions", output.predictions, per_example), ("label_ids", output.label_ids, 1)):
        for count in row_counts(rows):
            if count != examples * per:
                raise RuntimeError(f"{name}: gathered {count} rows for {examples} examples x {per} row(s) each; rows "
                                   "were lost or duplicated")


def batch_examples(inputs: dict) -> int:
    from transformers.trainer_pt_utils import find_batch_size

    return find_batch_size(inputs) or 0


def slice_rows(inputs: dict, rows: int, keep: int) -> dict:
    """The batch's first `keep` rows (every tensor with `rows` rows; anything else as it is)."""
    return type(inputs)({k: v[:keep] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v
                         for k, v in inputs.items()})


def pad_rows(t, kept: int, rows: int):
    """`t`, computed for a batch's first `kept` rows (k rows of it per example), with rows of -100 added up to k x
    `rows` rows."""
    if not isinstance(t, torch.Tensor) or not t.ndim:
        return t
    per = max(1, t.shape[0] // kept)
    missing = rows * per - t.shape[0]
    if missing <= 0:
        return t
    return torch.cat([t, torch.full((missing, *t.shape[1:]), -100, dtype=t.dtype, device=t.device)])


def apply_pairs(fn, gathered, local):
    """`fn(gathered_tensor, rows of the matching local tensor)` over two structures of the same shape."""
    if isinstance(gathered, dict):
        return type(gathered)({k: apply_pairs(fn, gathered[k], local[k]) for k in gathered})
    if isinstance(gathered, (list, tuple)):
        return type(gathered)(apply_pairs(fn, g, v) for g, v in zip(gathered, local))
    if isinstance(gathered, torch.Tensor):
        return fn(gathered, len(local) if local.ndim else 1)
    return gathered


def row_counts(rows) -> list[int]:
    """The row count of every array in a prediction structure (batches of a list counted together)."""
    if rows is None:
        return []
    if isinstance(rows, dict):
        return [c for v in rows.values() for c in row_counts(v)]
    if isinstance(rows, list) and rows and all(hasattr(b, "shape") for b in rows):
        return [sum(len(b) for b in rows)]  # eval_do_concat_batches=False: one array per batch
    if isinstance(rows, (list, tuple)):
        return [c for v in rows for c in row_counts(v)]
    return [len(rows)] if hasattr(rows, "shape") and rows.ndim else []


def rows_per_example(args, model, gen_kwargs: dict | None) -> int:
    """Rows of predictions per example: `num_return_sequences` when generating (the call's kwargs, else the model's
    generation config), else 1."""
    if not getattr(args, "predict_with_generate", False):
        return 1
    config = getattr(model, "generation_config", None)
    return int((gen_kwargs or {}).get("num_return_sequences") or getattr(config, "num_return_sequences", None) or 1)
