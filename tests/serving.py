"""Starting `ds-inference serve` for a test, and a small HTTP client (urllib, bounded by timeouts).

Every server listens on 127.0.0.1 at a free port, in its own process group; `stop()` ends the group (ranks
included) and the test checks no rank is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import suite_threads
from ds_inference_integration.run.ranks import stop_session
from ds_inference_integration.serve.settings import announced_port

BIN = Path(sys.executable).parent


class ServerProc:
    """`own_logs`: no --log_dir, so the server makes (and must remove) its own under `log_dir / "tmp"` (TMPDIR).
    `fault`: DS_INFERENCE_FAULT for the tests' fault hooks (tests/faults/sitecustomize.py)."""

    def __init__(self, model: Path, args: list[str], log_dir: Path, ranks: int, http: bool = True,
                 own_logs: bool = False, fault: str | None = None):
        self._port = None
        self.log = open(log_dir / "front.log", "w+")
        self.tmp = log_dir / "tmp"
        self.tmp.mkdir(exist_ok=True)
        env = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"), **os.environ,
               "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(suite_threads(ranks)), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
               "TMPDIR": str(self.tmp)}
        if fault:
            faults = str(Path(__file__).resolve().parent / "faults")
            env.update(DS_INFERENCE_FAULT=fault, PYTHONPATH=os.pathsep.join(filter(None, [faults, env.get("PYTHONPATH")])))
        port = ["--port", "0"] if http else []  # the server binds a free one and says which (`port`)
        logs = [] if own_logs else ["--log_dir", str(log_dir / "ranks")]
        self.proc = subprocess.Popen([str(BIN / "ds-inference"), "serve", str(model), *port, *logs, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.monotonic()

    @property
    def port(self) -> int:
        """The port the server bound and announced (waiting, bounded, for its first line)."""
        deadline = time.monotonic() + 120
        while self._port is None:
            self._port = announced_port(self.output())
            if self._port is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server announced no port:\n{self.output()[-3000:]}")
                time.sleep(0.1)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        if not self.log.closed:  # after stop() too: a fixture's last assertion reads it
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            port = self._port or announced_port(self.output())
            if port and get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                self._port = port
                return time.monotonic() - self.started
            time.sleep(0.3)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.output()[-3000:]}")

    def ranks(self) -> list[int]:
        """The pids of this server's rank processes: its children running the engine, or where the ranks are forked
        from a template (`run/template.py`: no GPU), the template's children."""
        ranks = []
        for pid in _children(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            ranks += _children(pid) if b"ds_inference_integration.run.template" in cmdline else [pid]
        return sorted(ranks)  # started in rank order

    def group_alive(self, within: float = 5.0) -> list[int]:
        """Processes of the server's process group (its ranks included) still there after `within` s (a killed
        process takes a moment to go; zombies, ended and not yet reaped, are not counted)."""
        deadline = time.monotonic() + within
        while True:
            out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
            alive = [int(p) for p in out if _state(int(p)) not in ("Z", None)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM (the server drains and ends its ranks), then SIGKILL for whatever is left of the group."""
        stop_session(self.proc, grace=30)
        self.log.close()


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def request(method: str, url: str, body: dict | None = None, timeout: float = 60, headers: dict | None = None,
            raw: bytes | None = None) -> tuple[int, dict | str, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text, status, hdrs = r.read().decode(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        text, status, hdrs = e.read().decode(), e.code, dict(e.headers)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e), {}
    try:
        return status, json.loads(text), hdrs
    except json.JSONDecodeError:
        return status, text, hdrs


def post_on(client, body: dict, headers: bytes = b"") -> None:
    """POST `body` to /v1/completions on an open socket, which the test then reads as the answer comes, or closes
    (a client that leaves): what urllib's one call cannot do. `headers`: more header lines, each ending in CRLF."""
    data = json.dumps(body).encode()
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
                   b"Content-Length: %d\r\n\r\n%s" % (headers, len(data), data))


def get(url: str, timeout: float = 10):
    status, body, _ = request("GET", url, timeout=timeout)
    return status, body


def post(url: str, body: dict, timeout: float = 60):
    status, body, _ = request("POST", url, body, timeout=timeout)
    return status, body


def post_all(url: str, bodies: list[dict], concurrency: int, timeout: float = 120) -> list[tuple[int, dict]]:
    """POST every body with `concurrency` clients at once; answers in the bodies' order."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda b: post(url, b, timeout), bodies))


def post_arriving(url: str, bodies: list[dict], concurrency: int, rate: float, seed: int = 0,
                  timeout: float = 120) -> list[tuple[int, dict]]:
    """POST every body at a Poisson arrival time (`rate` a second on average, seeded), at most `concurrency` open at
    once (a body whose time has come waits for a free client); answers in the bodies' order."""
    import random

    draw, at = random.Random(seed), []
    for _ in bodies:
        at.append((at[-1] if at else 0.0) + draw.expovariate(rate))
    start = time.monotonic()

    def send(i):
        time.sleep(max(0.0, start + at[i] - time.monotonic()))
        return post(url, bodies[i], timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(send, range(len(bodies))))


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on, read from /proc: 127.0.0.1 is "127.0.0.1",
    every interface "0.0.0.0" or "::"."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc prints 32-bit words host-order
            found.append((str(ipaddress.ip_address(raw[:width])), int(port, 16)))
    return found


def admit(rows, num_beams: int = 1, k: int = 1, **key):
    """`protocol.Row`s as the front admits them to an engine (which pads them itself), ids 0, 1, ..."""
    from ds_inference_integration.serve.wire import Admit, BatchKey

    return Admit(group=1, key=BatchKey(num_beams=num_beams, num_return_sequences=k, **key),
                 rows=tuple(row.spec(i) for i, row in enumerate(rows)))
