"""The server's parts in this process: when a batch leaves the queue, what a request may ask, the per-row rules of
one batch (against generating each row alone, on the embedded GPT-2 and T5), streamed text against the final."""

import json
import time

import pytest
import torch
from serving import admit
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from conftest import EXAMPLES
from ds_inference_integration.serve.app import Texts
from ds_inference_integration.serve.batching import Job, Queue
from ds_inference_integration.serve.engine import run_batch
from ds_inference_integration.serve.protocol import Asked, BatchKey, ModelLimits, Row, ServeError, plan_rows

GPT2 = EXAMPLES / "models" / "gpt2-num2words-en-ro"
T5 = EXAMPLES / "models" / "t5-num2words-en-ro"
LIMITS = ModelLimits(encoder_decoder=False, max_positions=64, max_source_positions=None, max_n=4, max_batch_size=8,
                     default_max_tokens=16, vocab_size=72)


def _job(rows=1, width=4, new=8, key=BatchKey(), at=0.0):
    return Job(key=key, rows=[Row(prompt_ids=[1] * width, max_new_tokens=new) for _ in range(rows)], arrived=at)


def test_a_batch_leaves_full_or_after_max_wait_and_only_with_its_key():
    q = Queue(max_batch_size=4, max_batch_tokens=None, max_wait_ms=20, max_queue=10, adaptive_wait=False)
    a, b = _job(rows=2, at=0.0), _job(rows=1, at=0.001)
    beams = _job(rows=1, key=BatchKey(num_beams=4, max_new_tokens=8), at=0.002)
    for j in (a, beams, b):
        q.add(j)
    assert q.take(now=0.010) is None  # not full, the oldest has waited 10 ms of 20
    assert q.next_deadline() == pytest.approx(0.020)
    batch = q.take(now=0.021)
    assert batch.jobs == [a, b]  # the beam job waits for a batch of its own kind, in order
    assert q.take(now=0.021) is None and q.take(now=0.0225).jobs == [beams]  # its own 20 ms
    c, d, e = _job(rows=3, at=1.0), _job(rows=1, at=1.0), _job(rows=1, at=1.0)
    for j in (c, d, e):
        q.add(j)
    assert q.take(now=1.0).jobs == [c, d]  # full at 4 rows: leaves at once
    assert q.take(now=1.0) is None and len(q) == 1


def test_rows_that_join_running_ones_wait_for_company_only_at_an_idle_replica(tmp_path):
    """A replica whose rows join running ones (the step engine) takes what waits at once while it runs rows; idle, its
    first admission waits for company as the batch engine's does (up to max_wait_ms), so that clients that come back
    together start together. The batch engine's batches always wait."""
    from ds_inference_integration.serve.replicas import Replica

    q = Queue(max_batch_size=8, max_batch_tokens=None, max_wait_ms=20, max_queue=10, adaptive_wait=False)
    steps, batch = Replica(0, [], tmp_path), Replica(1, [], tmp_path)
    steps.state, steps.capacity, steps.joins_running = "ready", 8, True
    batch.state, batch.capacity = "ready", 8
    job = _job(at=0.0)
    q.add(job)
    assert batch.waits_for_company() and steps.waits_for_company()
    assert q.take(now=0.010, wait=steps.waits_for_company()) is None  # idle: waits, as the batch engine would
    steps.rows = {1: 12, 2: 12}  # rows running: what waits joins them at the next step
    assert not steps.waits_for_company() and q.take(now=0.010, wait=steps.waits_for_company()).jobs == [job]


def test_one_client_alone_never_waits():
    """Concurrency 1 (adaptive wait): one request open at a time, so it leaves as soon as it arrives."""
    q = Queue(max_batch_size=32, max_batch_tokens=None, max_wait_ms=20, max_queue=10)
    for t in (0.0, 0.5, 1.0):
        job = _job(at=t)
        q.add(job)
        assert q.take(now=t).jobs == [job]
        q.remove(job)  # answered


def test_clients_that_come_back_apart_are_waited_for_together():
    """16 clients split into two halves, 8 running while the other 8 wait: when the running batch ends, the next
    waits (up to max_wait_ms from then) for the 8 coming back instead of leaving with the 8 already there, whose
    wait counted from their arrival had run out: that kept 16 clients in batches of 8 and 8 for good (T5)."""
    q = Queue(max_batch_size=32, max_batch_tokens=None, max_wait_ms=20, max_queue=100)
    a = [_job(at=0.0) for _ in range(8)]
    for j in a:
        q.add(j)
    assert q.take(now=0.0).jobs == a
    b = [_job(at=0.05) for _ in range(8)]  # arrive while a runs: 16 open
    for j in b:
        q.add(j)
    for j in a:
        q.remove(j)  # a is answered; the replica is idle since 0.3
    assert q.take(now=0.3, idle_since=0.3) is None  # b's 8 are here (queued 250 ms), a's 8 are on their way back
    back = [_job(at=0.301) for _ in range(8)]
    for j in back:
        q.add(j)
    assert q.take(now=0.302, idle_since=0.3).jobs == b + back
    assert q.take(now=0.4) is None and not q.waiting


def test_the_padded_token_budget_closes_a_batch():
    q = Queue(max_batch_size=32, max_batch_tokens=100, max_wait_ms=1000, max_queue=10)
    short, long_ = _job(rows=2, width=10, new=10), _job(rows=1, width=40, new=10)
    q.add(short)
    q.add(long_)
    batch = q.take(now=0.0)  # 3 rows x (40 + 10) = 150 > 100: the long job does not fit, so the batch is full
    assert batch.jobs == [short] and q.waiting == [long_]


def test_rows_that_join_running_ones_are_taken_within_what_the_running_rows_leave_of_the_token_budget():
    """The step engine's rows run together: --max_batch_tokens bounds the tokens of every row a replica holds (each
    row's prompt and new tokens: `Job.tokens`), not only one admission's. The oldest job that does not fit keeps its
    place until rows end (no later job passes it); a job fits beside it when both do; an idle replica takes the
    oldest whatever its tokens (the request check let it in: a beam request's row counts once there and here)."""
    q = Queue(max_batch_size=8, max_batch_tokens=100, max_wait_ms=0, max_queue=10, adaptive_wait=False)
    a, b, c = _job(width=30, new=30), _job(width=30, new=30), _job(width=10, new=10)
    beams = _job(width=40, new=60, key=BatchKey(num_beams=4, max_new_tokens=60))
    assert (a.slot_tokens(), c.slot_tokens(), beams.slot_tokens()) == (60, 20, 100)
    for job in (b, c):
        q.add(job)
    assert q.take(now=1.0, wait=False, tokens_room=40) is None  # a's 60 held: b does not fit, and c waits behind it
    assert q.take(now=1.0, wait=False, tokens_room=100).jobs == [b, c]  # 80 of 100
    q.add(beams)
    assert q.take(now=1.0, wait=False, tokens_room=99) is None and q.take(now=1.0, wait=False, tokens_room=100)


def test_the_front_sends_a_step_replica_what_fits_its_token_budget_and_the_rest_when_rows_end(tmp_path):
    """The dispatcher, in process: a replica whose rows join running ones holds at most --max_batch_tokens tokens of
    rows (here 100: a job of 60 runs, the next of 60 waits with a job of 20 behind it); when the running row ends,
    both go at once (80)."""
    import asyncio
    from types import SimpleNamespace

    from ds_inference_integration.serve.replicas import Replica
    from ds_inference_integration.serve.server import Server

    sent = []

    async def run():
        q = Queue(max_batch_size=8, max_batch_tokens=100, max_wait_ms=0, max_queue=10, adaptive_wait=False)
        replica = Replica(0, [], tmp_path)
        replica.state, replica.capacity, replica.joins_running = "ready", 8, True
        replica.conn = SimpleNamespace(send=sent.append)
        server = Server(None, q, None, 60.0, 60.0, False)
        server.loop, server.wakeup, server.state = asyncio.get_running_loop(), asyncio.Event(), "ready"
        server.replicas = SimpleNamespace(replicas=[replica])
        task = asyncio.create_task(server._dispatch())
        a, b, c = _job(width=30, new=30), _job(width=30, new=30), _job(width=10, new=10)
        for job in (a, b, c):
            q.add(job)
            server.wakeup.set()
            await asyncio.sleep(0.05)
        assert [len(m.rows) for m in sent] == [1] and replica.tokens_room(100) == 40
        server._answered(replica, a.row_ids[0])  # a's row ends: 100 free
        await asyncio.sleep(0.05)
        assert [len(m.rows) for m in sent] == [1, 2] and replica.tokens_room(100) == 20
        assert replica.tokens_room(None) is None
        task.cancel()

    asyncio.run(run())


def test_a_request_is_checked_against_the_model_and_the_limits():
    def plan(limits=LIMITS, **kw):
        return plan_rows([[5, 6, 7]], Asked(**{"max_tokens": 8, **kw}), limits)

    for kw, word in (({"max_tokens": 62}, "positions"), ({"n": 5}, "--max_n"), ({"num_beams": 2, "stream": True}, "stream"),
                     ({"num_beams": 2, "n": 3}, "beam"), ({"min_tokens": 9}, "min_tokens"), ({"stop": [""]}, "empty"),
                     ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"),
                     ({"num_beams": 2, "temperature": 0.7}, "sampling")):
        with pytest.raises(ServeError) as e:
            plan(**kw)
        assert e.value.status == 400 and word in e.value.message and "\n" not in e.value.message, (kw, e.value.message)
    key, rows = plan(n=3, temperature=0.8, seed=7)
    assert key == BatchKey() and [r.seed for r in rows] == [7, 8, 9] and {r.temperature for r in rows} == {0.8}
    key, rows = plan(num_beams=4, n=2)
    assert key.num_beams == 4 and key.num_return_sequences == 2 and key.max_new_tokens == 8 and len(rows) == 1
    assert plan()[1][0].temperature == 0.0  # the model's generation config is greedy


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_each_row_generates_as_it_would_alone(name):
    """Rows with their own lengths, greedy and seeded sampling side by side in one batch: each row's tokens equal
    the same row generated alone; greedy rows equal plain `generate`; a row ends at its own max_new_tokens."""
    path, cls = (GPT2, AutoModelForCausalLM) if name == "gpt2" else (T5, AutoModelForSeq2SeqLM)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = cls.from_pretrained(path).eval()
    prompts = (EXAMPLES / "data" / "prompts.txt").read_text().splitlines()[:4]
    if name == "t5":
        prompts = ["translate English to Romanian: " + p.rstrip(" =") for p in prompts]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    rows = [Row(prompt_ids=ids[0], max_new_tokens=20), Row(prompt_ids=ids[1], max_new_tokens=3),
            Row(prompt_ids=ids[2], max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=20, seed=5),
            Row(prompt_ids=ids[3], max_new_tokens=20, temperature=1.3, seed=6)]
    together = run_batch(model, tokenizer, admit(rows), "cpu")
    for i, row in enumerate(rows):
        alone = run_batch(model, tokenizer, admit([row]), "cpu")
        assert together["sequences"][i] == alone["sequences"][0], i
    assert len(together["sequences"][1][0]) == 3 and together["finish"][1] == ["length"]
    with torch.no_grad():  # greedy rows: what generate gives for the prompt alone
        plain = model.generate(torch.tensor([ids[0]]), max_new_tokens=20, do_sample=False)
    start = 1 if name == "t5" else len(ids[0])
    want = [t for t in plain[0, start:].tolist()]
    eos = model.generation_config.eos_token_id
    assert together["sequences"][0][0] == want[:want.index(eos) + 1] if eos in want else want


def test_ignore_eos_and_min_tokens_hold_per_row():
    """ignore_eos: a row goes on past EOS to its max_new_tokens (generate's own EOS rule, which it refills from the
    model's generation config, ended it at EOS: 20 tokens of 24); min_tokens: no EOS before it; the row beside
    them ends at EOS as usual."""
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(GPT2).eval()
    ids = tokenizer("five =")["input_ids"]
    eos = model.generation_config.eos_token_id
    rows = [Row(prompt_ids=ids, max_new_tokens=24, ignore_eos=True), Row(prompt_ids=ids, max_new_tokens=24),
            Row(prompt_ids=ids, max_new_tokens=24, min_tokens=22)]
    out = run_batch(model, tokenizer, admit(rows), "cpu")
    plain, ignored, least = (out["sequences"][i][0] for i in (1, 0, 2))
    assert plain[-1] == eos and out["finish"][1] == ["stop"] and len(plain) < 24
    assert len(ignored) == 24 and ignored[:len(plain)] == plain and out["finish"][0] == ["length"]
    alone = run_batch(model, tokenizer, admit(rows[:1]), "cpu")  # no other row keeps it going
    assert alone["sequences"][0][0] == ignored and alone["finish"][0] == ["length"]
    assert eos not in least[:21] and len(least) >= 22
    assert model.generation_config.eos_token_id == eos  # given back


def test_stop_token_ids_end_their_row_and_wait_for_min_tokens():
    """vLLM's `stop_token_ids` (clients send a chat model's end-of-turn id; it was accepted and ignored: the row ran
    to max_tokens): a row ends at the first of its ids, which stays in its tokens, with finish "stop", and not
    before its min_tokens; the row beside it, without them, runs on; the ids are checked against the vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(GPT2).eval()
    ids = tokenizer("five =")["input_ids"]
    free = run_batch(model, tokenizer, admit([Row(prompt_ids=ids, max_new_tokens=12)]), "cpu")
    seq = free["sequences"][0][0]
    stop = seq[3]  # a token the row makes at its 4th step
    first = seq.index(stop)
    rows = [Row(prompt_ids=ids, max_new_tokens=12, stop_token_ids=(stop,)), Row(prompt_ids=ids, max_new_tokens=12),
            Row(prompt_ids=ids, max_new_tokens=12, stop_token_ids=(stop,), min_tokens=first + 2)]
    out = run_batch(model, tokenizer, admit(rows), "cpu")
    stopped, beside, held = (out["sequences"][i][0] for i in range(3))
    assert stopped == seq[:first + 1] and out["finish"][0] == ["stop"]
    assert beside == seq
    assert stop not in held[:first + 1] and len(held) > first + 1
    _, planned = plan_rows([ids], Asked(max_tokens=5, stop_token_ids=[stop]), LIMITS)
    assert planned[0].stop_token_ids == (stop,) and planned[0].spec(0).stop_token_ids == (stop,)
    for bad, says in (([LIMITS.vocab_size], "not in the vocabulary"), (["7"], "list of token ids"), ([-1], "vocabulary")):
        with pytest.raises(ServeError, match=says):
            plan_rows([ids], Asked(max_tokens=5, stop_token_ids=bad), LIMITS)


def test_streamed_text_never_passes_a_stop_string_and_adds_up_to_the_final_text():
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokens = tokenizer("cinci sute de mii patru sute")["input_ids"]
    texts = Texts(tokenizer, (" de mii",))
    sent = "".join(texts.delta(tokens[:i]) for i in range(1, len(tokens) + 1))
    final, stopped = Texts(tokenizer, (" de mii",)).final(tokens)
    assert stopped and final == "cinci sute" and final.startswith(sent) and " de" not in sent
    assert sent + texts.rest(tokens) == final


def test_a_stop_string_kept_in_the_output_and_special_tokens_kept_in_the_text():
    """vLLM's `include_stop_str_in_output`: the text ends after the first stop string, streamed or whole (the stream
    never passes it); `skip_special_tokens` false: EOS's own text stays in the completion (it is dropped by default);
    each, given another type, is one 400 line."""
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokens = tokenizer("cinci sute de mii patru sute")["input_ids"]
    texts = Texts(tokenizer, (" de mii", "patru"), keep_stop=True)
    sent = "".join(texts.delta(tokens[:i]) for i in range(1, len(tokens) + 1))
    final, stopped = Texts(tokenizer, (" de mii", "patru"), keep_stop=True).final(tokens)
    assert stopped and final == "cinci sute de mii" and final.startswith(sent) and "patru" not in sent
    assert sent + texts.rest(tokens) == final
    with_eos = tokens[:2] + [tokenizer.eos_token_id]
    assert Texts(tokenizer, ()).final(with_eos) == ("cinci sute", False)
    assert Texts(tokenizer, (), skip_special=False).final(with_eos) == ("cinci sute </s>", False)
    args = dict(max_tokens=5, n=2)
    _, rows = plan_rows([tokens], Asked(**args, skip_special_tokens=False, include_stop_str_in_output=True), LIMITS)
    assert [(r.skip_special_tokens, r.include_stop_str_in_output) for r in rows] == [(False, True)] * 2
    _, rows = plan_rows([tokens], Asked(**args), LIMITS)
    assert [(r.skip_special_tokens, r.include_stop_str_in_output) for r in rows] == [(True, False)] * 2
    for name in ("skip_special_tokens", "include_stop_str_in_output"):
        with pytest.raises(ServeError, match=rf"^{name} 'yes' is not a boolean; valid: true or false$"):
            plan_rows([tokens], Asked(**args, **{name: "yes"}), LIMITS)


@pytest.mark.parametrize("args, says", [
    ([], "serve needs a model directory first"),
    (["/nonexistent", "--tp_size", "2"], "has no config.json"),
    ([str(GPT2), "--tp_size", "3"], "not divisible by --tp_size 3"),
    ([str(GPT2), "--max_batch_size", "0"], "--max_batch_size 0 is out of range"),
    ([str(GPT2), "--host", "example.com"], "is not an IP address"),
    ([str(GPT2), "--tp_size", "2", "--nnodes", "2"], "needs --master_port"),
    ([str(GPT2), "--tp_size", "2", "--nnodes", "2", "--master_port", "1", "--worker"], "node 0 runs the front"),
    ([str(GPT2), "--tp_size", "3", "--nnodes", "2", "--master_port", "1", "--node_rank", "1", "--worker"],
     "does not split over --nnodes 2"),
    ([str(GPT2), "--inference_dtype", "fp8"], "--inference_dtype"),
])
def test_bad_serve_flags_are_one_line_before_anything_starts(args, says, capsys):
    from ds_inference_integration.tools.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_bench_serve_counts_a_request_past_its_points_deadline_as_unanswered():
    """A request still open at its point's deadline (a server that accepts and never answers here) is a request
    not answered, not the bench's end: it ended a whole `bench serve` run with a socket TimeoutError."""
    import socket

    from ds_inference_integration.tools.bench_serve import _one

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        start = time.monotonic()
        got = _one(listener.getsockname()[1], {"prompt": "a", "stream": True}, timeout=0.5)
        assert time.monotonic() - start < 5
    assert got["ok"] is False and "TimeoutError" in got["status"], got


def test_bench_serve_times_first_tokens_of_streams_and_beam_requests_apart():
    """A point with beam requests (not streamed: their first token comes with the whole answer): the time to first
    token is the streamed requests', the beam requests' latency a figure of its own (counted as a first token, a beam
    request's latency made p99 TTFT the beams')."""
    import http.server
    import threading

    from ds_inference_integration.tools.bench_serve import _point

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            if body.get("stream"):  # a first token at once, the rest 50 ms later
                self.wfile.write(b'data: {"choices": [{"text": " a"}]}\n\n')
                self.wfile.flush()
                time.sleep(0.05)
                self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
            else:  # a beam request: its whole answer after 400 ms
                time.sleep(0.4)
                self.wfile.write(json.dumps({"usage": {"completion_tokens": 2}}).encode())

    class Server:
        def __init__(self, port):
            self.port = port

        def steps(self):
            return 0.0, 0.0

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        got = _point(Server(httpd.server_address[1]), ["a"], 4, 16, (2, 2), 30.0, beam_fraction=0.5)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert got["requests_ok"] == 16
    assert got["ttft_p99"] < 0.2 and got["beam_latency_p50"] >= 0.4, got


def test_the_fronts_connections_send_each_chunk_at_once():
    """Every connection the front accepts has TCP_NODELAY (asyncio sets it only where the listening socket says
    IPPROTO_TCP): without it, on a kept-alive connection a stream's first chunk waited for the client's delayed ACK
    of the headers (48 ms against 5.9 on a fresh connection for a 4-token completion)."""
    import asyncio
    import socket

    from ds_inference_integration.serve.app import listening_socket

    async def accept_one():
        sock = listening_socket("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                own = transport.get_extra_info("socket")
                seen.set_result(own.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Protocol, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accept_one()) == 1


@pytest.mark.parametrize("cores, dp, tp, nnodes, want", [(2, 1, 1, 1, 1), (2, 1, 2, 1, 1), (16, 1, 2, 1, 7),
                                                         (16, 2, 2, 1, 3), (16, 1, 4, 2, 7), (1, 1, 1, 1, 1)])
def test_a_servers_ranks_share_the_cores_of_every_replica_and_leave_one_to_the_front(monkeypatch, tmp_path, cores, dp,
                                                                                       tp, nnodes, want):
    """Each rank's OMP_NUM_THREADS default counts every replica's ranks on the machine, and one core for the front
    where there is one to spare: the ranks of dp 2 x tp 2 on 16 cores each had 8 threads (32 on 16 cores), and a
    tp-1 rank on 2 cores took the front's core (the embedded T5 served 2417 tok/s at 2 threads, 2767 at 1)."""
    import os

    from ds_inference_integration.serve import replicas

    started = []
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(replicas, "start_ranks", lambda n, *args, **kwargs: started.append((n, kwargs["threads"])) or [])
    monkeypatch.setattr(replicas.threading, "Thread", lambda **kwargs: type("T", (), {"start": lambda self: None})())
    pool = replicas.Replicas({}, tp, dp, tmp_path, None, None, nodes=(nnodes, "127.0.0.1", 29500))
    try:
        pool.start()
    finally:
        pool.listener.close()
    assert started == [(tp // nnodes, want)] * dp


def test_a_closed_terminals_sighup_drains_the_front_as_sigterm_and_ctrl_c_do():
    """In process, the front's part of test_serve_failures.py's test_a_closed_terminal_drains_the_server_as_sigterm_does
    (make test-all's: a server of its own cost 13 CPU-s of a suite over its 10 minutes, 2026-12-06): while the server
    runs, SIGHUP (which uvicorn does not handle: it ended the front where it stood) is the handler SIGTERM and SIGINT
    get, a first one drains and a second one ends the server at once (exit 128 + 1); afterwards the previous handlers
    are back. (The ranks ignore a group's SIGHUP with its SIGINT, `engine.main`: test_serve.py's
    `_long_rows_leaving_clients_warnings_and_ctrl_c` sends the group Ctrl-C.)"""
    import signal

    import uvicorn

    from ds_inference_integration.serve.asgi import Uvicorn

    class Loop:
        def call_soon_threadsafe(self, f, *args):
            f(*args)

    class Front:
        loop, state, calls = Loop(), "serving", []

        def drain(self, name):
            self.calls.append(("drain", name))
            self.state = "draining"

        def interrupt(self, name, code):
            self.calls.append(("interrupt", name, code))

    server = Uvicorn(uvicorn.Config(app=None))
    server.server = front = Front()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    with server.capture_signals():
        handlers = {sig: signal.getsignal(sig) for sig in before}
        assert len(set(handlers.values())) == 1 and handlers[signal.SIGHUP] == server.handle_exit
        handlers[signal.SIGHUP](signal.SIGHUP, None)
        handlers[signal.SIGHUP](signal.SIGHUP, None)
    assert front.calls == [("drain", "SIGHUP"), ("interrupt", "SIGHUP", 128 + signal.SIGHUP)]
    assert {sig: signal.getsignal(sig) for sig in before} == before and not server.should_exit


@pytest.mark.launched  # a `sleep` in a session of its own, standing for a server the bench started
def test_a_sigterm_to_bench_serve_ends_the_servers_it_holds(tmp_path):
    """In process, the bench's part of test_serve.py's test_a_sigterm_to_bench_serve_ends_its_servers (make
    test-all's: the bench and a server of its own cost 15 CPU-s, 2026-12-06): after `_end_on_sigterm`, SIGTERM ends
    every server the bench holds (each in a session of its own, which a signal to the bench's does not reach), then
    the bench, 143."""
    import os
    import signal
    import subprocess

    from ds_inference_integration.tools import bench_serve

    server = bench_serve._Server.__new__(bench_serve._Server)
    server.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    server.log = open(tmp_path / "front.log", "w")
    before = signal.getsignal(signal.SIGTERM)
    bench_serve._Server.live.append(server)
    try:
        bench_serve._end_on_sigterm()
        with pytest.raises(SystemExit) as ended:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert ended.value.code == 143 and server.proc.poll() is not None and not bench_serve._Server.live
        with pytest.raises(ProcessLookupError):
            os.killpg(server.proc.pid, 0)  # its session's group is gone
    finally:
        signal.signal(signal.SIGTERM, before)
        if server.proc.poll() is None:
            server.proc.kill()
        bench_serve._Server.live[:] = [s for s in bench_serve._Server.live if s is not server]


@pytest.mark.parametrize("ending", ["sigterm", "failed point"])
def test_bench_serve_leaves_no_model_copy_behind(tmp_path, monkeypatch, ending):
    """`bench serve` builds gpt2-256 into its scratch folder, beside its servers' logs. Stopped (a SIGTERM's
    SystemExit, as `_end_on_sigterm` raises it), the folder goes; after a failed point its logs stay, named in the
    error, and the model copy goes (both were left in /tmp before)."""
    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.tools import bench_serve

    scratch = tmp_path / "bench-serve-x"
    monkeypatch.setattr(bench_serve.tempfile, "mkdtemp", lambda prefix: (scratch.mkdir(), str(scratch))[1])

    class Stopped:
        def __init__(self, model_dir, args, log_dir, tp_size):
            assert (model_dir / "config.json").is_file()  # the model copy was built
            (log_dir / "front-1.log").write_text("a server's log\n")
            if ending == "sigterm":
                raise SystemExit(143)
            raise InferenceSetupError("bench serve: no request succeeded at concurrency 16: ...")

    monkeypatch.setattr(bench_serve, "_Server", Stopped)
    args = (["gpt2-256"], [16], 8, 1, 1, 20.0, 30.0, tmp_path / "out")
    if ending == "sigterm":
        with pytest.raises(SystemExit):
            bench_serve.run_bench(*args)
        assert not scratch.exists()
    else:
        with pytest.raises(InferenceSetupError, match=f"the servers' logs: {scratch}"):
            bench_serve.run_bench(*args)
        assert sorted(p.name for p in scratch.iterdir()) == ["front-1.log"]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_a_starter_reads_the_bound_port_back_from_the_fronts_first_line(host):
    """`--port 0` then the port from the front's first line: no port chosen by the starter that another process
    could take before the server binds it."""
    from ds_inference_integration.serve.settings import announced_port, announced_url

    line = f"ds-inference serve: m at tp 2 x dp 1 on {announced_url(host, 50417)}, prompts up to 64 tokens (loading)\n"
    assert announced_port("a first line\n" + line) == 50417
    assert announced_port("ds-inference serve: m at tp 2 x dp 1 (loading)") is None
