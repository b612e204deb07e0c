"""Streamed, resumable predict: every finished batch's decoded predictions go to disk as they complete, one
part file per data-parallel replica (written by the replica's first rank; its TP peers write nothing), and
a re-run of the same command continues where a crash stopped it. At the end rank 0 merges the parts into
the predictions file, in input order and atomically, computes the metrics from the per-example statistics
stored beside each prediction, and removes the parts.

Layout of `<output_dir>/<prefix>_parts/`:
    manifest.json     what the run is (model, data, layout, generation settings): a resume must match it
    part-dp<R>.jsonl  replica R's records, one JSON line per example, in the replica's batch order:
                      {"i": input index, "p": prediction (or a list for several sequences), "s": statistics}

Why the parts stay correct after any crash: a replica's batches are fixed by the data size, the batch size
and the replica count (global batch g = examples g*B .. g*B+B-1, replica g mod dp), each batch's records are
appended in one write and flushed, and a line cut short by a kill is dropped when the part is reopened. So a
part always holds a prefix of its replica's examples, and resuming skips exactly that prefix. Generation of a
batch does not depend on other batches (sampling is seeded per global batch), so a resumed run writes the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import InferenceSetupError
from .files import atomic_path, write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


# The batch grid --------------------------------------------------------------------------------------

def replica_batches(n: int, batch_size: int, dp_size: int, dp_rank: int) -> list[range]:
    """Positions of the examples in each of this replica's batches, in order: global batch g holds
    positions g*B .. min(n, g*B+B)-1 and belongs to replica g mod dp (as accelerate splits a sequential
    loader between replicas, without the padding it adds at the end: nothing is generated twice)."""
    return [range(g * batch_size, min(n, (g + 1) * batch_size))
            for g in range(dp_rank, -(-n // batch_size), dp_size)]


# One replica's part file ---------------------------------------------------------------------------

def part_path(parts_dir: Path, dp_rank: int) -> Path:
    return Path(parts_dir) / f"part-dp{dp_rank}.jsonl"


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(byte offset, record) for every complete line; a last line without its newline (cut short by a
    kill) is not a record."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            if not line.endswith(b"\n"):
                return
            yield offset, json.loads(line)
            offset += len(line)


def complete_length(path: Path) -> tuple[int, int]:
    """(records, bytes) of the complete lines at the start of `path`."""
    records = size = 0
    if path.is_file():
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                records += 1
                size += len(line)
    return records, size


class PartWriter:
    """Appends one replica's records; opening it drops a line left incomplete by a crash."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records, size = complete_length(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._file.truncate(size)

    def write(self, records: list[dict]) -> None:
        """One batch: a single write, flushed to the operating system (a killed process loses nothing
        written; a lost node loses at most what its page cache held, which the resume then redoes)."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records += len(records)

    def close(self) -> None:
        self._file.close()


# What a run is, so that a resume continues the same run ------------------------------------------------

@dataclass
class RunIdentity:
    """Everything that decides the bytes a predict run writes. Two runs with equal identities write equal
    predictions, so one may continue the other."""
    model: dict
    data: dict
    layout: dict
    generation: dict

    def as_dict(self) -> dict:
        return {"model": self.model, "data": self.data, "layout": self.layout, "generation": self.generation}


def fingerprint_rows(dataset, columns=("input_ids", "input_features", "input_values", "labels")) -> str:
    """sha256 of the model inputs and references, read 1000 rows at a time (flat memory). Content, not
    `datasets`' own fingerprint: that one is random when a map function cannot be hashed."""
    h = hashlib.sha256()
    present = [c for c in columns if c in getattr(dataset, "column_names", columns)]
    if hasattr(dataset, "iter"):
        for batch in dataset.select_columns(present).iter(batch_size=1000):
            h.update(json.dumps([batch[c] for c in present], default=_plain).encode())
    else:
        for i in range(len(dataset)):
            row = dataset[i]
            h.update(json.dumps([row.get(c) for c in present], default=_plain).encode())
    return h.hexdigest()[:16]


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else str(value)


def model_identity(model, dtype) -> dict:
    """The model's name or path, its config, the inference dtype, and the sizes of its weight files."""
    config = model.config.to_json_string(use_diff=False)
    source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    files = {}
    if source and Path(source).is_dir():
        files = {p.name: p.stat().st_size for p in sorted(Path(source).iterdir())
                 if p.suffix in (".safetensors", ".bin", ".pt")}
    return {"name_or_path": source, "config_sha256": hashlib.sha256(config.encode()).hexdigest()[:16],
            "dtype": str(dtype).replace("torch.", ""), "weight_files": files}


def generation_identity(generation_config) -> dict | None:
    """The generation settings `generate` will use, as a resume compares them: the model's config with the
    library's defaults filled in where it leaves a value unset, as `generate` fills them
    (`_prepare_generation_config`), and no private entries. transformers 5.24 fills those defaults into the model's
    own `generation_config` at its first `generate` (a tiny T5's `top_p` None -> 1.0, `_from_model_config` True ->
    False, and 25 more), so the config as stored differs before and after any earlier generate in the process
    (`--do_eval` before `--do_predict`), though the outputs cannot."""
    if generation_config is None:
        return None
    import copy

    effective = copy.deepcopy(generation_config)
    effective.update(**effective._get_default_generation_params(), defaults_only=True)
    settings = json.loads(effective.to_json_string(use_diff=False))
    return {k: v for k, v in sorted(settings.items()) if not k.startswith("_") and k != "transformers_version"}


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs, in the order of `new` (RunIdentity's: model, data,
    layout, generation), so that the line, which names the first four, names the weightiest first."""
    out = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def open_run(parts_dir: Path, identity: RunIdentity, fresh: bool) -> bool:
    """Rank 0, before any rank generates: start a run in `parts_dir` or check that the one there is this
    run. Returns True when earlier parts are continued. A different run is refused in one line."""
    parts_dir = Path(parts_dir)
    if fresh and parts_dir.exists():
        shutil.rmtree(parts_dir)
    manifest = parts_dir / MANIFEST
    if manifest.is_file():
        try:
            old = json.loads(manifest.read_text(encoding="utf-8"))
        except ValueError:
            old = None
        if old is not None:
            diff = differences(old, identity.as_dict())
            if diff:
                raise InferenceSetupError(
                    f"{parts_dir} holds the parts of a different predict run ({'; '.join(diff[:4])}"
                    f"{'; ...' if len(diff) > 4 else ''}); re-run the same command to resume it, or pass "
                    "--overwrite_output_dir to start afresh")
            return True
    if parts_dir.exists():
        shutil.rmtree(parts_dir)  # parts without a readable manifest cannot be trusted
    parts_dir.mkdir(parents=True)
    write_text_atomic(manifest, json.dumps(identity.as_dict(), indent=1, sort_keys=True))
    return False


# The end: merge in input order, metrics from the statistics ------------------------------------------

def merge_parts(parts_dir: Path, dp_size: int, n: int, output: Path, metric=None) -> dict:
    """Write every example's prediction to `output` in input order (atomically) and return the metrics
    computed from the stored statistics. Each example must be present exactly once, else nothing is written.

    Memory: one byte offset per example (8 bytes; the predictions themselves are read back one at a time)."""
    where_part, where_offset = array("h", [-1]) * n, array("q", [0]) * n
    totals = None
    for r in range(dp_size):
        for offset, rec in read_records(part_path(parts_dir, r)):
            i = rec["i"]
            if not 0 <= i < n or where_part[i] != -1:
                problem = "out of range" if not 0 <= i < n else "duplicated"
                raise RuntimeError(f"{part_path(parts_dir, r)}: example {i} is {problem}")
            where_part[i], where_offset[i] = r, offset
    missing = [i for i in range(n) if where_part[i] == -1]
    if missing:
        raise RuntimeError(f"{len(missing)} of {n} examples have no prediction in {parts_dir} (first: {missing[0]})")
    files = [open(part_path(parts_dir, r), "rb") for r in range(dp_size)]
    try:
        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
            for i in range(n):
                f = files[where_part[i]]
                f.seek(where_offset[i])
                rec = json.loads(f.readline())
                if metric is not None:  # in input order: ROUGE's bootstrap resamples depend on it
                    totals = metric.add(totals, rec.get("s"))
                prediction = rec["p"]
                for text in (prediction if isinstance(prediction, list) else [prediction]):
                    out.write(text + "\n")
    finally:
        for f in files:
            f.close()
    return metric.compute(totals, n) if metric is not None else {}


# The loop ----------------------------------------------------------------------------------------------

PROGRESS_EVERY_SECONDS = 10.0


class _Progress:
    """One log line at most every `every` seconds on rank 0: examples done of the whole job (all replicas),
    rate of this run, time left."""

    def __init__(self, total: int, already: int, every: float | None = None):
        import time

        self.total, self.already = total, already
        self.every = PROGRESS_EVERY_SECONDS if every is None else every
        self.start = self.last = time.monotonic()

    def update(self, done: int, force: bool = False) -> None:
        import time

        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        rate = (done - self.already) / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        logger.warning("predict progress: %d of %d examples (%.1f%%), %.2f examples/s, %s left", done, self.total,
                    100 * done / max(self.total, 1), rate, f"{left:.0f} s" if left != float("inf") else "unknown")


def streamed_predict(trainer, dataset, *, metric=None, metric_key_prefix: str = "predict",
                     predictions_file: str = "generated_predictions.txt", fresh: bool = False,
                     order: list[int] | None = None) -> dict:
    """The loop behind `DeepSpeedInferenceMixin.predict_to_file`; returns the metrics on every rank.

    `dataset` is already in processing order; `order[pos]` is the input index of position `pos` (None: the
    identity). Every rank walks the same number of steps: each step generates one batch of its replica (or
    nothing, once its replica is done) and, with more than one replica, joins one all-reduce of the examples
    done, which feeds the progress line and lets replicas with less left wait for the others without any long
    collective. With one replica rank 0 writes every record itself, and its TP peers keep step inside
    `generate`: no all-reduce per step."""
    import time

    import torch
    import torch.distributed as dist

    topo = trainer.topology
    n = len(dataset)
    out_dir = Path(trainer.args.output_dir)
    parts_dir = out_dir / f"{metric_key_prefix}_parts"
    distributed = dist.is_available() and dist.is_initialized()
    device = trainer.args.device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")
    writer_rank = topo.tp_rank == 0
    batches = replica_batches(n, trainer.args.eval_batch_size, topo.dp_size, topo.dp_rank)

    # Rank 0 opens (or checks) the run first; then each replica's writer finds its resume point.
    error = None
    if topo.rank == 0:
        try:
            resumed = open_run(parts_dir, trainer._stream_identity(dataset, order), fresh)
        except InferenceSetupError as e:
            error, resumed = str(e), False
    status = [error, resumed if topo.rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(status, src=0)
    if status[0]:
        raise InferenceSetupError(status[0])
    writer = PartWriter(part_path(parts_dir, topo.dp_rank)) if writer_rank else None
    done_mine = torch.tensor([writer.records if writer else 0], dtype=torch.long, device=device)
    if distributed and topo.tp_size > 1:  # the writer's resume point, for its TP peers
        dist.broadcast(done_mine, src=topo.rank - topo.tp_rank, group=trainer.process_groups.tp)
    skip, before = 0, 0  # batches wholly on disk; examples in them
    while skip < len(batches) and before + len(batches[skip]) <= int(done_mine):
        before += len(batches[skip])
        skip += 1
    steps = torch.tensor([len(batches) - skip], dtype=torch.long, device=device)
    if distributed:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    already = _sum_over_replicas(int(done_mine), topo, device, distributed)
    if topo.rank == 0:
        if status[1]:
            logger.warning("resumed: %d of %d examples already done", already, n)
        logger.warning("predictions stream to %s (one part per replica), merged into %s at the end",
                    parts_dir, out_dir / predictions_file)
    progress = _Progress(n, already)
    tokenizer = trainer.processing_class
    pad = getattr(tokenizer, "pad_token_id", None)
    generated = 0
    start = time.monotonic()
    trainer.model.eval()
    for step in range(int(steps)):
        k = skip + step
        written = 0
        if k < len(batches):
            positions = batches[k]
            features = [dataset[p] for p in positions]
            inputs = trainer.data_collator(features)
            labels = inputs.pop("labels", None)  # references only: no teacher-forced loss pass per batch
            if labels is not None:  # and no decoder inputs the collator made from them
                inputs.pop("decoder_input_ids", None)
                inputs.pop("decoder_attention_mask", None)
            trainer._batch_index = k - 1  # prediction_step counts it up: the seed and the guard use it
            _, tokens, _ = trainer.prediction_step(trainer.model, inputs, prediction_loss_only=False)
            generated += len(positions)
            if writer is not None:
                first = int(done_mine) - before if k == skip else 0  # a batch a crash cut short: its tail only
                records = _records(tokenizer, pad, tokens, labels, positions, order, metric)
                writer.write(records[first:])
                written = len(records) - first
        if distributed and topo.dp_size > 1:  # the other replicas' progress (one replica: rank 0 writes it all)
            count = torch.tensor([written], dtype=torch.long, device=device)
            dist.all_reduce(count)
            written = int(count)
        already += written
        if topo.rank == 0:
            progress.update(already)
    if writer is not None:
        writer.close()
    runtime = time.monotonic() - start
    if topo.rank == 0:
        progress.update(already, force=True)

    result: list = [None]
    if topo.rank == 0:
        try:
            metrics = merge_parts(parts_dir, topo.dp_size, n, out_dir / predictions_file, metric)
            shutil.rmtree(parts_dir)
            result[0] = {"metrics": metrics}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait
            result[0] = {"error": f"{type(e).__name__}: {e}"}
    if distributed:
        dist.broadcast_object_list(result, src=0)
    if "error" in result[0]:
        raise RuntimeError(f"merging the predictions failed: {result[0]['error']}")
    generated = _sum_over_replicas(generated, topo, device, distributed)
    metrics = {f"{metric_key_prefix}_{k}": v for k, v in result[0]["metrics"].items()}
    metrics.update({
        f"{metric_key_prefix}_samples": n,  # the whole set, resumed or not
        f"{metric_key_prefix}_generated_samples": generated,  # generated by this run
        f"{metric_key_prefix}_resumed_samples": n - generated,
        f"{metric_key_prefix}_runtime": round(runtime, 4),
        f"{metric_key_prefix}_samples_per_second": round(generated / max(runtime, 1e-9), 3),
    })
    return metrics


def _sum_over_replicas(value: int, topo, device, distributed: bool) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value if topo.tp_rank == 0 else 0], dtype=torch.long, device=device)
    if distributed:
        dist.all_reduce(t)
    return int(t)


def _records(tokenizer, pad, tokens, labels, positions: range, order, metric) -> list[dict]:
    """One record per example of the batch: its input index, its decoded prediction(s), its statistics."""
    import torch

    per = max(1, tokens.shape[0] // len(positions))  # num_return_sequences
    rows = tokens.cpu()
    counts = (rows != pad).sum(-1).tolist() if pad is not None else [rows.shape[-1]] * rows.shape[0]
    rows = torch.where(rows == -100, pad if pad is not None else 0, rows)
    # decoded as upstream's run_translation.py does: the file with clean_up_tokenization_spaces=True, the
    # metric (in its compute_metrics) with the tokenizer's default
    texts = [t.strip() for t in tokenizer.batch_decode(rows, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=True)]
    stats = None
    if metric is not None:
        references = None
        if labels is not None:
            labels = torch.where(labels.cpu() == -100, pad if pad is not None else 0, labels.cpu())
            references = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        hypotheses = texts if getattr(tokenizer, "clean_up_tokenization_spaces", None) is True else \
            [t.strip() for t in tokenizer.batch_decode(rows, skip_special_tokens=True)]  # decode twice only if they differ
        stats = metric.stats(_per_example(hypotheses, per), references,
                             [sum(counts[j * per:(j + 1) * per]) for j in range(len(positions))])
    texts = _per_example(texts, per)
    records = []
    for j, pos in enumerate(positions):
        record = {"i": order[pos] if order is not None else pos, "p": texts[j]}
        if stats is not None:
            record["s"] = stats[j]
        records.append(record)
    return records


def _per_example(rows: list[str], per: int) -> list:
    """One entry per example: its text, or the list of its `per` texts (num_return_sequences > 1)."""
    return rows if per == 1 else [rows[j:j + per] for j in range(0, len(rows), per)]
