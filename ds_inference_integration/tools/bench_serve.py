"""`ds-inference bench serve`: `ds-inference serve` (tp 2 by default, `--tp_size`) on this machine, a fixed request
set sent at each concurrency (streamed, as `vllm bench serve` sends it: `ignore_eos`, `stream_options.include_usage`),
to the same model served side by side: `continuous` (the step engine), `batched` (`--scheduler batch`: one generate
a batch) and `one_at_a_time` (the batch engine at `--max_batch_size 1`, as the handler this project grew from
served), and on request `continuous_grouped` (the step engine with TGI's admission rule at 0.5 / 8), for the
embedded GPT-2 and T5 and `gpt2-256` (the shape of the model #42 was measured on, built at start).

Per model, mode and concurrency, over repeats (min / median / max): requests/s, output tokens/s, p50 / p99
latency, p50 / p99 time to first token, and the mean rows per decoding step (from the server's /metrics). Every
load loop is bounded: `--requests` per point, and a point stops sending after `--point_timeout` seconds (a request
still open then counts as unanswered).
`--output_lengths A-B` draws each request's max_tokens from A to B (one seeded draw, the same for every mode), the
load where a batch's rows end at different steps; `--arrival_rate R` sends requests at Poisson arrival times (at
most `--concurrency` open), and `--beam_fraction F` makes that share of them beam requests (4 beams, not streamed:
their time to first token is their latency). TPOT (time per output token after the first) is given for streamed
requests. `--disconnects N` adds, per model and mode, the time to first token right after a client left a long
stream, against the idle server's (`_disconnects`), and the first token at concurrency 1 against the same prompts'
in one process (`_first_tokens`, `_one_process_first_token`: #42's bound, within 15 ms). A SIGTERM to the bench ends
its servers too.

    ds-inference bench serve [--models gpt2,t5,gpt2-256] [--concurrency 1,4,16,64] [--requests 64] [--repeats 3]
                             [--modes continuous,batched,one_at_a_time] [--output_lengths 4-48] [--tp_size 2]
                             [--arrival_rate R] [--beam_fraction F] [--disconnects N]
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import InferenceSetupError
from ..extras import optional_import
from ..run.files import write_text_atomic
from ..run.ranks import stop_session
from ..serve.settings import announced_port
from .bench import REPO, spread

MODELS = {"gpt2": ("gpt2-num2words-en-ro", 24), "t5": ("t5-num2words-en-ro", 24), "gpt2-256": (None, 64)}
MODES = {"continuous": ["--scheduler", "continuous"],
         # the step engine with waiting rows grouped before they join (TGI's rule, `serve/settings.py`), against
         # the default (each joins at the next step)
         "continuous_grouped": ["--scheduler", "continuous", "--waiting_served_ratio", "0.5", "--max_waiting_steps",
                                "8"],
         "batched": ["--scheduler", "batch"],
         "one_at_a_time": ["--scheduler", "batch", "--max_batch_size", "1"]}


def _gpt2_256(into: Path) -> Path:
    """`gpt2-256`: the shape of the model #42's figures were measured on (a random 2-layer GPT-2 of width 128), with
    256 positions (room for 32 prompt and 128 new tokens, where the embedded GPT-2 has 64), the embedded GPT-2's
    tokenizer and config otherwise, random weights (seed 0), built here (no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = REPO / "examples" / "models" / "gpt2-num2words-en-ro"
    config = AutoConfig.from_pretrained(source, n_layer=2, n_positions=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(into / "gpt2-256")
    AutoTokenizer.from_pretrained(source).save_pretrained(into / "gpt2-256")
    return into / "gpt2-256"


def _prompts(model: str) -> list[str]:
    if model == "gpt2-256":  # about 32 tokens each, as #42's figures' prompts: three of the prompts' lines joined
        lines = (REPO / "examples" / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
        return [" ".join(lines[i:i + 3]) for i in range(len(lines) - 2)]
    if model == "t5":
        lines = (REPO / "examples" / "data" / "num2words" / "test.json").read_text(encoding="utf-8").splitlines()
        return ["translate English to Romanian: " + json.loads(line)["translation"]["en"] for line in lines]
    return (REPO / "examples" / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()


class _Server:
    live: list["_Server"] = []  # the servers up now: a SIGTERM to the bench ends them (`_end_on_sigterm`)
    started = 0  # names each one's logs

    def __init__(self, model_dir: Path, args: list[str], log_dir: Path, tp_size: int):
        _Server.started += 1
        self.port = 0  # until the server binds one and says which (`announced_port`)
        self.log = open(log_dir / f"front-{_Server.started}.log", "w")
        # the ranks' threads as `serve` shares the cores out (`topology.serving_threads`: a core left to the front),
        # what a user gets, not this shell's OMP_NUM_THREADS
        env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ds_inference_integration.tools.cli", "serve",
                                      str(model_dir), "--tp_size", str(tp_size), "--port", "0",
                                      "--log_dir", str(log_dir / f"ranks-{_Server.started}"), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _Server.live.append(self)
        deadline = time.monotonic() + 300
        while not self.port or self._health() != 200:
            self.port = self.port or announced_port(Path(self.log.name).read_text(errors="replace")) or 0
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise InferenceSetupError(f"bench serve: the server did not come up; its log: {self.log.name}")
            time.sleep(0.3)

    def _health(self) -> int:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status
        except OSError:
            return 0

    def steps(self) -> tuple[float, float]:
        """Rows given a token and decoding steps so far (the server's /metrics)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return float(values["ds_inference_step_rows_sum"]), float(values["ds_inference_step_rows_count"])

    def stop(self) -> None:
        stop_session(self.proc, grace=60)
        self.log.close()
        if self in _Server.live:
            _Server.live.remove(self)


def _end_on_sigterm() -> None:
    """A SIGTERM to the bench ends its servers (each in a session of its own, which a signal to the bench's does not
    reach: they were left running), then the bench (exit 143). Its clients' requests then fail at once."""
    import signal

    def end(signum, frame):
        for server in list(_Server.live):
            server.stop()
        raise SystemExit(128 + signum)

    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, end)


def _one(port: int, body: dict, timeout: float) -> dict:
    """One streamed completion: latency, time to first token (the first chunk with text), output tokens (the
    usage chunk); a request with no whole answer within `timeout` (the point's time left) is one not answered, not
    the bench's end (a request still streaming at a point's deadline ended the whole run with a traceback)."""
    try:
        return _answer(port, body, timeout)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"ok": False, "status": f"no whole answer: {type(e).__name__}: {e}"[:200]}


def _answer(port: int, body: dict, timeout: float) -> dict:
    start = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return {"ok": False, "status": r.status}
    if not body.get("stream"):  # a beam request (beams do not stream): its first token comes with the rest
        usage = json.loads(r.read())["usage"]
        c.close()
        latency = time.perf_counter() - start
        return {"ok": True, "latency": latency, "ttft": None, "tokens": usage["completion_tokens"], "tpot": None,
                "streamed": False}
    first, tokens = None, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and first is None and chunk["choices"][0].get("text"):
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    c.close()
    latency = time.perf_counter() - start
    tpot = (latency - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"ok": True, "latency": latency, "ttft": first, "tokens": tokens, "tpot": tpot, "streamed": True}


LONG_TOKENS = {"gpt2": 36, "t5": 1000, "gpt2-256": 200}  # a disconnected stream's max_tokens: the model's room


def _short(server: _Server, prompt: str, timeout: float) -> dict:
    """An 8-token streamed greedy request (`_one`): the request the first-token figures time."""
    return _one(server.port, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True},
                timeout)


def _disconnects(server: _Server, prompts: list[str], n: int, long_tokens: int, timeout: float) -> dict:
    """#42's disconnect figure: the time to first token of a short request (8 tokens) on the idle server, n times,
    then n times right after a client left a long stream (`long_tokens`, `ignore_eos`) once its first token came;
    medians and the worst, and after / idle (the issue's bound: within 2x)."""
    import socket

    idle = [_short(server, prompts[i % len(prompts)], timeout) for i in range(n)]
    after = []
    for i in range(n):
        body = json.dumps({"prompt": prompts[(i + 1) % len(prompts)], "max_tokens": long_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            seen = b""
            while b"data: {" not in seen:  # the long row is running: its first token came
                chunk = sock.recv(4096)
                if not chunk:
                    break
                seen += chunk
        # the client has left (its socket closed) just now
        after.append(_short(server, prompts[i % len(prompts)], timeout))
    ok = [r["ttft"] for r in idle if r["ok"] and r["ttft"]], [r["ttft"] for r in after if r["ok"] and r["ttft"]]
    if not all(ok):
        raise InferenceSetupError(f"bench serve: the disconnect figures got no answer: {idle[:1]} {after[:1]}")
    idle_p50, after_p50 = _pct(ok[0], 0.5), _pct(ok[1], 0.5)
    return {"idle_ttft_p50": idle_p50, "after_disconnect_ttft_p50": after_p50,
            "after_disconnect_ttft_max": max(ok[1]), "after_over_idle": after_p50 / idle_p50, "trials": n}


def _first_tokens(server: _Server, prompts: list[str], n: int, timeout: float) -> float:
    """The median time to first token of an 8-token request from one client (n of them, after 2 not counted), on a
    server that has had no other load: measured before the points, since for PEAK_SECONDS after a burst of
    requests (`serve/batching.py`) a lone client's request waits up to --max_wait_ms for company, by design."""
    times = []
    for i in [0, 1, *range(n)]:
        answer = _short(server, prompts[i % len(prompts)], timeout)
        if not answer["ok"] or not answer["ttft"]:
            raise InferenceSetupError(f"bench serve: a first-token request got no answer: {answer}")
        times.append(answer["ttft"])
    return _pct(times[2:], 0.5)


def _one_process_first_token(model_dir: Path, prompts: list[str], n: int) -> float:
    """The median time to the first token of the prompts `_first_tokens` sends (n, after 2 not counted), generated
    alone in this process by the unsharded model as the examples run it (`generate`, greedy, one new token; torch's
    default threads), before any server of the model starts."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    kind = AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(model_dir).is_encoder_decoder else AutoModelForCausalLM
    model, tokenizer = kind.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's note that max_new_tokens wins over the config's max_length
    times = []
    try:
        for i in [0, 1, *range(n)]:
            inputs = tokenizer(prompts[i % len(prompts)], return_tensors="pt")
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False, num_beams=1)
            times.append(time.perf_counter() - start)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return _pct(times[2:], 0.5)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _point(server: _Server, prompts: list[str], concurrency: int, requests: int, lengths: tuple[int, int],
           point_timeout: float, arrival_rate: float | None = None, beam_fraction: float = 0.0) -> dict:
    """One point: `requests` requests, at most `concurrency` open at once; with `arrival_rate`, request i is sent at
    its Poisson arrival time (exponential gaps of mean 1 / rate, as `vllm bench serve --request-rate` sends them),
    else as soon as a client is free. A `beam_fraction` of them are beam requests (4 beams, not streamed)."""
    draw = random.Random(concurrency)  # the same lengths, arrivals and beams for every mode and repeat of a point
    bodies, at, t = [], [], 0.0
    for i in range(requests):
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": draw.randint(*lengths), "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if draw.random() < beam_fraction:
            body = {**body, "num_beams": 4, "stream": False}
            del body["stream_options"], body["ignore_eos"]
        bodies.append(body)
        t += draw.expovariate(arrival_rate) if arrival_rate else 0.0
        at.append(t)
    sums = server.steps()
    deadline = time.monotonic() + point_timeout
    start = time.perf_counter()

    def send(i):
        wait = at[i] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        if time.monotonic() > deadline:
            return {"ok": False, "status": "skipped: --point_timeout"}
        return _one(server.port, bodies[i], timeout=max(1.0, deadline - time.monotonic()))

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, range(requests)))
    wall = time.perf_counter() - start
    after = server.steps()
    ok = [r for r in results if r["ok"]]
    if not ok:
        raise InferenceSetupError(f"bench serve: no request succeeded at concurrency {concurrency}: {results[0]}")
    streamed = [r for r in ok if r["streamed"]] or ok
    return {"requests_ok": len(ok), "requests": requests, "req_per_s": len(ok) / wall,
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "latency_p50": _pct([r["latency"] for r in ok], 0.5), "latency_p99": _pct([r["latency"] for r in ok], 0.99),
            "tpot_p50": _pct([r["tpot"] for r in ok if r["tpot"] is not None] or [0.0], 0.5),
            "tpot_p99": _pct([r["tpot"] for r in ok if r["tpot"] is not None] or [0.0], 0.99),
            # time to first token of the streamed requests (a beam request's first token comes with its whole
            # answer: its latency, below; counted here it made p99 TTFT the beams' latency)
            "ttft_p50": _pct([r["ttft"] or r["latency"] for r in streamed], 0.5),
            "ttft_p99": _pct([r["ttft"] or r["latency"] for r in streamed], 0.99),
            "beam_latency_p50": _pct([r["latency"] for r in ok if not r["streamed"]] or [0.0], 0.5),
            "beam_latency_p99": _pct([r["latency"] for r in ok if not r["streamed"]] or [0.0], 0.99),
            "mean_step_rows": (after[0] - sums[0]) / max(1.0, after[1] - sums[1])}


METRICS = ("req_per_s", "output_tokens_per_s", "latency_p50", "latency_p99", "ttft_p50", "ttft_p99", "tpot_p50",
           "tpot_p99", "mean_step_rows", "beam_latency_p50", "beam_latency_p99")


def parse_lengths(text: str | None) -> tuple[int, int] | None:
    """`--output_lengths A-B` (or one number) as (A, B); None for the model's fixed length."""
    if not text:
        return None
    low, _, high = text.partition("-")
    try:
        lengths = (int(low), int(high or low))
    except ValueError:
        lengths = (0, 0)
    if not 1 <= lengths[0] <= lengths[1]:
        raise InferenceSetupError(f"--output_lengths {text!r} is invalid; valid: A-B with 1 <= A <= B (or one number)")
    return lengths


def run_bench(models: list[str], concurrencies: list[int], requests: int, repeats: int, tp_size: int,
              max_wait_ms: float, point_timeout: float, output_dir: Path, modes: list[str] | None = None,
              output_lengths: tuple[int, int] | None = None, arrival_rate: float | None = None,
              beam_fraction: float = 0.0, disconnects: int = 0) -> dict:
    for name in models:
        if name not in MODELS:
            raise InferenceSetupError(f"--models {name!r} is unknown; valid: {', '.join(MODELS)}")
    modes = modes or list(MODES)
    if arrival_rate is not None and not arrival_rate > 0:
        raise InferenceSetupError(f"--arrival_rate {arrival_rate} is out of range; valid: requests per second > 0")
    if not 0 <= beam_fraction <= 1:
        raise InferenceSetupError(f"--beam_fraction {beam_fraction} is out of range; valid: 0 to 1")
    for mode in modes:
        if mode not in MODES:
            raise InferenceSetupError(f"--modes {mode!r} is unknown; valid: {', '.join(MODES)}")
    optional_import("fastapi", "ds-inference bench serve")
    _end_on_sigterm()
    output_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    results: dict = {"command": "ds-inference bench serve " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else
                     "ds-inference bench serve", "date": time.strftime("%Y-%m-%d"), "tp_size": tp_size,
                     "max_wait_ms": max_wait_ms, "requests_per_point": requests, "cpus": os.cpu_count(),
                     "output_lengths": list(output_lengths) if output_lengths else None,
                     "arrival_rate": arrival_rate, "beam_fraction": beam_fraction, "points": [], "disconnects": []}
    try:
        _measure(results, models, modes, concurrencies, requests, repeats, tp_size, max_wait_ms, point_timeout,
                 output_lengths, arrival_rate, beam_fraction, disconnects, log_dir)
    except (SystemExit, KeyboardInterrupt):
        shutil.rmtree(log_dir, ignore_errors=True)  # stopped (SIGTERM, Ctrl-C): nothing there to look at
        raise
    except BaseException as e:  # a point failed: the servers' logs stay (named in the error), the model copy goes
        shutil.rmtree(log_dir / "gpt2-256", ignore_errors=True)
        if isinstance(e, InferenceSetupError) and str(log_dir) not in str(e):
            raise InferenceSetupError(f"{e} (the servers' logs: {log_dir})") from None
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    results["ratios"] = _ratios(results["points"])
    write_text_atomic(output_dir / "bench_serve.json", json.dumps(results, indent=1) + "\n")
    write_text_atomic(output_dir / "bench_serve.md", _table(results))
    _plot(results, output_dir / "bench_serve.png")
    return results


def _measure(results: dict, models, modes, concurrencies, requests, repeats, tp_size, max_wait_ms, point_timeout,
             output_lengths, arrival_rate, beam_fraction, disconnects, log_dir: Path) -> None:
    """Each model's points, into `results`: its servers (one a mode) up together, the points run, the servers
    stopped; the servers' logs and a built model (`gpt2-256`) under `log_dir`."""
    for name in models:
        directory, max_tokens = MODELS[name]
        lengths = output_lengths or (max_tokens, max_tokens)
        prompts = _prompts(name)
        model_dir = REPO / "examples" / "models" / directory if directory else _gpt2_256(log_dir)
        alone = _one_process_first_token(model_dir, prompts, disconnects) if disconnects else None
        # Both servers run at once and the modes alternate point by point (one idle server costs a keep-alive a
        # second), so that a drift of the machine over the run falls on both alike.
        servers, first = {}, {}
        try:
            for mode in modes:
                extra = MODES[mode]
                servers[mode] = _Server(model_dir,
                                        [*extra, "--max_wait_ms", str(max_wait_ms), "--max_queue",
                                         str(max(concurrencies) * 2)], log_dir, tp_size)
                if disconnects:  # before any burst (`_first_tokens`)
                    first[mode] = _first_tokens(servers[mode], prompts, disconnects, point_timeout)
                _point(servers[mode], prompts, 4, 8, lengths, point_timeout)  # warm-up, not counted
            for concurrency in concurrencies:
                runs = {mode: [] for mode in modes}
                for _ in range(repeats):
                    for mode in modes:
                        runs[mode].append(_point(servers[mode], prompts, concurrency, requests, lengths,
                                                 point_timeout, arrival_rate, beam_fraction))
                for mode in modes:
                    point = {"model": name, "mode": mode, "concurrency": concurrency,
                             **{m: spread([r[m] for r in runs[mode]]) for m in METRICS},
                             "requests_ok": min(r["requests_ok"] for r in runs[mode])}
                    results["points"].append(point)
                    print(f"{name:8} {mode:18} c={concurrency:<3} {point['req_per_s']['median']:8.1f} req/s  "
                          f"{point['output_tokens_per_s']['median']:7.0f} tok/s  p99 latency "
                          f"{point['latency_p99']['median'] * 1000:6.0f} ms  p99 TTFT "
                          f"{point['ttft_p99']['median'] * 1000:6.0f} ms  rows/step "
                          f"{point['mean_step_rows']['median']:.1f}", flush=True)
            for mode in modes if disconnects else ():
                found = _disconnects(servers[mode], prompts, disconnects, LONG_TOKENS[name], point_timeout)
                results["disconnects"].append({"model": name, "mode": mode, **found,
                                               "first_token_c1_p50": first[mode], "one_process_first_token_p50": alone,
                                               "c1_over_one_process_ms": (first[mode] - alone) * 1000})
                print(f"{name:8} {mode:18} TTFT after a disconnect {found['after_disconnect_ttft_p50'] * 1000:.0f} "
                      f"ms, idle {found['idle_ttft_p50'] * 1000:.0f} ms; concurrency 1 {first[mode] * 1000:.1f} ms, "
                      f"one process {alone * 1000:.1f} ms", flush=True)
        finally:
            for server in servers.values():
                server.stop()


def _ratios(points: list[dict]) -> list[dict]:
    """Per model and concurrency, medians against medians: batched / one at a time (req/s, p99 latency) and
    continuous (and continuous_grouped) / batched (output tokens/s, p99 time to first token), where both modes
    ran."""
    by = {(p["model"], p["mode"], p["concurrency"]): p for p in points}
    out = []
    for model, c in dict.fromkeys((p["model"], p["concurrency"]) for p in points):
        row = {"model": model, "concurrency": c}
        batched, single = (by.get((model, m, c)) for m in ("batched", "one_at_a_time"))
        if batched and single:
            row.update(req_per_s_ratio=batched["req_per_s"]["median"] / single["req_per_s"]["median"],
                       latency_p99_ratio=batched["latency_p99"]["median"] / single["latency_p99"]["median"],
                       latency_p50_ms_batched=batched["latency_p50"]["median"] * 1000,
                       latency_p50_ms_one_at_a_time=single["latency_p50"]["median"] * 1000)
        for name in ("continuous", "continuous_grouped"):
            steps = by.get((model, name, c))
            if steps and batched:
                row.update({f"{name}_tokens_per_s_ratio": (steps["output_tokens_per_s"]["median"]
                                                           / batched["output_tokens_per_s"]["median"]),
                            f"{name}_ttft_p99_ratio": steps["ttft_p99"]["median"] / batched["ttft_p99"]["median"]})
        if len(row) > 2:
            out.append(row)
    return out


def _table(results: dict) -> str:
    lengths = results.get("output_lengths")
    beams = bool(results.get("beam_fraction"))
    lines = [f"`{results['command']}` ({results['date']}, tp {results['tp_size']}, {results['cpus']} CPUs, "
             f"{results['requests_per_point']} requests per point"
             + (f", max_tokens drawn from {lengths[0]} to {lengths[1]}" if lengths else "")
             + (f", Poisson arrivals at {results['arrival_rate']:g} req/s" if results.get("arrival_rate") else "")
             + (f", {results['beam_fraction']:.0%} beam requests (4 beams)" if results.get("beam_fraction") else "")
             + ", medians of repeats with min-max; TTFT and TPOT of the streamed requests"
             + ("; beam requests' own latency in the last column" if beams else "") + ")", "",
             "| model | mode | concurrency | req/s | output tok/s | p50 latency ms | p99 latency ms | p50 TTFT ms | "
             "p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | rows per step |" + (" beam requests' p50 / p99 latency ms |"
                                                                          if beams else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if beams else "")]

    def f(s, scale=1.0, digits=1):
        return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"

    for p in results["points"]:
        lines.append(f"| {p['model']} | {p['mode']} | {p['concurrency']} | {f(p['req_per_s'])} | "
                     f"{f(p['output_tokens_per_s'], digits=0)} | {f(p['latency_p50'], 1000, 0)} | "
                     f"{f(p['latency_p99'], 1000, 0)} | {f(p['ttft_p50'], 1000, 0)} | {f(p['ttft_p99'], 1000, 0)} | "
                     f"{f(p['tpot_p50'], 1000)} | {f(p['tpot_p99'], 1000)} | {f(p['mean_step_rows'])} |"
                     + (f" {f(p['beam_latency_p50'], 1000, 0)} / {f(p['beam_latency_p99'], 1000, 0)} |" if beams else ""))
    lines += ["", "| model | concurrency | req/s batched / one at a time | p99 latency batched / one at a time | "
              "output tok/s continuous / batched | p99 TTFT continuous / batched | output tok/s continuous_grouped / "
              "batched | p99 TTFT continuous_grouped / batched |", "|---|---|---|---|---|---|---|---|"]

    def x(r, name):
        return f"{r[name]:.2f}x" if name in r else "-"

    for r in results["ratios"]:
        lines.append(f"| {r['model']} | {r['concurrency']} | {x(r, 'req_per_s_ratio')} | {x(r, 'latency_p99_ratio')} | "
                     f"{x(r, 'continuous_tokens_per_s_ratio')} | {x(r, 'continuous_ttft_p99_ratio')} | "
                     f"{x(r, 'continuous_grouped_tokens_per_s_ratio')} | {x(r, 'continuous_grouped_ttft_p99_ratio')} |")
    if results.get("disconnects"):
        lines += ["", "Time to first token of an 8-token request, idle and right after a client left a long stream "
                  f"({results['disconnects'][0]['trials']} of each, medians); at concurrency 1 on a server before any "
                  "other load, against the same prompts' first token in one process (the unsharded model's "
                  "`generate`):", "",
                  "| model | mode | idle ms | after a disconnect ms (worst) | after / idle | concurrency 1 ms | "
                  "one process ms | concurrency 1 - one process ms |", "|---|---|---|---|---|---|---|---|"]
        for d in results["disconnects"]:
            lines.append(f"| {d['model']} | {d['mode']} | {d['idle_ttft_p50'] * 1000:.1f} | "
                         f"{d['after_disconnect_ttft_p50'] * 1000:.0f} ({d['after_disconnect_ttft_max'] * 1000:.0f}) | "
                         f"{d['after_over_idle']:.2f}x | {d['first_token_c1_p50'] * 1000:.1f} | "
                         f"{d['one_process_first_token_p50'] * 1000:.1f} | {d['c1_over_one_process_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    optional_import("matplotlib", "ds-inference bench serve's plot").use("Agg")
    plt = optional_import("matplotlib.pyplot", "ds-inference bench serve's plot")
    models = sorted({p["model"] for p in results["points"]})
    fig, axes = plt.subplots(1, 2 * len(models), figsize=(6 * len(models), 3.6), squeeze=False)
    for m, model in enumerate(models):
        for k, (metric, label) in enumerate((("req_per_s", "requests/s"), ("latency_p99", "p99 latency (s)"))):
            ax = axes[0][2 * m + k]
            for mode in dict.fromkeys(p["mode"] for p in results["points"]):
                pts = [p for p in results["points"] if p["model"] == model and p["mode"] == mode]
                xs = [p["concurrency"] for p in pts]
                ax.errorbar(xs, [p[metric]["median"] for p in pts],
                            yerr=[[p[metric]["median"] - p[metric]["min"] for p in pts],
                                  [p[metric]["max"] - p[metric]["median"] for p in pts]], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{model}: {label}")
            ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
