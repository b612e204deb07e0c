"""Data parallel x tensor parallel, deterministic sampling, the lock-step guard, a rank that dies or
raises, and bad input: never a hang, never a lost or duplicated prediction."""

import os
import socket
import subprocess
import sys

import pytest

from conftest import (
    TRANSLATE_ARGS,
    WORKERS,
    assert_ok,
    free_port,
    load_example,
    reference_run,
    resumed_count,
    run_example,
    run_in_process,
    sampling_config,
)

ODD = ["--do_predict", "--max_predict_samples", "37", "--per_device_eval_batch_size", "4", *TRANSLATE_ARGS]


@pytest.fixture(scope="module")
def single_odd():
    run = reference_run(ODD)
    assert_ok(run)
    return run


# The killed-then-resumed run is make test-all's (68 s of make test's 911 s, 2026-12-04): resuming after a kill is
# make test's through test_killed_rank_... (tp 2) and the two-node test of test_layouts_and_faults.py (dp 2 x tp 2,
# rank 3 killed, across two "nodes" with their own disks), and four ranks on one node through the first run here.
# Both are make test-all's: in make test, test_trainer.py's test_replica_loader_refuses_iterable_data_across_replicas_
# and_never_dispatches shows the loader never dispatching (in process) and test_layouts_and_faults.py's two-node test
# four ranks at dp 2 x tp 2 giving one process's file and BLEU byte for byte (the dispatch run cost 27 CPU-s of a
# suite over its 10 minutes, 2026-12-06)
@pytest.mark.parametrize("launcher, loader, killed", [
    pytest.param("torchrun", '{"dispatch_batches": true}', False, marks=pytest.mark.slow),
    pytest.param("deepspeed", '{"dispatch_batches": true, "split_batches": true}', True, marks=pytest.mark.slow)],
    ids=["dispatch", "dispatch_split_killed_then_resumed"])
@pytest.mark.launched
def test_dp2_x_tp2_on_four_ranks(single_odd, tmp_path, launcher, loader, killed):
    """accelerate's dispatcher would hand every replica the same batches (74 lines for 37 examples); under our
    mesh no loader dispatches, so these two runs also take the plain DP x TP path, under both launchers. The
    second is first killed (SIGKILL, rank 3, its replica's third batch) and then re-run: the same command
    resumes, generates only what was not on disk, and gives the uninterrupted result."""
    args = [*ODD, "--deepspeed_inference", "--tp_size", "2", "--accelerator_config", loader]
    if killed:
        crashed = run_example(args, tmp_path, nprocs=4, launcher=launcher, timeout=300, fault="kill:3:2")
        assert crashed.returncode != 0 and not (tmp_path / "generated_predictions.txt").exists()
        assert list((tmp_path / "predict_parts").glob("part-dp*.jsonl")), crashed.output[-3000:]
    run = run_example(args, tmp_path, nprocs=4, launcher=launcher, timeout=300)
    assert_ok(run)
    assert run.predictions() == single_odd.predictions() and len(run.predictions()) == 37
    results = run.results("predict")
    assert (results["tp_size"], results["dp_size"], results["predict_samples"]) == (2, 2, 37)
    assert results["predict_bleu"] == single_odd.results("predict")["predict_bleu"]
    assert "world 4 = tp 2 x dp 2 (rank 3)" in run.output
    assert 0 <= results["predict_lockstep_guard_seconds"] < results["predict_runtime"]
    if killed:
        done = resumed_count(run.output)
        assert 0 < done < 37 and results["predict_generated_samples"] == 37 - done
        assert not (tmp_path / "predict_parts").exists()


# make test-all's: in make test, seeded sampling at tp 2 equals one process's through `policy check` (its sample
# check, every model of test_policies_tp.py's tp-2 check) and through the server against run_generation.py's seeded
# Trainer (test_serve.py's module server and its dp 2 x tp 2 test) (15 CPU-s, 2026-12-06)
@pytest.mark.slow
@pytest.mark.launched
def test_sampling_with_a_seed_matches_single_process(tiny_models, tmp_path):
    args = ["--model_name_or_path", str(tiny_models["t5"]), "--do_predict", "--max_predict_samples", "24",
            "--per_device_eval_batch_size", "8", "--val_max_target_length", "12", *TRANSLATE_ARGS, "--seed", "7"]
    greedy = run_in_process(args, tmp_path / "greedy")
    sample = ["--generation_config", str(sampling_config(tiny_models["t5"], tmp_path / "sampling"))]
    sampled = run_in_process([*args, *sample], tmp_path / "single")
    tp = run_example([*args, *sample, "--deepspeed_inference"], tmp_path / "tp", nprocs=2, launcher="torchrun")
    for run in (greedy, sampled, tp):
        assert_ok(run)
    assert sampled.predictions() != greedy.predictions()  # it really sampled
    assert tp.predictions() == sampled.predictions()


# 64 examples, 16 batches: the killed rank's runs stop at batch 3 and 9 and the last resumes the rest (a tp 2 run of
# all 203 cost 15 CPU-s more than one of 37: test_layouts_and_faults.py's SOME, the same examples)
SOME = [*ODD[:2], "64", *ODD[3:]]
FAULT_ARGS = [*SOME, "--deepspeed_inference", "--inference_timeout", "60"]


def _no_results(out) -> None:
    assert not (out / "predict_results.json").exists() and not (out / "generated_predictions.txt").exists()


# A killed rank, its run ending within the timeout and the same command resuming (refused with other generation
# settings, then a whole job killed, then byte for byte): test_layouts_and_faults.py's
# test_a_killed_rank_sigterm_ctrl_c_and_a_killed_job_each_end_a_run_and_the_same_command_resumes, one chain of runs
# with SIGTERM and Ctrl-C.


@pytest.mark.launched
def test_rank_that_raises_takes_the_others_down_promptly(tmp_path):
    run = run_example(FAULT_ARGS, tmp_path, nprocs=2, timeout=200, fault="raise:1:3", launcher="torchrun")
    assert run.returncode != 0
    assert "error: rank 1 failed: RuntimeError: injected fault on rank 1 at batch 3" in run.output
    assert run.seconds < 45, run.seconds  # well before the 60 s collective timeout
    _no_results(tmp_path)


@pytest.mark.launched
def test_lockstep_guard_stops_mixed_inputs_on_every_rank(tmp_path):
    run = run_example(FAULT_ARGS, tmp_path, nprocs=2, timeout=200, fault="skew:1:2", launcher="torchrun")
    assert run.returncode != 0
    errors = run.error_lines()
    assert any("[rank 0]" in e for e in errors) and any("[rank 1]" in e for e in errors), run.output[-2000:]
    assert all("lock-step guard: batch 2 differs between ranks 0 and 1 of TP group [0, 1]" in e for e in errors)
    assert run.seconds < 45, run.seconds
    _no_results(tmp_path)


# Bad input: one clear line and a non-zero exit on every rank -----------------------------------------

def _bad_files(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "nocol.json").write_text('{"text": "one"}\n')
    (tmp_path / "nolang.json").write_text('{"translation": {"de": "eins", "ro": "unu"}}\n')  # no source side
    (tmp_path / "syntax.toml").write_text("model_types = [\n")
    (tmp_path / "schema.toml").write_text('model_types = ["t5"]\n[layers.T5Block]\nall_reduce = ["o"]\n')


# These checks run identically on every rank, before anything distributed starts: they run here, in this
# process, through the script's own main(). That a bad input ends a run in one `error:` line with exit 2 and no
# traceback is shown end to end by the launched case below and test_bad_setup_fails_fast_on_every_rank. (A policy
# naming a module the model lacks is found only when sharding, at tp > 1: test_policy.py checks that message.)
BAD_INPUT = {
    "tp_larger_than_world": (["--tp_size", "4"], "--tp_size 4 does not fit 1 rank(s): it must divide the world size; valid: 1"),
    "kernel_inject": (["--replace_with_kernel_inject"], "--replace_with_kernel_inject is refused: DeepSpeed "),
    "policy_syntax": (["--injection_policy", "{tmp}/syntax.toml"], "syntax.toml: not valid TOML"),
    "empty_test_file": (["--test_file", "{tmp}/empty.json"], "empty.json' holds no examples"),
    "fp16_on_cpu": (["--inference_dtype", "fp16"], "--inference_dtype fp16 is not supported on CPU; valid on CPU: fp32, bf16"),
    "policy_schema": (["--injection_policy", "{tmp}/schema.toml"],
                      "[layers.T5Block] must hold row_parallel = [...] (and may hold replicated"),
    "unknown_policy": (["--injection_policy", "t5-policy"], "--injection_policy 't5-policy' is not a file; valid: auto, autotp"),
    "missing_column": (["--test_file", "{tmp}/nocol.json"], "the test data has no 'translation' column; columns: ['text']"),
    "missing_language": (["--test_file", "{tmp}/nolang.json"],
                         "no language 'en' in 'translation'; languages there: ['de', 'ro']"),
    "unknown_argument": (["--no_such_option", "1"], "Some specified arguments are not used by the HfArgumentParser: "
                                                   "['--no_such_option', '1']"),
}


@pytest.fixture(scope="module")
def run_translation_main():
    return load_example("run_translation").main


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_clear_line(tmp_path, case, run_translation_main):
    from ds_inference_integration import InferenceSetupError

    _bad_files(tmp_path)
    extra, expected = BAD_INPUT[case]
    args = ["--output_dir", str(tmp_path / "out"), "--do_predict", *TRANSLATE_ARGS, "--deepspeed_inference",
            *(a.format(tmp=tmp_path) for a in extra)]
    with pytest.raises(InferenceSetupError) as info:
        run_translation_main(args)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out" / "predict_results.json").exists()


@pytest.mark.launched
def test_bad_input_ends_the_run_in_one_line_with_exit_2(tmp_path):
    _bad_files(tmp_path)
    run = run_example(["--do_predict", *TRANSLATE_ARGS, "--deepspeed_inference", "--test_file",
                       str(tmp_path / "nolang.json")], tmp_path / "out", timeout=120)
    assert run.returncode == 2, run.output[-2000:]
    assert run.error_lines() == [f"error: --test_file '{tmp_path / 'nolang.json'}': the test data has no language 'en' "
                                 "in 'translation'; languages there: ['de', 'ro'] [rank 0]"], run.output[-2000:]
    assert "Traceback" not in run.output


# Commands that start their own ranks (policy check, shard, bench) ----------------------------------------------

CHATTY = """
import datetime, sys
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 1:
    sys.stdout.write("x" * 2_000_000 + "\\\\n")  # far more than a pipe holds (64 KiB)
    sys.stdout.flush()
dist.barrier()
"""


@pytest.mark.launched
def test_a_rank_that_prints_a_lot_does_not_block_its_peers(tmp_path, monkeypatch):
    import time

    from ds_inference_integration.run.ranks import failure_text, start_ranks, wait_ranks

    (tmp_path / "chatty_rank.py").write_text(CHATTY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    start = time.monotonic()
    procs = start_ranks(2, "chatty_rank", [], log_dir=tmp_path)
    codes = wait_ranks(procs, timeout=50)
    assert codes == [0, 0], failure_text(procs, codes)
    assert time.monotonic() - start < 40
    assert (tmp_path / "rank-1.log").stat().st_size > 2_000_000


PROBE = """
import atexit, os, signal, sys, threading, time
mode = sys.argv[1:][int(os.environ["RANK"])]
done = os.environ.get("PROBE_RANK_0_DONE")  # where set, the others end once rank 0 has: wait_ranks kills what
if mode == "return":                        # still runs 5 s after a rank fails
    if done:
        atexit.register(lambda: open(done, "w").close())  # the last thing rank 0 does
    import torch  # torch's threads (the template's torch was imported with the starter's environment)
    print(f"threads {torch.get_num_threads()}")
elif done:
    for _ in range(1200):
        if os.path.exists(done):
            break
        time.sleep(0.05)
print(f"probe rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} name {__name__} argv {sys.argv[1:]} "
      f"cwd {os.getcwd()} usr1 ignored {signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN} "
      f"int {signal.getsignal(signal.SIGINT).__name__}", flush=True)
atexit.register(lambda: print("probe atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("probe thread joined", flush=True))).start()
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("probe raised")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.launched
def test_forked_ranks_are_the_processes_python_m_starts(tmp_path, monkeypatch, capfd):
    """Without a GPU, `start_ranks` forks the ranks from a template that imported their stack once
    (run/template.py). Each forked rank must be what `python -m MODULE` started as its own process gives: its
    environment, arguments, working directory, threads and the signals its starter ignores; its output in its log
    (rank 0's in the starter's); its atexit handlers and non-daemon threads at the end; the exit code of sys.exit,
    of an uncaught exception, of Ctrl-C's KeyboardInterrupt and of a signal. Compared with the same ranks started
    as processes of their own (DS_INFERENCE_FORK_RANKS=0), and with a template that declines (DeepSpeed asked for
    another accelerator: started as processes too). DS_INFERENCE_FORK_RANKS=1: the probe is not one of the package's
    modules, whose ranks alone are forked by default."""
    import signal

    from ds_inference_integration.run import template
    from ds_inference_integration.run.ranks import start_ranks, wait_ranks

    (tmp_path / "probe_rank.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    modes = ["return", "exit3", "raise", "interrupt", "killed"]
    runs = {}
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        for how, env, n in (("forked", {template.FORK_ENV: "1"}, 5), ("exec", {template.FORK_ENV: "0"}, 5),
                            ("declined", {template.FORK_ENV: "1", "DS_ACCELERATOR": "cuda"}, 2)):
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            logs = tmp_path / how
            logs.mkdir()
            # rank 0 ends first in every mode: as a process of its own it imports torch, which took more than the
            # 5 s wait_ranks gives the peers of a failed rank under three workers' load (killed, -9; 2026-12-06)
            monkeypatch.setenv("PROBE_RANK_0_DONE", str(logs / "rank-0-done"))
            procs = start_ranks(n, "probe_rank", modes[:n], log_dir=logs)
            codes = wait_ranks(procs, timeout=60)
            template.end_all()  # the templates' CPU counted in this test's
            out = capfd.readouterr().out
            texts = [out] + [(logs / f"rank-{r}.log").read_text() for r in range(1, n)]
            # less DeepSpeed's line about its accelerator, which the template's import of it printed
            texts = ["".join(ln for ln in t.splitlines(True) if "real_accelerator" not in ln) for t in texts]
            runs[how] = (codes, [isinstance(p, template.ForkedRank) for p in procs], texts)
            for key in env:
                monkeypatch.delenv(key)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    codes, forked, texts = runs["forked"]
    assert codes == [0, 3, 1, -signal.SIGINT, -signal.SIGKILL], texts
    assert all(forked) and not any(runs["exec"][1]) and not any(runs["declined"][1])
    assert runs["exec"][0] == codes and runs["declined"][0] == codes[:2]
    assert "threads 1\n" in texts[0]
    for rank, text in enumerate(texts):
        assert (f"probe rank {rank} of 5 name __main__ argv {modes} cwd {tmp_path} usr1 ignored True "
                "int default_int_handler") in text, text
        if modes[rank] != "killed":
            assert "probe thread joined" in text and "probe atexit" in text, text
    assert "ValueError: probe raised" in texts[2] and "KeyboardInterrupt" in texts[3]
    # line for line what the processes of their own printed (the order of two threads' lines aside), less the two
    # frames of runpy that `python -m` puts in a traceback
    def lines(text):
        return sorted(ln for ln in text.splitlines() if "<frozen runpy>" not in ln)

    assert [lines(t) for t in runs["exec"][2]] == [lines(t) for t in texts]
    assert [lines(t) for t in runs["declined"][2]] == [lines(t.replace("of 5", "of 2").replace(
        str(modes), str(modes[:2]))) for t in texts[:2]]


@pytest.mark.launched
def test_ranks_a_template_cannot_fork_are_started_as_processes(tmp_path, monkeypatch):
    """A template that cannot fork (out of memory or processes) or is gone: the ranks are started as processes of
    their own, not refused."""
    from ds_inference_integration.run import ranks

    class CannotFork:
        def start(self, *args):
            raise OSError("the rank template is declined: fork failed: [Errno 12] Cannot allocate memory")

    (tmp_path / "probe_rank.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(ranks, "template", lambda n, module: CannotFork())
    procs = ranks.start_ranks(2, "probe_rank", ["exit3", "exit3"], log_dir=tmp_path)
    assert ranks.wait_ranks(procs, timeout=60) == [3, 3]
    assert all(isinstance(p, subprocess.Popen) for p in procs)
    assert "probe rank 1 of 2" in (tmp_path / "rank-1.log").read_text()


def test_the_template_declines_where_a_gpu_is_in_view(monkeypatch):
    """A process that asked CUDA about its GPUs cannot hand CUDA to a fork: the template asks NVML only and
    declines where a GPU answers (the ranks are then processes of their own)."""
    import torch

    from ds_inference_integration.run import template

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")  # given back after the test: the check sets it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert template._why_not() == "a GPU is in view"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert template._why_not() is None
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


@pytest.mark.launched
def test_policy_check_counts_every_rank_and_leaves_no_temporary_files():
    """Rank 1 alone sees wrong logits (a fault hook, on the T5 of one check beside a Llama under another fault:
    test_policies_tp.py's `faults_check`): the check must fail, naming rank 1, and leave nothing in its TMPDIR."""
    from test_policies_tp import faults_check

    proc, report, tmp = faults_check()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["check"]: c for c in report["checks"] if c["model"] == "t5"}
    assert not checks["logits"]["passed"] and checks["logits"]["failed_ranks"] == [1]
    # rank 1's figure, not rank 0's: the fault's 1.0, plus the split's rounding (eps-sized against logits of a few
    # units), so within a thousandth of the 1.0 compared
    assert checks["logits"]["data"]["max_diff"] == pytest.approx(1.0, rel=1e-3)
    assert checks["greedy"]["passed"]  # the other checks still report
    assert not report["ok"] and (sum(c["passed"] for c in checks.values()), len(checks)) == (7, 8)
    assert "[on rank 1 of 2]" in proc.stdout  # and the human line names the rank
    assert not [p for p in tmp.iterdir() if "ds_inference" in p.name], list(tmp.iterdir())


GROUP_TIMEOUT = """
import datetime, sys, time
import torch, torch.distributed as dist
from ds_inference_integration.topology import Topology, init_process_groups
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
topology = Topology.from_env(2)
groups = init_process_groups(topology, "cpu", timeout=3)
if topology.rank == 1:
    time.sleep(8)  # late for the TP collective below (3 s timeout), but alive
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=groups.tp)
    outcome = "completed"
except RuntimeError as e:
    outcome = "timed out" if "imeout" in str(e) or "imed out" in str(e) else "failed: " + str(e)[:200]
open(sys.argv[1] + f"/outcome-{topology.rank}.txt", "w").write(f"{outcome} {time.monotonic() - start:.1f}")
import os
import socket
os._exit(0)
"""


@pytest.mark.launched
def test_tp_and_dp_groups_get_the_inference_timeout(tmp_path, monkeypatch):
    """4 ranks, tp 2: the mesh's TP groups are new process groups; gloo would give them 30 minutes."""
    from ds_inference_integration.run.ranks import failure_text, start_ranks, wait_ranks

    (tmp_path / "group_timeout.py").write_text(GROUP_TIMEOUT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    procs = start_ranks(4, "group_timeout", [str(tmp_path)], log_dir=tmp_path)
    codes = wait_ranks(procs, timeout=90)
    assert codes == [0, 0, 0, 0], failure_text(procs, codes)
    outcome, seconds = (tmp_path / "outcome-0.txt").read_text().rsplit(" ", 1)
    assert outcome == "timed out" and float(seconds) < 10, (outcome, seconds)
    assert (tmp_path / "outcome-2.txt").read_text().startswith("completed")  # the other TP group is unaffected


STOP_ARGS = ["--do_predict", "--max_predict_samples", "64", "--per_device_eval_batch_size", "4", *TRANSLATE_ARGS,
             "--deepspeed_inference", "--tp_size", "2", "--inference_timeout", "10"]


# The shared-memory all-reduce (asked for with DS_INFERENCE_CPU_ALL_REDUCE=shm; gloo is the default) is make
# test-all's: the watchdog that ends a stopped rank is make test's through the gloo run, and on a fresh clone the
# shm run also JIT-compiles DeepSpeed's op (43 CPU-s, besides the run's 14; 2026-12-06). DP x TP (4 ranks) is make
# test-all's too: the watchdog is one per rank whatever the mesh, and the TP groups' own timeout under DP x TP is
# make test's through test_tp_and_dp_groups_get_the_inference_timeout (4 ranks cost 33 CPU-s of a suite over its
# 10 minutes, 2026-12-07; 2 ranks ~17)
@pytest.mark.parametrize("nprocs, launcher, all_reduce", [
    (2, "torchrun", "gloo"), pytest.param(4, "torchrun", "gloo", marks=pytest.mark.slow),
    pytest.param(2, "deepspeed", "shm", marks=pytest.mark.slow)],
    ids=["tp2_gloo_torchrun", "dp2_x_tp2_gloo_torchrun", "tp2_shared_memory_all_reduce_deepspeed"])
@pytest.mark.launched
def test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it(tmp_path, nprocs, launcher, all_reduce):
    """SIGSTOP: not dead, so no connection closes. With gloo (the default; under DP x TP the TP all-reduce is
    always gloo's) or, at tp = world on one node when asked for, DeepSpeed's shared-memory all-reduce, which
    busy-waits with no timeout of its own. (torchrun hosts the rendezvous store in its agent, the deepspeed
    launcher in rank 0: the watchdog works with both.)"""
    import re
    import time

    run = run_example(STOP_ARGS, tmp_path, nprocs=nprocs, timeout=300, fault="stop:1:2", launcher=launcher,
                      env={"DS_INFERENCE_CPU_ALL_REDUCE": all_reduce})
    ended = time.time()
    assert run.returncode != 0
    used = "all-reduce DeepSpeed shared memory" if all_reduce == "shm" else "all-reduce gloo"
    assert used in run.output, run.output[-3000:]
    stopped_at = float(re.search(r"fault: rank 1 stops at ([0-9.]+)", run.output).group(1))
    assert ended - stopped_at < 10 + 15, (ended - stopped_at, run.output[-3000:])
    errors = [e for e in run.error_lines() if "stopped answering" in e]
    assert errors and all(re.match(r"error: rank 1 \(pid \d+ on .+\) stopped answering: no heartbeat for \d+ s "
                                   r"\(--inference_timeout 10\); ending the run \[rank [023]\]$", e) for e in errors)
    _no_results(tmp_path)


@pytest.mark.launched
def test_a_policy_check_rank_that_aborts_in_teardown_after_its_results_does_not_fail_the_check():
    """`policy check`'s rank workers returned into the interpreter's teardown, where gloo's threads sometimes abort
    ("terminate called without an active exception", exit -6): twice in one `make test` under two workers
    (test_half_precision, the GPU check's smoke mode, 2026-12-04), every check passed and the check failed on the
    rank's exit code. A fault hook makes rank 0 abort at exit; the worker now leaves with os._exit once its results
    are written and its process group destroyed, as `ds-inference shard`'s ranks do. The check is test_policies_tp's
    shared tp-2 check (every architecture with a policy, the 2026 families, the unlisted ones), run with that fault:
    one launch for both (a launcher and two ranks cost ~12 CPU-s)."""
    from test_policies_tp import TP2_FAULT, tp2_shared

    assert TP2_FAULT == "abort_at_exit:0"
    proc, report, dirs = tp2_shared()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    n, skipped = 8 * len(dirs), report["skipped"]  # RWKV's beam search: the unsharded model cannot (SKIPS)
    assert f"PASS: {n - skipped} of {n} checks passed" in proc.stdout and report["ok"], proc.stdout[-3000:]


TEARDOWN = """
import atexit, os, sys
import torch.distributed as dist
from ds_inference_integration.run.lifecycle import tear_down_at_exit
atexit.register(lambda: print("at exit, process group:", dist.is_initialized(), flush=True))  # runs after ours
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
tear_down_at_exit()
tear_down_at_exit()  # once per process
if sys.argv[2] == "raise":
    raise ValueError("the script failed")
"""


@pytest.mark.launched
@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_script_that_returns_destroys_its_process_group_at_exit(tmp_path, end):
    """`run.lifecycle.tear_down_at_exit` (registered by setup_inference): a script that ends without run_main (the
    README's three changes) had its process groups destroyed in the interpreter's teardown, which aborted a clean
    dp 2 run in 2 of 13 ("terminate called without an active exception", exit -6, torchrun: failed). Now they are
    destroyed at exit while Python is whole; after an uncaught exception they are left alone."""
    from ds_inference_integration.run.ranks import free_port

    script = tmp_path / "script.py"
    script.write_text(TEARDOWN)
    proc = subprocess.run([sys.executable, str(script), str(free_port()), end], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == (0 if end == "return" else 1), proc.stderr[-2000:]
    # after an uncaught exception the rank leaves at once by the exit rules (`install_exit_rules`), before any exit
    # handler: nothing is destroyed while a peer may be inside a collective
    assert ("at exit, process group: False" in proc.stdout) == (end == "return"), proc.stdout + proc.stderr[-2000:]
    assert ("at exit" in proc.stdout) == (end == "return")
    assert (end == "raise") == ("error: rank 0 failed: ValueError: the script failed" in proc.stderr)


# a_metric_package_missing and setup are make test-all's: in make test, after_the_process_groups_start shows a user's
# script ending each of its 2 ranks in one line, test_translation_tp.py's test_bad_setup_fails_fast_on_every_rank a
# setup error as the same line on every rank (a rank 6 s late included), and
# test_a_missing_package_ends_a_rank_in_the_line_naming_its_extra (in process) the line a ModuleNotFoundError becomes
# (11 and 15 CPU-s of a suite over its 10 minutes, 2026-12-06)
@pytest.mark.launched
@pytest.mark.parametrize("when", [pytest.param("setup", marks=pytest.mark.slow), "after_the_process_groups_start",
                                  pytest.param("a_metric_package_missing", marks=pytest.mark.slow)])
def test_a_script_with_the_three_changes_ends_each_rank_in_one_line(tmp_path, when):
    """A user's script with the README's three changes and no `run_main` (tests/workers/causal_lm_eval.py), at 2
    ranks: a setup error (3 heads at --tp_size 2) printed a 17-line traceback per rank around the one-line error, and
    so did one raised after torch had started the process groups (and wrapped the exception hook): --dataloader_drop_last
    at dp 2; and so did the metric package its metric imports where the plugin was installed without that extra
    (sacrebleu's ModuleNotFoundError, where the library's own commands name the extra). Now each rank prints the one
    `error:` line and exits 2 (`run.lifecycle.install_exit_rules`, installed by the parser), as the examples do
    through `run_main`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                                 intermediate_size=64, vocab_size=64, pad_token_id=0)).save_pretrained(model)
    extra = {"setup": ["--tp_size", "2"], "after_the_process_groups_start": ["--tp_size", "1", "--dataloader_drop_last"],
             "a_metric_package_missing": ["--tp_size", "1"]}[when]
    missing = when == "a_metric_package_missing"
    run = run_example(["--report_to", "none", "--use_cpu", "--per_device_eval_batch_size", "4",
                       "--deepspeed_inference", *extra], tmp_path / "out", nprocs=2, script=WORKERS / "causal_lm_eval.py",
                      env={"MODEL_DIR": str(model), **({"METRIC_PACKAGE": "sacrebleu"} if missing else {})},
                      fault="hide_module:sacrebleu" if missing else None, timeout=120)
    assert run.returncode != 0
    want = {"setup": "llama: num_attention_heads=3 is not divisible by --tp_size 2; valid tp sizes: 1, 3",
            "after_the_process_groups_start": "--dataloader_drop_last drops a short last batch of each of 2 "
                                              "data-parallel replicas",
            "a_metric_package_missing": "sacrebleu is not installed; valid: pip install "
                                        "'ds-inference-integration[metrics]'"}[when]
    lines = run.error_lines()
    assert sorted(line[-len("[rank 0]"):] for line in lines) == ["[rank 0]", "[rank 1]"], run.output[-3000:]
    assert all(want in line for line in lines), lines
    import re

    # no traceback frame of the script or the library: torchrun's own report of the exit code only
    assert not re.search(r'File ".*(causal_lm_eval|ds_inference_integration)', run.output), run.output[-3000:]
    assert "exitcode  : 2" in run.output


def test_the_rank_that_hosts_the_store_waits_for_its_peers_to_stop_asking_it(monkeypatch):
    """Ranks that fail alike each count themselves reported in the store rank 0 hosts (the deepspeed launcher's
    rendezvous), then leave. Rank 0 left as soon as it saw every count, while a peer whose last look had been one
    short asked once more: the store was gone, and torch printed that connection's failure with 24 frames of its C++
    stack beside the one-line error (an empty --test_file, 2 runs in 5). Here the peer looks slowly (a loaded rank),
    and every one of its store calls must succeed: the host leaves last."""
    import threading
    import time

    import torch.distributed as dist

    from ds_inference_integration.run import lifecycle

    failed, real_store, real_sleep = [], dist.TCPStore, time.sleep

    class Watched:
        def __init__(self, *args, **kwargs):
            self.store = real_store(*args, **kwargs)

        def add(self, key, value):
            if threading.current_thread().name == "host" and not hasattr(self, "late"):
                self.late = real_sleep(0.5)  # the peer counts itself first, and is looking again slowly
            try:
                return self.store.add(key, value)
            except Exception as e:  # noqa: BLE001 - recorded: the test's point
                failed.append(f"{threading.current_thread().name}: {e}"[:200])
                raise

    def sleep(seconds):
        real_sleep(0.4 if threading.current_thread().name == "peer" else seconds)

    monkeypatch.setattr(dist, "TCPStore", Watched)
    monkeypatch.setattr(lifecycle.time, "sleep", sleep)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    seen = {}
    threads = [threading.Thread(target=lambda r=r: seen.__setitem__(r, lifecycle.wait_for_peers_to_report(r, [0, 1], 20)),
                                name=name) for r, name in ((0, "host"), (1, "peer"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {0: 2, 1: 2} and not failed, (seen, failed)


@pytest.mark.parametrize("module, line", [
    ("sacrebleu", "sacrebleu is not installed; valid: pip install 'ds-inference-integration[metrics]'"),
    ("sacrebleu.metrics", "sacrebleu is not installed; valid: pip install 'ds-inference-integration[metrics]'"),
    ("no_such_package", "no module named 'no_such_package' is installed; valid: install the package that provides "
                        "'no_such_package'")])
def test_a_missing_package_ends_a_rank_in_the_line_naming_its_extra(monkeypatch, capsys, module, line):
    """The exit rules' end of a rank whose script met a ModuleNotFoundError (a user's copy of upstream's script
    without the extra that installs its metric's package): one `error:` line naming the extra, exit 2, no traceback
    (launched at 2 ranks in test_a_script_with_the_three_changes_ends_each_rank_in_one_line[a_metric_package_missing])."""
    from ds_inference_integration.run import lifecycle

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(lifecycle, "exit_now", leave)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as ended:
        lifecycle.end_rank(ModuleNotFoundError(f"No module named {module!r}", name=module))
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err == f"\nerror: {line} [rank 0]\n"


def test_a_free_port_is_one_no_connection_or_port_0_bind_can_take_before_its_rank_binds_it():
    """The ports given to ranks and launchers are outside the kernel's ephemeral range (what a connection or a bind
    to port 0 anywhere on the machine may take meanwhile), free, and never the same twice in a process."""
    from ds_inference_integration.run.ranks import free_port

    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(10000 <= p < low for p in ports), (ports, low, high)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free


@pytest.mark.launched
def test_two_processes_drawing_free_ports_never_get_the_same_one():
    """The suite's two workers drew ports each on its own: one drew a --master_port the other's ranks had bound
    meanwhile, "--master_port 27367 (MASTER_PORT) is in use" (a fresh clone's `make test`, 2026-12-07). A drawn port
    is reserved on the machine: 600 drawn here and 600 in another process (of ~22,000: 16 shared, expected, before)
    are 1,200 ports (24 shared on the code before)."""
    from ds_inference_integration.run import ranks

    ours = {ranks.free_port() for _ in range(600)}  # held while this process lives (the other draws meanwhile)
    other = subprocess.run([sys.executable, "-c", "from ds_inference_integration.run.ranks import free_port\n"
                            "print(' '.join(str(free_port()) for _ in range(600)))"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    theirs = set(map(int, other.stdout.split()))
    assert len(theirs) == 600 and len(ours) == 600 and not theirs & ours, sorted(theirs & ours)
    for port in ours:  # given back (the suite's other tests draw from the rest meanwhile)
        ranks._held.pop(port)[0].close()
