"""The output directory of a run: checked before the model loads, held by one run at a time, and surveyed at the
start of a streamed predict for whether every rank sees the one rank 0 writes to.

Where things live, in every layout (one shared disk, a disk per node, only rank 0's disk kept): rank 0 writes
every file of a run, the parts of a streamed predict included (the other replicas send their records to it
over the process group, `predict/streaming.py`), in its own `--output_dir`. So nothing is read from another node's
disk, and a resume works wherever rank 0 starts again with the same `--output_dir` on the same disk. A layout
that cannot resume is one where the parts are on a disk rank 0 no longer sees (the nodes swapped, so the node
that was rank 0 is now another rank): that is refused at start, naming the rank and the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import uuid
from pathlib import Path

from ..errors import InferenceSetupError

logger = logging.getLogger(__name__)

LOCK_NAME = ".ds-inference.lock"
_held: dict[str, int] = {}  # resolved directory -> open file descriptor holding its lock


def check(path: str | os.PathLike, flag: str = "--output_dir") -> Path:
    """Create `path` if needed; one line if it is a file, lies below a file, or cannot be written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InferenceSetupError(f"{flag} {str(path)!r} is a file; valid: a directory (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), path)
        raise InferenceSetupError(f"{flag} {str(path)!r} cannot be created: {str(blocker)!r} is a file; valid: a "
                                  "directory path") from None
    except OSError as e:
        raise InferenceSetupError(f"{flag} {str(path)!r} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InferenceSetupError(f"{flag} {str(path)!r} is not writable by this user; valid: a writable directory")
    return path


def claim(path: str | os.PathLike, flag: str = "--output_dir") -> None:
    """Hold `path` for this process's run (rank 0's): a second run into the same directory, while this one lives,
    is refused in one line naming the run that holds it. The lock is the kernel's (flock), so it ends with the
    process however the process ends: no stale lock after a crash or a kill. Re-entrant within a process."""
    key = str(Path(path).resolve())
    if key in _held:
        return
    check(path, flag)
    fd = os.open(os.path.join(key, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise InferenceSetupError(f"{flag} {key!r} cannot be locked: {e.strerror}", ranks=[0]) from None
        raise InferenceSetupError(
            f"{flag} {key!r} is in use by another run ({holder}); wait for it to end, or give another {flag}",
            ranks=[0]) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held[key] = fd


def release_all() -> None:
    """Give up every lock this process holds (a process's end does it too; for callers that run several runs'
    `main` in one process, as the tests do)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)


def _manifest_digest(out_dir: Path, parts_name: str) -> str | None:
    """sha256 of the parts manifest this rank sees in its own directory (None: none there)."""
    import hashlib

    try:
        return hashlib.sha256((out_dir / parts_name / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def survey(out_dir: Path, topology, parts_name: str, fresh: bool) -> dict:
    """Every rank, before a streamed predict generates: does each rank see rank 0's output directory? Rank 0 puts
    a file with a random name there and every rank looks for it in its own `--output_dir`. Logs the layout on
    rank 0. Refuses (on every rank) the parts of an earlier run that a rank not seeing rank 0's directory holds
    and rank 0 does not (their manifests differ), unless `fresh`: then that rank removes them. Comparing the
    manifests, not only the marker, keeps a shared disk that shows a new file late (NFS caches a name's absence
    for up to its attribute timeout) from being taken for another disk holding other parts.
    Returns {"shared": bool, "apart": [ranks that do not see it]}."""
    import torch.distributed as dist

    out_dir = Path(out_dir)
    if not (dist.is_available() and dist.is_initialized()) or topology.world_size == 1:
        return {"shared": True, "apart": []}
    head = [uuid.uuid4().hex, _manifest_digest(out_dir, parts_name)] if topology.rank == 0 else [None, None]
    marker = None
    if topology.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)  # a script without our parser may not have made it yet
        marker = out_dir / f".ds-inference-layout-{head[0]}"
        marker.write_text(head[0])
    dist.broadcast_object_list(head, src=0)  # after rank 0 wrote the marker
    token, rank0_manifest = head
    sees = (out_dir / f".ds-inference-layout-{token}").is_file()
    mine = None if sees else _manifest_digest(out_dir, parts_name)
    stale = mine is not None and mine != rank0_manifest
    if stale and fresh:
        import shutil

        shutil.rmtree(out_dir / parts_name, ignore_errors=True)  # every rank of that node may try: ignore races
        stale = False
    views = [None] * topology.world_size
    dist.all_gather_object(views, {"sees": sees, "stale": stale, "host": socket.gethostname(),
                                   "dir": str(out_dir.resolve())})
    if marker is not None:
        marker.unlink(missing_ok=True)
    apart = [r for r, v in enumerate(views) if not v["sees"]]
    stale_ranks = [r for r, v in enumerate(views) if v["stale"]]
    if stale_ranks:
        r = stale_ranks[0]
        raise InferenceSetupError(
            f"rank {r} (on {views[r]['host']}) holds the parts of an earlier predict run in "
            f"{views[r]['dir']}/{parts_name}, which rank 0 ({views[0]['host']}) cannot see: start the node that "
            f"holds them as node rank 0 to resume them, or pass --overwrite_output_dir to start afresh")
    if topology.rank == 0:
        if not apart:
            logger.warning("output directory: %s, seen by all %d ranks (one file system): the parts and results are "
                           "written there by rank 0", views[0]["dir"], topology.world_size)
        else:
            hosts = sorted({views[r]["host"] for r in apart})
            logger.warning("output directory: %s on rank 0's disk; ranks %s (on %s) do not see it (no shared file "
                           "system): every replica's predictions are sent to rank 0, which writes the parts and the "
                           "results there; a resume needs rank 0 started with that directory again",
                           views[0]["dir"], _ranges(apart), ", ".join(hosts))
    return {"shared": not apart, "apart": apart}


def _ranges(ranks: list[int]) -> str:
    contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
    return f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 3 else ", ".join(str(r) for r in ranks)
