"""The layers around the routes, as plain ASGI, and the server's signals: requests counted by route and status for
/metrics, every body read and limited before a route sees it (413 past --max_body_bytes) and the memory of a big
one given back, uvicorn with SIGTERM, SIGINT and SIGHUP meaning drain."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from ..extras import optional_import
from .protocol import ServeError
from .server import Server

responses = optional_import("fastapi.responses", "ds-inference serve")
uvicorn = optional_import("uvicorn", "ds-inference serve")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/health", "/live", "/metrics")


def error_response(error: ServeError):
    headers = {}
    if error.retry is False:
        headers["x-should-retry"] = "false"
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return responses.JSONResponse(error.body(), status_code=error.status, headers=headers)


class CountStatuses:
    """Requests by route and status for /metrics, as plain ASGI: Starlette's BaseHTTPMiddleware (`@app.middleware`)
    wraps the request's receive channel, and `request.is_disconnected()` then never saw a client that went away
    (its request stayed queued and was generated; tests/test_serve.py)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"]  # an unknown path is "other": a label per path a client makes up would grow forever
            self.metrics.request(path if path in ROUTES else "other", status[0])


class LimitBodies:
    """The body of every request, read to its end before the route runs and refused with 413 past `limit` bytes: at
    once when its Content-Length says so, else as soon as that many have arrived (a 10 MB prompt was read, parsed
    and tokenized whole, holding the event loop for 11 s). Plain ASGI, for the reason `CountStatuses` gives; the
    route then reads the body from here, and later calls of `receive` (a disconnect) go to the client's. After a big
    body the C allocator is asked to return what it freed (`_release_memory`)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, send, int(length))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was sent: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._too_large(scope, send, None)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        del chunks

        async def replay():
            return body.pop() if body else await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size > RELEASE_BYTES:
                await asyncio.get_running_loop().run_in_executor(None, _release_memory)

    async def _too_large(self, scope, send, length: int | None) -> None:
        sent = f"{length} bytes" if length is not None else f"more than {self.limit} bytes"
        error = ServeError(413, f"the body is {sent}; valid: at most {self.limit} bytes (--max_body_bytes)")
        response = error_response(error)
        response.headers["connection"] = "close"  # what is left of the body is not read
        await response(scope, None, send)


RELEASE_BYTES = 1024 * 1024


def _release_memory() -> None:
    """After a big body: the cycles it left (an error's traceback holds the frames that held the body, and asyncio's
    futures hold the error) collected, and what the C allocator kept returned. Without it the front stayed at 363 MB
    after a 4 MB body of a million lists (274 MB idle); with it, 289. Cheap: the objects of the front's start are
    frozen out of the collector's walks (`Server.start`). glibc keeps freed memory for reuse (the worker thread's own
    arena above all): malloc_trim returns it; elsewhere (not glibc) that step does nothing."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


# signals whose default action ends a process and that mean nothing to a server (SLURM sends SIGUSR1/2 ahead of a
# job's end; a stray alarm): ignored by the front (said once each) and by the ranks (`engine.main`)
IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
_said: set = set()


def _say_ignored(sig, frame) -> None:
    if sig not in _said:
        _said.add(sig)
        print(f"ds-inference serve: {signal.Signals(sig).name} ignored; SIGTERM, SIGINT or SIGHUP stops the server",
              flush=True)


class Uvicorn(uvicorn.Server):
    """uvicorn, with SIGTERM, SIGINT (Ctrl-C) and SIGHUP (its terminal closed) meaning drain (new requests 503, open
    ones finish, then exit 0) instead of closing at once; a second one ends the server now (open requests 503, exit
    128 + the signal). uvicorn itself closed at once on SIGINT: clients got a plain-text 500 or a cut stream, and the
    ranks, which Ctrl-C reaches too, printed their tracebacks; SIGHUP, which uvicorn does not handle, ended the front
    where it stood, leaving its temporary directory."""

    @contextlib.contextmanager
    def capture_signals(self):
        saved = {signal.SIGHUP: signal.signal(signal.SIGHUP, self.handle_exit)}
        for sig in IGNORED:  # Python's default for these ends the process where it stands: the server goes on
            saved[sig] = signal.signal(sig, _say_ignored)
        try:
            with super().capture_signals():
                yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    server: Server | None = None

    def handle_exit(self, sig, frame):
        if sig not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) or self.server is None:
            return super().handle_exit(sig, frame)
        name = signal.Signals(sig).name
        loop = self.server.loop
        if loop is None:  # before the event loop runs: nothing to drain
            self.should_exit = True
        elif self.server.state not in ("draining", "broken"):
            loop.call_soon_threadsafe(self.server.drain, name)
        else:
            loop.call_soon_threadsafe(self.server.interrupt, name, 128 + sig)
