"""Shared helpers: tiny models built from configs, and real launcher runs with hard timeouts."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# where transformers copies the code of a model that ships its own (tests/own_code): one directory per pytest process,
# removed at its end, not the user's ~/.cache/huggingface/modules; set before transformers is imported (it reads it
# then), and inherited by every process the tests start
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="ds-inference-tests-modules-")

import pytest

from ds_inference_integration.run.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
RUN_TRANSLATION = EXAMPLES / "run_translation.py"
DEFAULT_MODEL = EXAMPLES / "models" / "t5-num2words-en-ro"
DATA = EXAMPLES / "data" / "num2words"
BIN = Path(sys.executable).parent
# Every process the tests start finds this venv's tools first, ninja above all: DeepSpeed JIT-builds its CPU
# all-reduce with whichever `ninja` is on PATH, and two ninja versions (pip's 1.13 here, Debian's 1.11 in
# /usr/bin) hash the build commands differently, so alternating between them rebuilt the op (~55 s) each time.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # in-process runs too
# the record of data files that passed their checks (predict/data_files.py): one per pytest process, removed at its
# end, not the user's ~/.cache (the processes the tests start inherit it)
os.environ["DS_INFERENCE_CACHE"] = tempfile.mkdtemp(prefix="ds-inference-tests-cache-")
# Every process the tests start reads tests/interpreter/sitecustomize.py first (the collector runs a tenth as often:
# why, and what it saves, there); this process runs it too.
INTERPRETER = REPO / "tests" / "interpreter"
if str(INTERPRETER) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # xdist's workers inherit it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INTERPRETER), os.environ.get("PYTHONPATH")]))
runpy.run_path(str(INTERPRETER / "sitecustomize.py"))
# Ctrl-C as a terminal delivers it, whatever started pytest: a background job of a non-interactive shell starts with
# SIGINT ignored, which every process the tests start inherits (and Python then installs no KeyboardInterrupt
# handler). Started so, a fresh clone's `make test` failed the two tests that compare the ranks' SIGINT handlers, and
# took 9:54 in pytest against ~7:40 (2026-12-06).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The suite's share of the cores: xdist's N workers run side by side, so each worker, and every process a test of it
# starts, gets cpu_count // N cores (`make test`: 2 workers on 2 cores, one each). Left to their defaults, the
# workers' torch took both cores and so did a tp-1 process a test started: two OpenMP threads on a core that the
# other worker keeps busy spin at every barrier waiting for each other. test_serve_steps.py alone at -n 2 (in-process
# engines): 79 CPU-s in the workers at 2 threads, 10 at 1, 64 s against 41 s; in the whole suite the workers spent
# 373 CPU-s (2026-12-05, 71eda4f). The processes a test starts read OMP_NUM_THREADS from here (the ranks' own
# default shares the machine's cores among the ranks of one job, which knows nothing of the other worker's).
SUITE_CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
if os.environ.get("PYTEST_XDIST_WORKER") or "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(SUITE_CORES)
if "torch" in sys.modules:  # imported before the variable was set: it read the default
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def suite_threads(processes: int = 1) -> int:
    """Threads for each of `processes` CPU processes a test starts side by side: this worker's cores shared out."""
    return max(1, SUITE_CORES // max(1, processes))


# the reference runs every worker and module share (`reference_run`): made by the first pytest process (xdist's
# controller, whose environment its workers inherit), removed at its end
_OWN_REFERENCES = not os.environ.get("DS_INFERENCE_TEST_REFERENCES")
if _OWN_REFERENCES:
    os.environ["DS_INFERENCE_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="ds-inference-test-references-")


# Outputs a split computes against the unsharded ones: equal up to the order of their sums. A split sums the same
# products in another order (per rank, then across the ranks; a CPU's BLAS picks its own blocking too), which moves
# each output by a few rounding units of the largest values summed; a wrong split moves it by about the values
# themselves. So the tolerance is counted in the dtype's rounding unit (eps) times the magnitude compared (the
# largest |value| of the reference, or of the parts summed where those are larger), never a fixed number: the
# split moonshine MLP differed by 2.4e-4 on outputs of magnitude 429 (6e-7 relative, 5 eps) and failed a fixed
# atol 1e-5 on another 2-core machine of the same kind, deterministically, while passing here.
ROUNDING_ULPS = 64


def rounding_ratio(got, want, scale=None) -> float:
    """max|got - want| in units of the tolerance (ROUNDING_ULPS x eps x the magnitude); <= 1 is equal up to
    summation order. `scale`: further tensors whose magnitude the sums carried (a split's partial sums)."""
    import torch

    got, want = (torch.as_tensor(t) for t in (got, want))
    magnitude = max(float(t.detach().abs().max()) for t in (want, *(torch.as_tensor(s) for s in (scale or ()))))
    eps = torch.finfo(want.dtype if want.is_floating_point() else torch.float32).eps
    tolerance = ROUNDING_ULPS * eps * max(magnitude, torch.finfo(torch.float32).tiny)
    return float((got.detach().double() - want.detach().double()).abs().max()) / tolerance


def assert_close_up_to_rounding(got, want, scale=None, msg: str = "") -> None:
    ratio = rounding_ratio(got, want, scale)
    assert ratio <= 1.0, f"{msg}: max |diff| is {ratio:.1f} x the tolerance ({ROUNDING_ULPS} x eps x magnitude)"


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["DS_INFERENCE_CACHE"], ignore_errors=True)
    shutil.rmtree(os.environ["HF_MODULES_CACHE"], ignore_errors=True)
    if _OWN_REFERENCES:
        shutil.rmtree(os.environ["DS_INFERENCE_TEST_REFERENCES"], ignore_errors=True)
PREFIX = "translate English to Romanian: "
TRANSLATE_ARGS = [
    "--predict_with_generate", "--source_lang", "en", "--target_lang", "ro", "--source_prefix", PREFIX,
    "--report_to", "none",
]


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    output_dir: Path

    def results(self, prefix: str) -> dict:
        return json.loads((self.output_dir / f"{prefix}_results.json").read_text())

    def predictions(self) -> list[str]:
        return (self.output_dir / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()

    def error_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("error: ")]


FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py: the fault hooks, never in the package
WORKERS = Path(__file__).resolve().parent / "workers"  # scripts a test runs as a user would, with their own main


def run_example(args: list[str], output_dir: Path, nprocs: int | None = None, launcher: str = "torchrun",
                script: Path = RUN_TRANSLATION, timeout: float = 240, fault: str | None = None,
                env: dict | None = None, master_port: int | None = None) -> Run:
    """Run an example script single-process (nprocs None) or under a real launcher: torchrun unless the test is
    about the `deepspeed` launcher, which starts two Pythons that import DeepSpeed before the ranks (~5
    CPU-seconds a launch, against one that imports torch). Never hangs, and leaves no process behind (the whole
    process group is killed afterwards, stopped ranks included). `fault` sets DS_INFERENCE_FAULT with the
    tests' fault hooks on the path (tests/faults/sitecustomize.py)."""
    proc, cmd = start_example(args, output_dir, nprocs, launcher, script, fault, env, master_port)
    return finish_example(proc, cmd, output_dir, timeout)


def start_example(args: list[str], output_dir: Path, nprocs: int | None = None, launcher: str = "torchrun",
                  script: Path = RUN_TRANSLATION, fault: str | None = None, env: dict | None = None,
                  master_port: int | None = None, launcher_args: list[str] | None = None):
    """`run_example`'s process, started and not waited for: (Popen, command). Its own session and process group
    (the group id is its pid), so that `finish_example` can end everything it started."""
    script_args = [str(script), "--output_dir", str(output_dir), *args]
    port = str(master_port or free_port())
    if nprocs is None:
        cmd = [sys.executable, *script_args]
    elif launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", port, *script_args]
    elif launcher == "torchrun":
        # torchrun's own log directory: beside the output, under pytest's tmp (by default it leaves a
        # /tmp/torchelastic_* directory behind on every launch)
        logs = Path(output_dir).parent / f"{Path(output_dir).name}_torchrun_logs{'_' + port if launcher_args else ''}"
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nprocs), *(launcher_args or ["--master_port", port]),
               "--log-dir", str(logs), *script_args]
    else:
        raise ValueError(launcher)
    env = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),  # one JIT build per venv
           **os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": f"{BIN}:{os.environ.get('PATH', '')}", **(env or {})}
    if fault:
        env.update(DS_INFERENCE_FAULT=fault, PYTHONPATH=os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH")])))
    if nprocs:  # CPU ranks share the worker's cores, as torchrun would share a machine's (the deepspeed launcher does not)
        env["OMP_NUM_THREADS"] = str(suite_threads(nprocs))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.started = time.monotonic()
    return proc, cmd


def finish_example(proc, cmd, output_dir: Path, timeout: float) -> Run:
    """Wait for a `start_example` process (at most `timeout` s from its start), then end its process group."""
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - proc.started)))
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}")
    finally:
        _kill_group(proc.pid)
    return Run(proc.returncode, out, time.monotonic() - proc.started, output_dir)


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_EXAMPLES: dict = {}


def run_in_process(args: list[str], output_dir: Path, script: Path = RUN_TRANSLATION) -> Run:
    """A single-process reference run through the script's own main(), in this process: the same code path as
    `run_example` without a launcher, without paying ~10 s of imports per run. (Runs that must show how a
    process ends, its exit code and output, use `run_example`.)"""
    name = str(script)
    if name not in _EXAMPLES:
        _EXAMPLES[name] = load_example(script)
    from ds_inference_integration.run import output_dir as locks

    start = time.monotonic()
    try:
        _EXAMPLES[name].main(["--output_dir", str(output_dir), *args])
    finally:
        locks.release_all()  # the run's process ends here, and its hold on the output directory with it
    return Run(0, "", time.monotonic() - start, output_dir)


def reference_run(args: list[str], script: Path = RUN_TRANSLATION) -> Run:
    """`run_in_process` made once per pytest run for every worker and module that asks for the same script and
    arguments (`once_per_run`): the tests only read a reference run's files. Each module and each xdist worker
    made its own: the 203-example references twice (13.7 and 15.3 s), the 37-example one in two modules,
    run_generation.py's four in both workers (30 and 28 s; `--durations`, 2026-12-05)."""
    import hashlib

    key = hashlib.sha256(json.dumps([script.name, list(map(str, args))]).encode()).hexdigest()[:16]
    return Run(0, "", 0.0, once_per_run(f"{script.stem}-{key}", lambda out: run_in_process(args, out, script)))


def resumed_count(output: str) -> int:
    """K from a resumed run's own log line `resumed: K of N examples already done` (exactly one in `output`)."""
    import re

    found = re.findall(r"resumed: (\d+) of (\d+) examples already done", output)
    assert len(found) == 1, output[-3000:]
    return int(found[0][0])


def once_per_run(name: str, make) -> Path:
    """The directory `name` that `make(directory)` makes and fills once per pytest run, for every xdist worker and module
    that asks for it: the first to ask makes it under a lock, the others wait for it and read it. (A module-scoped
    fixture is made once per worker that runs one of its tests, and worksteal hands a module's tests to both.)
    Where `make` raises, nothing is marked made and the next to ask makes it again."""
    import fcntl

    root = Path(os.environ["DS_INFERENCE_TEST_REFERENCES"])
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also where `make` raised
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.write_text("made\n")
    return out


def load_example(name: str | Path):
    """An example script (by name, or any script by path) imported as a module (its `main(argv)` runs in this
    process)."""
    import importlib.util

    path = name if isinstance(name, Path) else EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sampling_config(model_dir: Path, out_dir: Path, **settings) -> Path:
    """A directory holding `model_dir`'s generation config with `settings` (default: sampling with top_k 0), for
    upstream's `--generation_config`: how the seq2seq examples sample, as upstream's do."""
    config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    config.update(settings or {"do_sample": True, "top_k": 0})
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(config))
    return Path(out_dir)


def assert_ok(run: Run) -> None:
    assert run.returncode == 0, run.output[-4000:]


def save_tiny_model(kind: str, path: Path, **overrides) -> Path:
    """A tiny random seq2seq model with the embedded word-level tokenizer, saved under `path`.

    Initialised with large weights so that greedy outputs depend on the input (the default init
    makes a random model repeat one token, and token equality would then prove little).
    """
    import torch
    from transformers import (
        AutoTokenizer,
        BartConfig,
        BartForConditionalGeneration,
        MarianConfig,
        MarianMTModel,
        MBartConfig,
        MBartForConditionalGeneration,
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    common = dict(vocab_size=len(tok), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if kind in ("t5", "mt5"):
        cfg = (T5Config if kind == "t5" else MT5Config)(**{**common, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                          "num_decoder_layers": 2, "num_heads": 4, "initializer_factor": 5.0, **overrides})
        model = (T5ForConditionalGeneration if kind == "t5" else MT5ForConditionalGeneration)(cfg)
    else:
        from transformers import LEDConfig, LEDForConditionalGeneration, PegasusConfig, PegasusForConditionalGeneration

        cls = {"bart": (BartConfig, BartForConditionalGeneration), "mbart": (MBartConfig, MBartForConditionalGeneration),
               "marian": (MarianConfig, MarianMTModel), "pegasus": (PegasusConfig, PegasusForConditionalGeneration),
               "led": (LEDConfig, LEDForConditionalGeneration)}[kind]
        cfg = cls[0](**{**common, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
                        "decoder_ffn_dim": 128, "max_position_embeddings": 64, "bos_token_id": 2,
                        "forced_eos_token_id": None, "init_std": 0.5, **overrides})
        model = cls[1](cfg)
    model.generation_config.max_length = 12
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "t5": save_tiny_model("t5", root / "t5"),
        "t5_3heads": save_tiny_model("t5", root / "t5_3heads", num_heads=3, d_kv=16),
        "bart": save_tiny_model("bart", root / "bart"),
    }


# `make test-fast` runs the tests that start no process (`-m "not launched"`). A test that starts one (a launcher
# run, a `ds-inference` command, a worker script, a wheel build), itself or through a fixture, says so with
# `@pytest.mark.launched` (or `pytestmark` for a whole file); `_processes_only_where_marked` below fails one that
# does not.


# The longest tests (seconds, `--durations` of a warm run with two workers, 2026-12-06) start first, then the other
# launched ones, then the in-process ones: the two workers (`make test`, --dist worksteal) then finish together
# instead of one running a 50 s test alone at the end. A test that uses a module's server is not listed: sorted
# away from the module's other tests, it went to the other worker, which started a second server for it. The tp-2
# policy check, which three more tests read (`once_per_run`), goes first of all: started 219 s into a run, it kept
# a reader on the other worker waiting 25 s with nothing to do (2026-12-06).
LONGEST = {"test_a_killed_rank_sigterm_ctrl_c_and_a_killed_job_each_end_a_run_and_the_same_command_resumes": 80,
           "test_two_nodes_give_the_one_process_file_whatever_the_disks_and_resume_after_a_kill[own_disks]": 55,
           "test_translation_sources_come_back_as_run_translation_predicts_them_then_long_rows_and_ctrl_c": 65,
           "test_a_continuous_server_answers_as_one_process_and_never_makes_a_short_row_wait": 43,
           "test_smoke_decode": 20,
           "test_every_architecture_matches_the_unsharded_model[2]": 1000,
           "test_every_architecture_matches_the_unsharded_model[4-subset]": 34,
           "test_a_causal_lms_eval_loss_and_logits_at_dp_2_and_tp_2_are_one_process_s": 30,
           "test_proposal_command_eval_and_beam_search_predict_equal_single_process": 26,
           "test_a_full_queue_gets_429_and_sigterm_drains_an_idle_replica_past_the_timeout_chat_and_api_key": 30,
           "test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it": 22,
           "test_tp_and_dp_groups_get_the_inference_timeout": 21,
           "test_wheel_in_a_fresh_venv_lists_policies_and_predicts_at_tp2": 20,
           "test_a_split_wrong_only_in_half_precision_fails_naming_the_layer": 19,
           "test_a_replica_spanning_two_nodes_serves_as_one_process_and_a_lost_worker_ends_it": 19,
           "test_speech_recognition_at_tp2_and_dp2_x_tp2_equals_one_process": 19,
           "test_a_stopped_rank_gets_open_requests_503_within_the_timeout": 18,
           "test_a_policy_that_does_not_work_is_refused_before_generating": 16,
           "test_bad_setup_fails_fast_on_every_rank": 15,
           "test_a_wrong_derived_policy_is_refused_before_ready": 12}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: (item.get_closest_marker("launched") is None,
                                 -LONGEST.get(item.name, LONGEST.get(item.originalname, 0))))


_MODULE_SECONDS: dict = {}
_MODULE_CPU: dict = {}
_TEST_CPU: dict = {}
_CPU_MARK = [None]


def _cpu_seconds() -> float:
    """This process's CPU time and that of the processes it waited for (launchers wait for their ranks, so a launched
    run's ranks count once it ends): a 2-core machine's suite is CPU-bound, so CPU is what a test costs the others."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's CPU seconds (since the last report of this process) ride on its report to xdist's controller."""
    report = (yield).get_result()
    now = _cpu_seconds()
    spent, _CPU_MARK[0] = (now - _CPU_MARK[0] if _CPU_MARK[0] is not None else 0.0), now
    report.user_properties = [*report.user_properties, ("cpu_seconds", round(spent, 2))]


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, summed per module (on xdist's controller too: its workers' reports)."""
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    cpu = dict(report.user_properties).get("cpu_seconds", 0.0)
    _MODULE_CPU[module] = _MODULE_CPU.get(module, 0.0) + cpu
    _TEST_CPU[report.nodeid] = _TEST_CPU.get(report.nodeid, 0.0) + cpu


def pytest_terminal_summary(terminalreporter):
    """What each module cost (seconds of its tests summed over the workers, and CPU seconds of the tests and of the
    processes they started), the costliest first, then the costliest tests: where a slow addition to the suite shows
    (`make test` should stay under 9 minutes on 2 cores)."""
    if not _MODULE_SECONDS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.write_sep("=", f"seconds / CPU seconds per module ({sum(_MODULE_SECONDS.values()):.0f} / "
                                    f"{sum(_MODULE_CPU.values()):.0f} in all, over the workers)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -_MODULE_CPU.get(kv[0], 0.0)):
        if seconds >= 1.0:
            terminalreporter.write_line(f"{seconds:8.1f} {_MODULE_CPU.get(module, 0.0):8.1f}  {module}")
    terminalreporter.write_sep("-", "the 15 costliest tests in CPU seconds")
    for nodeid, cpu in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:8.1f}  {nodeid}")
    if os.environ.get("DS_INFERENCE_TEST_CPU_FILE"):  # every test's CPU seconds, for a closer look
        Path(os.environ["DS_INFERENCE_TEST_CPU_FILE"]).write_text(json.dumps(_TEST_CPU, indent=1))


@pytest.fixture(autouse=True)
def _output_locks_end_with_the_test():
    """A run's rank 0 holds its --output_dir (output_dir.claim) until its process ends; a test that runs main() in
    this process is that run's whole process, so the lock ends with the test (a later launched run into the same
    directory is then another run that follows it, not one beside it)."""
    yield
    from ds_inference_integration.run import output_dir

    output_dir.release_all()


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request, monkeypatch):
    """A test that starts a process without the `launched` mark would slow `make test-fast` unseen (three
    policy-check tests did, through a helper a scan of the tests' source missed): here it fails, naming itself."""
    if request.node.get_closest_marker("launched"):
        return

    def refuse(self, args, *a, **k):
        pytest.fail(f"{request.node.nodeid} starts a process ({args!r:.100}) but is not marked `launched`: "
                    "add @pytest.mark.launched")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def save_tiny_whisper(path: Path, multilingual: bool = False) -> Path:
    """A tiny random Whisper-style model (2 s windows: 200 log-mel frames of 16 bins) with the embedded word-level
    tokenizer and its own feature extractor, saved under `path`. `multilingual`: its generation config names three
    languages and two tasks, as a multilingual Whisper's does (their prefix tokens are ordinary words here)."""
    import torch
    from transformers import AutoTokenizer, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    config = WhisperConfig(vocab_size=len(tok), d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=100, max_target_positions=64,
                           pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, init_std=0.5,
                           suppress_tokens=None, begin_suppress_tokens=None)
    model = WhisperForConditionalGeneration(config)
    model.generation_config.max_length = 16
    if multilingual:
        gen = model.generation_config
        gen.is_multilingual, gen.lang_to_id = True, {"<|en|>": 3, "<|fr|>": 4, "<|de|>": 5}
        gen.task_to_id = {"transcribe": 6, "translate": 7}
        gen._from_model_config = False  # else loading it drops every attribute without a default, as these
    model.save_pretrained(path)
    tok.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=2,
                            n_fft=400).save_pretrained(path)
    return path


def save_tiny_speech2text(path: Path) -> Path:
    """A tiny random Speech2Text model (log-mel frames of 16 bins, frames first, of any length, with an attention
    mask) with the embedded word-level tokenizer and its own feature extractor."""
    import torch
    from transformers import AutoTokenizer, Speech2TextConfig, Speech2TextFeatureExtractor, Speech2TextForConditionalGeneration

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    config = Speech2TextConfig(vocab_size=len(tok), d_model=64, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, input_feat_per_channel=16, input_channels=1, conv_channels=32,
                               max_source_positions=256, max_target_positions=64, pad_token_id=0, bos_token_id=0,
                               eos_token_id=1, decoder_start_token_id=0)
    model = Speech2TextForConditionalGeneration(config)
    model.generation_config.max_length = 16
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Speech2TextFeatureExtractor(feature_size=16, num_mel_bins=16, sampling_rate=16000).save_pretrained(path)
    return path


def save_tiny_moonshine(path: Path) -> Path:
    """A tiny random Moonshine (raw samples in, its encoder's and decoder's head counts under names of its own: the
    architecture zoo's config) with the embedded word-level tokenizer and wav2vec2's feature extractor, which is
    what Moonshine's own processor uses."""
    import torch
    from transformers import AutoTokenizer, MoonshineForConditionalGeneration, Wav2Vec2FeatureExtractor

    from ds_inference_integration.tools.architecture_zoo import ZOO

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    config = ZOO["moonshine"]()
    config.vocab_size = len(tok)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 0, 1
    model = MoonshineForConditionalGeneration(config)
    model.generation_config.decoder_start_token_id, model.generation_config.pad_token_id = 0, 0
    model.generation_config.eos_token_id, model.generation_config.max_length = 1, 16
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, return_attention_mask=True).save_pretrained(path)
    return path


def save_tiny_wav2vec2_bart(path: Path) -> Path:
    """A tiny random SpeechEncoderDecoderModel: a wav2vec2 encoder reading the samples themselves (`input_values`)
    and a BART decoder, with the embedded word-level tokenizer and wav2vec2's feature extractor."""
    import torch
    from transformers import (
        AutoTokenizer,
        BartConfig,
        BartForCausalLM,
        SpeechEncoderDecoderModel,
        Wav2Vec2Config,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2Model,
    )

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    encoder = Wav2Vec2Model(Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 4),
                                           conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                                           num_conv_pos_embedding_groups=4))
    decoder = BartForCausalLM(BartConfig(vocab_size=len(tok), d_model=64, decoder_layers=2, decoder_attention_heads=4,
                                         decoder_ffn_dim=128, max_position_embeddings=64, is_decoder=True,
                                         add_cross_attention=True, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                                         decoder_start_token_id=0))
    model = SpeechEncoderDecoderModel(encoder=encoder, decoder=decoder)
    for c in (model.config, model.generation_config):
        c.decoder_start_token_id, c.pad_token_id, c.eos_token_id = 0, 0, 1
    model.generation_config.max_length = 16
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, return_attention_mask=True).save_pretrained(path)
    return path


@pytest.fixture
def presharded():
    """The embedded translation model, copied (with a pytorch_model.bin beside its safetensors, which the
    command must not copy), and pre-sharded for tp 2 by `ds-inference shard`: once per pytest run (`once_per_run`; the
    tests only read it, or copy it), not once per worker that runs one of these tests."""
    import torch
    from safetensors.torch import load_file

    def make(root: Path) -> None:
        src = root / "t5"
        shutil.copytree(DEFAULT_MODEL, src)
        torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
        proc = subprocess.run([str(BIN / "ds-inference"), "shard", str(src), "--tp-size", "2", str(root / "t5_tp2")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (root / "stdout.txt").write_text(proc.stdout)

    root = once_per_run("presharded-t5-tp2", make)
    return root / "t5", root / "t5_tp2", (root / "stdout.txt").read_text()
