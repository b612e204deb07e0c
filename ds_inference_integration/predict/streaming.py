"""Streamed, resumable predict: every finished batch's decoded predictions go to disk as they complete, one
part file per data-parallel replica, and a re-run of the same command continues where a crash stopped it. At
the end rank 0 merges the parts into the predictions file, in input order and atomically, computes the metrics
from the per-example statistics stored beside each prediction, and removes the parts.

Rank 0 writes every part, on its own disk: after each batch the first rank of every other replica sends it its
records over the process group (one `gather_object` per step, with more than one replica). So a run needs no
shared file system, and nodes with disks of their own merge as one node does (`run/output_dir.py` says where things
live in each layout). After each step rank 0 tells every rank whether the write went through, so a full disk
ends every rank with the same one line, and nothing is claimed.

Layout of `<output_dir>/<prefix>_parts/` (rank 0's):
    manifest.json     what the run is (model, data, layout, generation settings): a resume must match it
    part-dp<R>.jsonl  replica R's records, one line per example, in the replica's batch order:
                      `<crc32 of the JSON, 8 hex digits> {"i": input index, "p": prediction (or a list for
                      several sequences), "s": statistics}`

Why the parts stay correct after any crash, or a hand edit: a replica's batches are fixed by the data size, the
batch size and the replica count (global batch g = examples g*B .. g*B+B-1, replica g mod dp), so the input
index of every line of a part is known in advance. A resume keeps the longest prefix of each part whose lines
are whole, pass their checksum and carry the expected index, and cuts the rest off (a line cut short by a kill,
lines swapped or edited by hand, a disk that filled mid-write); only the rest is generated again. Generation of
a batch does not depend on other batches (sampling is seeded per global batch), so a resumed run writes the same
bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import InferenceSetupError, RunFailure
from ..run import output_dir
from ..run.files import atomic_path, write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


# The batch grid --------------------------------------------------------------------------------------

def replica_batches(n: int, batch_size: int, dp_size: int, dp_rank: int) -> list[range]:
    """Positions of the examples in each of this replica's batches, in order: global batch g holds
    positions g*B .. min(n, g*B+B)-1 and belongs to replica g mod dp (as accelerate splits a sequential
    loader between replicas, without the padding it adds at the end: nothing is generated twice)."""
    return [range(g * batch_size, min(n, (g + 1) * batch_size))
            for g in range(dp_rank, -(-n // batch_size), dp_size)]


def replica_indices(batches: list[range], order: list[int] | None) -> Iterator[int]:
    """The input index of every example of a replica, in the order its part holds them."""
    for positions in batches:
        for pos in positions:
            yield order[pos] if order is not None else pos


# One replica's part file ---------------------------------------------------------------------------

def part_path(parts_dir: Path, dp_rank: int) -> Path:
    return Path(parts_dir) / f"part-dp{dp_rank}.jsonl"


def encode_record(record: dict) -> bytes:
    body = json.dumps(record, ensure_ascii=False).encode("utf-8")
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def parse_record(line: bytes) -> dict | None:
    """The record of one line, or None when the line is not whole: no newline (cut short), a checksum that does
    not match (damaged or edited), not a record."""
    if not line.endswith(b"\n") or len(line) < 11 or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict) or type(record.get("i")) is not int or "p" not in record:
        return None
    return record


def _whole_lines(path: Path) -> Iterator[tuple[int, int, dict]]:
    """(byte offset, length, record) for every line of `path` up to the first that is not whole."""
    if not Path(path).is_file():
        return
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            record = parse_record(line)
            if record is None:
                return
            yield offset, len(line), record
            offset += len(line)


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(byte offset, record) for every line of `path` up to the first that is not whole."""
    for offset, _, record in _whole_lines(path):
        yield offset, record


def valid_prefix(path: Path, expected: Iterable[int] | None = None) -> tuple[int, int]:
    """(records, bytes) of the longest prefix of `path` whose lines are whole and, when `expected` gives the input
    index each line must carry, carry it."""
    expected = iter(expected) if expected is not None else None
    records = size = 0
    for offset, length, record in _whole_lines(path):
        if expected is not None and record["i"] != next(expected, None):
            break
        records, size = records + 1, offset + length
    return records, size


complete_length = valid_prefix


class PartWriter:
    """Appends one replica's records; opening it cuts the part back to its valid prefix (see the module's
    docstring), saying so when it cuts more than a line left unfinished by a kill."""

    def __init__(self, path: Path, expected: Iterable[int] | None = None):
        self.path = Path(path)
        self.records, size = valid_prefix(self.path, expected)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        on_disk = os.fstat(self._fd).st_size
        if on_disk > size:
            os.ftruncate(self._fd, size)
            logger.warning("%s: kept its first %d records; the %d bytes after them were cut short, damaged or out of "
                           "order, and are generated again", self.path, self.records, on_disk - size)

    def write(self, records: list[dict]) -> None:
        """One batch: written whole (os.write may write part of it: the rest follows) and fsynced, so a killed
        process loses nothing written; a disk that fills mid-batch raises OSError, and the resume cuts the part
        back to its last whole line."""
        data = memoryview(b"".join(encode_record(r) for r in records))
        while data:
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)
        self.records += len(records)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def disk_failure(action: str, path: Path, error: OSError) -> str:
    """The one line for a file system that refused a write (full, read-only, gone)."""
    return (f"{action} {path} failed: {error.strerror or error} (errno {error.errno}); nothing was claimed "
            "done: fix the disk (make space) and re-run the same command, which resumes from what is on disk")


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
    """The model's name or path, its config, the inference dtype, and a fingerprint of the contents of its weight
    files (sizes alone let a newer checkpoint of the same shapes, copied over the old one, resume the old one's
    parts and merge two models' predictions into one file)."""
    config = model.config.to_json_string(use_diff=False)
    source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    files = {}
    if source and Path(source).is_dir():
        from ..load.presharded import WEIGHT_SUFFIXES

        files = {p.name: weights_fingerprint(p) for p in sorted(Path(source).iterdir())
                 if p.suffix in WEIGHT_SUFFIXES and p.is_file()}
    return {"name_or_path": source, "config_sha256": hashlib.sha256(config.encode()).hexdigest()[:16],
            "dtype": str(dtype).replace("torch.", ""), "weight_files": files}


SAMPLED_ABOVE = 64 * 2**20  # bytes; smaller files are hashed whole
SAMPLES, SAMPLE_BYTES = 32, 2**20


def weights_fingerprint(path: Path) -> str:
    """`<size>:<sha256>` of a weight file: of all of it up to 64 MiB, else of its first MiB (a safetensors header
    names every tensor's place) and 32 blocks of 1 MiB spread evenly through it: 33 MiB read per file however
    large, and a checkpoint trained further differs in every block."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_ABOVE:
            while chunk := f.read(8 * 2**20):
                h.update(chunk)
        else:
            step = (size - SAMPLE_BYTES) // SAMPLES
            for offset in [0, *(step * (k + 1) for k in range(SAMPLES))]:
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return f"{size}:{h.hexdigest()[:16]}"


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


def run_identity(model, dataset, order, topology, batch_size: int, gen_kwargs: dict | None,
                 seed: int | None) -> RunIdentity:
    """What decides the bytes of a streamed predict: the model and its weights, the data (and whether it is
    length-grouped), the layout, the generation settings and, when sampling, the seed. A resume must match it."""
    gen = {k: v for k, v in sorted((gen_kwargs or {}).items()) if v is not None}
    return RunIdentity(
        model=model_identity(model, next(model.parameters()).dtype),
        data={"examples": len(dataset), "sha256": fingerprint_rows(dataset), "length_grouped": order is not None},
        layout={"tp_size": topology.tp_size, "dp_size": topology.dp_size, "batch_size": batch_size},
        generation={"kwargs": json.loads(json.dumps(gen, default=str)),
                    "generation_config": generation_identity(getattr(model, "generation_config", None)),
                    "seed": seed},
    )


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
                rec = parse_record(f.readline())
                if rec is None or rec["i"] != i:  # the part changed under the merge
                    raise RuntimeError(f"{f.name}: the record of example {i} changed while the parts were merged")
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


@dataclass
class StreamJob:
    """What `streamed_predict` needs from its caller (the Trainer mixin passes its own): the examples in
    processing order (`order[pos]`: the input index of position `pos`; None: the identity), where and how many a
    batch, the run's identity (a function: only rank 0 computes it, it hashes every example), how a batch's
    examples become model inputs (`collate`), and the step (`generate(k, inputs)`: the token ids of batch `k`)."""

    dataset: object
    order: list[int] | None
    topology: object
    output_dir: Path
    batch_size: int
    identity: Callable[[], "RunIdentity"]
    collate: Callable[[list], dict]
    generate: Callable[[int, dict], object]
    tokenizer: object


def streamed_predict(job: StreamJob, *, metric=None, metric_key_prefix: str = "predict",
                     predictions_file: str = "generated_predictions.txt", fresh: bool = False) -> dict:
    """The loop behind `DeepSpeedInferenceMixin.predict_to_file`; returns the metrics on every rank.
 Every rank walks the same number of steps: each step generates one batch of its replica (or
    nothing, once its replica is done); with more than one replica the replicas' first ranks then send their
    records to rank 0 (one gather), and rank 0, having written them, tells every rank whether that went through
    (one broadcast), which also keeps replicas with less left in step with the others without any long
    collective."""
    import time

    import torch.distributed as dist

    topo, dataset, order = job.topology, job.dataset, job.order
    n = len(dataset)
    out_dir = Path(job.output_dir)
    parts_dir = out_dir / f"{metric_key_prefix}_parts"
    distributed = dist.is_available() and dist.is_initialized() and topo.world_size > 1
    grids = [replica_batches(n, job.batch_size, topo.dp_size, r) for r in range(topo.dp_size)]
    batches = grids[topo.dp_rank]
    output_dir.survey(out_dir, topo, parts_dir.name, fresh)  # which disk holds what; stale parts elsewhere refused

    # Rank 0 opens (or checks) the run and cuts every part back to its valid prefix; every rank learns where its
    # replica resumes.
    writers, status = None, {"error": None, "failure": False, "resumed": False, "done": [0] * topo.dp_size}
    if topo.rank == 0:
        try:
            output_dir.claim(out_dir)
            status["resumed"] = open_run(parts_dir, job.identity(), fresh)
            writers = [PartWriter(part_path(parts_dir, r), replica_indices(grids[r], order))
                       for r in range(topo.dp_size)]
            status["done"] = [w.records for w in writers]
        except InferenceSetupError as e:
            status["error"] = str(e)
        except OSError as e:
            status.update(error=disk_failure("opening the parts in", parts_dir, e), failure=True)
    status = _from_rank0(status, distributed)
    if status["error"]:
        _close(writers)
        raise (RunFailure if status["failure"] else InferenceSetupError)(status["error"])
    done_mine = status["done"][topo.dp_rank]
    skip, before = _resume_point(batches, done_mine)  # batches wholly on disk; examples in them
    steps = max(len(grid) - _resume_point(grid, done)[0] for grid, done in zip(grids, status["done"]))
    already = resumed = sum(status["done"])
    if topo.rank == 0:
        if status["resumed"]:
            logger.warning("resumed: %d of %d examples already done", already, n)
        logger.warning("predictions stream to %s (one part per replica, all written by rank 0), merged into %s "
                       "at the end", parts_dir, out_dir / predictions_file)
    progress = _Progress(n, already)
    tokenizer = job.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    start = time.monotonic()
    for step in range(steps):
        k = skip + step
        records = None
        if k < len(batches):
            positions = batches[k]
            features = [dataset[p] for p in positions]
            inputs = job.collate(features)
            labels = inputs.pop("labels", None)  # references only: no teacher-forced loss pass per batch
            if labels is not None:  # and no decoder inputs the collator made from them
                inputs.pop("decoder_input_ids", None)
                inputs.pop("decoder_attention_mask", None)
            tokens = job.generate(k, inputs)
            if topo.tp_rank == 0:
                first = done_mine - before if k == skip else 0  # a batch a crash cut short: its tail only
                records = _records(tokenizer, pad, tokens, labels, positions, order, metric)[first:]
        if distributed and topo.dp_size > 1:
            sent = [None] * topo.world_size if topo.rank == 0 else None
            dist.gather_object(records, sent, dst=0)
            per_replica = [sent[r * topo.tp_size] for r in range(topo.dp_size)] if topo.rank == 0 else None
        else:
            per_replica = [records]
        error = None
        if topo.rank == 0:
            try:
                for r, recs in enumerate(per_replica):
                    if recs:
                        writers[r].write(recs)
                        already += len(recs)
            except OSError as e:
                error = disk_failure("writing the predictions to", writers[r].path, e)
            progress.update(already)
        if distributed:
            error = _from_rank0(error, distributed)
        if error:
            _close(writers)
            raise RunFailure(error)
    _close(writers)
    runtime = time.monotonic() - start
    if topo.rank == 0:
        progress.update(already, force=True)

    result: dict = {}
    if topo.rank == 0:
        try:
            metrics = merge_parts(parts_dir, topo.dp_size, n, out_dir / predictions_file, metric)
            shutil.rmtree(parts_dir)
            result = {"metrics": metrics, "generated": already - resumed}
        except OSError as e:
            result = {"error": disk_failure("writing", out_dir / predictions_file, e)}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait
            result = {"error": f"merging the predictions failed: {type(e).__name__}: {e}"}
    result = _from_rank0(result, distributed)
    if "error" in result:
        raise RunFailure(result["error"])
    generated = result["generated"]
    metrics = {f"{metric_key_prefix}_{k}": v for k, v in result["metrics"].items()}
    metrics.update({
        f"{metric_key_prefix}_samples": n,  # the whole set, resumed or not
        f"{metric_key_prefix}_generated_samples": generated,  # generated by this run
        f"{metric_key_prefix}_resumed_samples": n - generated,
        f"{metric_key_prefix}_runtime": round(runtime, 4),
        f"{metric_key_prefix}_samples_per_second": round(generated / max(runtime, 1e-9), 3),
    })
    return metrics


def _resume_point(batches: list[range], done: int) -> tuple[int, int]:
    """(batches wholly among the first `done` examples, the examples in them)."""
    skip = before = 0
    while skip < len(batches) and before + len(batches[skip]) <= done:
        before += len(batches[skip])
        skip += 1
    return skip, before


def _from_rank0(value, distributed: bool):
    """Rank 0's `value` on every rank (a bounded wait: the process group's timeout)."""
    if not distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _close(writers) -> None:
    for w in writers or ():
        w.close()


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
