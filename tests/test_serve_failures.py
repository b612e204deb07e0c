"""No request can take the server down: a model directory the server cannot serve ends it before ready in one
line (and, in make test-all, a closed terminal drains it as SIGTERM does). The requests that ended it, a failure
inside generate, a fuzz of bodies and big bodies while /live is probed are test_serve.py's, on its module's GPT-2
server; a row longer than --inference_timeout, a client leaving a long stream and Ctrl-C are its T5 server's. Servers
at tp 2 on 127.0.0.1, every server ended with its ranks."""

import os
import signal
import threading
import time

import pytest
from serving import ServerProc, post

from conftest import EXAMPLES

pytestmark = pytest.mark.launched

GPT2 = EXAMPLES / "models" / "gpt2-num2words-en-ro"


@pytest.mark.parametrize("broken", ["no_tokenizer", "malformed_config"])
def test_a_model_directory_the_server_cannot_serve_ends_before_ready_in_one_line(tmp_path, broken):
    """Without tokenizer files the server reported ready and answered every request with a misleading 400; a
    malformed config.json printed 40 lines of tracebacks. Both end before any rank starts: one error line, exit 2, no
    temporary directory left."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(GPT2, model)
    if broken == "no_tokenizer":
        for f in model.glob("tokenizer*"):
            f.unlink()
    else:
        (model / "config.json").write_text('{"model_type": "gpt2", "n_embd": ')
    server = ServerProc(model, ["--tp_size", "2"], tmp_path, 2, own_logs=True)
    try:
        assert server.proc.wait(60) == 2
        out = server.output()
        lines = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and ("has no tokenizer" if broken == "no_tokenizer" else "config.json cannot be read") \
            in lines[0], out[-3000:]
        assert "Traceback" not in out and "ready" not in out
        assert not list(server.tmp.iterdir())
    finally:
        server.stop()


# make test-all's: the front's SIGHUP is make test's in process (test_serve_units.py's
# test_a_closed_terminals_sighup_drains_the_front_as_sigterm_and_ctrl_c_do), a group's signal reaching the ranks is
# test_serve.py's T5 server's Ctrl-C (`_long_rows_leaving_clients_warnings_and_ctrl_c`), and a drain that answers
# the open request and leaves no process is test_serve.py's SIGTERM test (this server of its own cost 13 CPU-s,
# 2026-12-06)
@pytest.mark.slow
def test_a_closed_terminal_drains_the_server_as_sigterm_does(tmp_path):
    """SIGHUP to the process group (its terminal closed): uvicorn does not handle it, so the front ended where it
    stood (its temporary directory left behind) and the ranks died of it too. Now it drains: the open request is
    answered, the server exits 0, no process and no temporary directory left."""
    # the batch engine: --max_wait_ms holds the request in the queue (the step engine admits it at the next step)
    server = ServerProc(GPT2, ["--tp_size", "2", "--max_wait_ms", "1500", "--adaptive_wait", "false",
                               "--scheduler", "batch"], tmp_path, 2,
                        own_logs=True)
    try:
        server.wait_ready()
        answers: list = []
        thread = threading.Thread(target=lambda: answers.append(post(server.url + "/v1/completions",
                                                                     {"prompt": "five hundred", "max_tokens": 4})))
        thread.start()
        time.sleep(0.5)  # queued: its batch leaves after 1.5 s
        os.killpg(server.proc.pid, signal.SIGHUP)
        thread.join(60)
        assert answers and answers[0][0] == 200, answers
        assert server.proc.wait(30) == 0, server.output()[-3000:]
        assert "SIGHUP, draining 1 open request" in server.output()
        assert not server.group_alive() and not list(server.tmp.glob("ds-inference-serve-*"))
    finally:
        server.stop()
