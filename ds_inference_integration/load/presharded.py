"""The pre-sharded directory format: written by `ds-inference shard`, read by `--loading pre-sharded`.

A directory holds one safetensors file per TP rank (`rank-R-of-N.safetensors`), the source's config
and tokenizer files, and `manifest.json`, written last. The manifest records the tp size, the policy
identity, the dtype, the source checkpoint (path, sha256, file stats), a random `shard_id` for this
sharding, and per rank file its name, rank, size, sha256 and the file's stat (device, inode, size,
mtime, ctime) right after it was renamed into place. Each rank file carries the same `shard_id`,
its rank and the tp size in its own safetensors metadata.

What a load checks, and what it costs (README, "Loading only your shard"):

* every rank checks every file's size and header metadata (shard id, rank, tp size): a stat and a
  header read per file, whatever the model size; a file of another sharding, a swapped rank or a
  half-finished re-shard (old manifest, new rank 0) fails here;
* each rank checks its own file's content: if the file's stat is still the one recorded when it was
  written (same inode, size, mtime and ctime: nothing has written to it, renamed or copied it since),
  its sha256 is not recomputed; otherwise (a copied directory, a file written to) the rank hashes its
  own file, about 1/tp of the model per rank, in parallel;
* the TP group then agrees: one rank's failure is every rank's one-line error.

`ds-inference shard` removes an old manifest before it writes anything, writes every file under a
temporary name and renames it when complete, and writes the manifest last: an interrupted run
leaves a directory that is refused (rank files without a manifest), never one that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from ..errors import InferenceSetupError
from ..run.files import write_text_atomic
from .checkpoint import checkpoint_files, inside_dir, open_safetensors

MANIFEST = "manifest.json"
FORMAT = "ds-inference-presharded/2"
RANK_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")
# Files of the source directory not copied into a pre-sharded one: weights in any format, and their indexes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def rank_file(rank: int, tp_size: int) -> str:
    return f"rank-{rank:05d}-of-{tp_size:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def file_stat(path: Path) -> list[int]:
    """What changes when anything writes to, replaces or copies a file (ctime cannot be set back by a user)."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hash_file(h, path: Path):
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h


def sha256_file(path: Path) -> str:
    return _hash_file(hashlib.sha256(), path).hexdigest()


def source_fingerprint(files: list[Path]) -> str:
    """sha256 over the contents of a checkpoint's files (in name order)."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0")
        _hash_file(h, path)
    return h.hexdigest()


def _source_stats(files: list[Path]) -> list:
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(files, key=lambda p: p.name)]


# Writing --------------------------------------------------------------------------------------------

def new_identity(tp_size: int, policy_identity: str, dtype: torch.dtype) -> dict:
    return {"shard_id": uuid.uuid4().hex, "tp_size": tp_size, "policy": policy_identity, "dtype": dtype_name(dtype)}


def start_writing(out_dir: Path) -> None:
    """Before any rank writes: the old manifest goes first, so the directory is never valid half-written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)


def write_rank_file(model: nn.Module, out_dir: Path, tp_rank: int, identity: dict) -> dict:
    """Save this rank's parameters (each shared tensor once, under its first name) and persistent buffers under
    a temporary name, hash them, and rename into place. Returns the manifest's record of the file."""
    from safetensors.torch import save_file

    tensors, seen, stored = {}, set(), set()

    def own(t: torch.Tensor) -> torch.Tensor:
        # parameters of their own over one memory (Zamba2's shared block in each of its places, read shard-aware
        # into views of one tensor): safetensors refuses to save those ("Some tensors share memory", a traceback on
        # every rank of `ds-inference shard` and of policy check's pre-sharded check); each is saved as a copy
        t = t.detach().to("cpu").contiguous()
        where = t.untyped_storage().data_ptr() if t.numel() else None
        if where in stored:
            return t.clone()
        stored.add(where)
        return t

    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        tensors[name] = own(p)
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent:
            tensors[name] = own(buf)
    name = rank_file(tp_rank, identity["tp_size"])
    tmp = out_dir / f".{name}.{identity['shard_id']}.tmp"
    metadata = {"format": FORMAT, "tp_rank": str(tp_rank), **{k: str(v) for k, v in identity.items()}}
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        digest = sha256_file(tmp)
        os.replace(tmp, out_dir / name)
    finally:
        tmp.unlink(missing_ok=True)
    return {"name": name, "rank": tp_rank, "bytes": (out_dir / name).stat().st_size, "sha256": digest,
            "stat": file_stat(out_dir / name),
            "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def write_manifest(source: Path, out_dir: Path, identity: dict, files: list[dict]) -> dict:
    """Copy the config and tokenizer files (not the weights), then write the manifest, last and atomically."""
    source_files = checkpoint_files(source)
    manifest = {"format": FORMAT, **identity, "files": sorted(files, key=lambda f: f["rank"]),
                "source": {"path": str(source.resolve()), "sha256": source_fingerprint(source_files),
                           "stats": _source_stats(source_files)}}
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not item.name.endswith(".index.json") \
                and item.name != MANIFEST:
            shutil.copy2(item, out_dir / item.name)
    keep = {f["name"] for f in files}
    for stale in out_dir.iterdir():  # rank files of an earlier sharding (another tp size) would only mislead
        if RANK_FILE.fullmatch(stale.name) and stale.name not in keep:
            stale.unlink()
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def write_presharded(model: nn.Module, source: Path, out_dir: Path, topology, groups, policy_identity: str,
                     dtype: torch.dtype) -> dict | None:
    """Every rank writes its file; rank 0 writes the manifest once all are written. Returns the manifest on
    rank 0. Call `start_writing(out_dir)` once before the ranks start (the `shard` command does)."""
    import torch.distributed as dist

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    identity = new_identity(topology.tp_size, policy_identity, dtype)
    if topology.tp_size > 1:  # one shard id for the whole group: rank 0's
        box = [identity]
        dist.broadcast_object_list(box, src=dist.get_global_rank(groups.tp, 0), group=groups.tp)
        identity = box[0]
    mine = write_rank_file(model, out_dir, topology.tp_rank, identity)
    records = [mine]
    if topology.tp_size > 1:
        records = [None] * topology.tp_size
        dist.all_gather_object(records, mine, group=groups.tp)
    manifest = write_manifest(Path(source), out_dir, identity, records) if topology.tp_rank == 0 else None
    if topology.tp_size > 1:
        dist.barrier(group=groups.tp)
    return manifest


# Reading and checking -------------------------------------------------------------------------------

def read_manifest(model_dir: Path) -> dict | None:
    """The manifest of a pre-sharded directory; None for an ordinary model directory. A directory with rank
    files but no manifest (an interrupted `shard`), or a manifest of another format, is refused."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    if not path.is_file():
        if model_dir.is_dir() and any(RANK_FILE.fullmatch(p.name) for p in model_dir.iterdir()):
            raise InferenceSetupError(f"{model_dir} has rank files but no {MANIFEST}: an interrupted `ds-inference "
                                      "shard`? re-run it")
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise InferenceSetupError(f"{path} is not valid JSON ({e}); re-run `ds-inference shard`") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise InferenceSetupError(f"{path} has format {found!r}, this version reads {FORMAT!r}: re-run "
                                  "`ds-inference shard`")
    return data


def check_manifest(manifest: dict, model_dir: Path, tp_size: int, policy_id: str, dtype: torch.dtype) -> None:
    """One clear error when a pre-sharded directory does not fit this run (before any file is read)."""
    source = Path(manifest["source"]["path"])
    if manifest["tp_size"] != tp_size:
        raise InferenceSetupError(
            f"{model_dir} is pre-sharded for --tp_size {manifest['tp_size']}, this run has tp {tp_size}: re-run "
            f"`ds-inference shard {source} --tp-size {tp_size} OUT_DIR`, or load the source directory"
        )
    if manifest["policy"] != policy_id:
        raise InferenceSetupError(
            f"{model_dir} was sharded with policy {manifest['policy']}, this run resolves {policy_id}: re-run "
            "ds-inference shard"
        )
    if manifest["dtype"] != dtype_name(dtype):
        raise InferenceSetupError(
            f"{model_dir} was sharded in {manifest['dtype']}, this run uses {dtype_name(dtype)}: pass --inference_dtype "
            f"{_flag_of(manifest['dtype'])}, or re-run `ds-inference shard ... --dtype {_flag_of(dtype_name(dtype))}`"
        )
    files = manifest["files"]
    if sorted(f.get("rank") for f in files) != list(range(tp_size)):
        raise InferenceSetupError(f"{model_dir}/{MANIFEST} lists ranks {[f.get('rank') for f in files]}, not 0..{tp_size - 1}")
    for f in files:
        inside_dir(Path(model_dir), f["name"], f"{model_dir}/{MANIFEST}")
    source_files = checkpoint_files(source) if source.is_dir() else None
    if source_files is None:
        return  # the source is gone: the directory stands on its own
    if _source_stats(source_files) != manifest["source"]["stats"] and \
            source_fingerprint(source_files) != manifest["source"]["sha256"]:
        raise InferenceSetupError(
            f"the source checkpoint {source} changed since {model_dir} was sharded (sha256 differs from "
            f"{manifest['source']['sha256'][:12]}): re-run `ds-inference shard {source} --tp-size {tp_size} {model_dir}`"
        )


def _flag_of(name: str) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(name, name)


def verify_rank_files(manifest: dict, model_dir: Path, tp_rank: int) -> str | None:
    """What is wrong with the directory's rank files as this rank sees them, or None (see the module docstring
    for what is checked and what it costs)."""
    model_dir = Path(model_dir)
    for record in manifest["files"]:
        path = model_dir / record["name"]
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != record["bytes"]:
            return f"{path} has {size} bytes, the manifest recorded {record['bytes']}"
        try:
            meta = open_safetensors(path).metadata() or {}
        except InferenceSetupError as e:
            return str(e)
        want = {"shard_id": manifest["shard_id"], "tp_rank": str(record["rank"]), "tp_size": str(manifest["tp_size"])}
        got = {k: meta.get(k) for k in want}
        if got != want:
            wrong = next(k for k in want if got[k] != want[k])
            return (f"{path} belongs to another sharding ({wrong} {got[wrong]!r}, the manifest says {want[wrong]!r}): "
                    "an interrupted or mixed `ds-inference shard`; re-run it")
    mine = next(r for r in manifest["files"] if r["rank"] == tp_rank)
    path = model_dir / mine["name"]
    if file_stat(path) != mine["stat"] and sha256_file(path) != mine["sha256"]:
        return f"{path} does not hold what was written (sha256 differs from {mine['sha256'][:12]}): re-run ds-inference shard"
    return None


def verify_in_group(manifest: dict, model_dir: Path, tp_rank: int, group) -> None:
    """`verify_rank_files` on every rank of the TP group; any rank's problem is raised on all of them."""
    import torch.distributed as dist

    problem = verify_rank_files(manifest, model_dir, tp_rank)
    problems = [problem]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    first = next(((r, p) for r, p in enumerate(problems) if p), None)
    if first is not None:
        raise InferenceSetupError(f"pre-sharded {model_dir}: {first[1]}" + (
            f" (found by TP rank {first[0]})" if len(problems) > 1 else ""))
