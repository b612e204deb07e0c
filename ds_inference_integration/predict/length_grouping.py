"""Length grouping for predict: with `--group_by_length` / `--sortish_sampler`, prompts of similar length are
batched together (the same order on every rank), and the outputs are put back in input order."""

from __future__ import annotations

import numpy as np


def length_order(args, dataset) -> list[int] | None:
    """With --group_by_length / --sortish_sampler: the order that puts prompts of similar length in
    one batch (stable sort by input length; the same on every rank)."""
    wanted = (getattr(args, "group_by_length", False) or getattr(args, "sortish_sampler", False)
              or getattr(args, "train_sampling_strategy", None) == "group_by_length")
    if not wanted or not hasattr(dataset, "column_names") or "input_ids" not in dataset.column_names:
        return None
    lengths = input_lengths(dataset)
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def input_lengths(dataset) -> list[int]:
    """Each example's `input_ids` length. Through Arrow where the data set is one: 0.7 ms for 200,000 examples of
    100 tokens, against 1.7 s for reading the column into Python lists (2 cores, 2026-12-04)."""
    try:
        import pyarrow.compute as pc

        return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
    except Exception:  # noqa: BLE001 - not an Arrow-backed data set: the plain way
        return [len(ids) for ids in dataset["input_ids"]]


def padding_fraction(lengths: list[int], batch_size: int) -> float:
    """Share of padding positions when `lengths` are batched in order, `batch_size` at a time."""
    padded = real = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start:start + batch_size]
        padded += max(batch) * len(batch)
        real += sum(batch)
    return 1 - real / padded if padded else 0.0


def unsort(rows, order: list[int]):
    """Put rows produced in `order` back in input order (k rows per example when k divides evenly).

    `rows` is what predict returns: an array, a tuple/list/dict of them (seq2seq logits come as (logits,
    encoder states)), or, with `eval_do_concat_batches=False`, a list of per-batch arrays."""
    if rows is None or len(order) == 0:
        return rows
    if isinstance(rows, dict):
        return {k: unsort(v, order) for k, v in rows.items()}
    if isinstance(rows, list) and rows and all(isinstance(b, np.ndarray) for b in rows):
        return unsort_batches(rows, order)
    if isinstance(rows, (tuple, list)):
        return type(rows)(unsort(r, order) for r in rows)
    return rows[picks(len(rows), order)]


def picks(n_rows: int, order: list[int]) -> list[int]:
    per = n_rows // len(order)
    inverse = [0] * len(order)
    for position, index in enumerate(order):
        inverse[index] = position
    return [inverse[i] * per + j for i in range(len(order)) for j in range(per)]


def unsort_batches(batches: list, order: list[int], pad: int = -100) -> list:
    """`eval_do_concat_batches=False`: each batch is padded to its own width, so rows are taken one by one,
    put in input order, and re-batched with the same batch sizes (padded with the Trainer's -100)."""
    rows = [row for batch in batches for row in batch]
    rows = [rows[i] for i in picks(len(rows), order)]
    out, at = [], 0
    for size in (len(b) for b in batches):
        chunk = rows[at:at + size]
        at += size
        if chunk and chunk[0].ndim >= 1:
            width = max(r.shape[0] for r in chunk)
            chunk = [np.concatenate([r, np.full((width - r.shape[0], *r.shape[1:]), pad, dtype=r.dtype)])
                     if r.shape[0] < width else r for r in chunk]
        out.append(np.stack(chunk) if chunk else np.empty((0,)))
    return out


def length_grouped(args, dataset, prefix: str):
    """With --group_by_length: the data in length order, that order, and the padding-fraction metrics before and
    after; else (dataset, None, {})."""
    order = length_order(args, dataset)
    if order is None:
        return dataset, None, {}
    unsorted = padding_fraction(input_lengths(dataset), args.eval_batch_size)
    dataset = dataset.select(order)
    return dataset, order, {f"{prefix}_padding_fraction": round(padding_fraction(input_lengths(dataset),
                                                                                 args.eval_batch_size), 4),
                            f"{prefix}_padding_fraction_unsorted": round(unsorted, 4)}
