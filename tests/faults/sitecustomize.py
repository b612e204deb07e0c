"""Fault injection for the tests, kept out of the package: a test puts this directory on PYTHONPATH and sets
DS_INFERENCE_FAULT, and every Python process it starts (launcher, ranks) patches the named piece of the
package when that module is first imported.

    DS_INFERENCE_FAULT=KIND:RANK:BATCH    at that batch, that rank: raise | kill (SIGKILL) | stop (SIGSTOP)
                                          | skew (generate from a different batch than its TP peers)
                                          | killjob (SIGKILL to the launcher and every rank at once: a
                                          scheduler's kill -9, a lost node)
    DS_INFERENCE_FAULT=pace:S             every batch of every rank starts S seconds late (a long run, little CPU)
    DS_INFERENCE_FAULT=fail_write:NAME    writing the output file NAME fails halfway (nothing renamed into place)
    DS_INFERENCE_FAULT=check_logits:RANK[:NAME]
                                          that rank's `policy check` sees its sharded logits off by 1.0 (only
                                          of the model whose directory is NAME, where given)
    DS_INFERENCE_FAULT=slow_start:RANK:S  that rank starts S seconds late (a loaded machine: its peers reach
                                          every check first)
    DS_INFERENCE_FAULT=shard_raise:TYPE   DeepSpeed's AutoTP raises the builtin exception TYPE on every rank when it
                                          replaces its first linear (an exception from inside init_inference)
    DS_INFERENCE_FAULT=abort_at_exit:RANK that rank's `policy check` worker aborts (SIGABRT) in the interpreter's
                                          teardown, after its results are written, as gloo's threads sometimes do
    DS_INFERENCE_FAULT=hide_module:NAME   importing the package NAME fails as if it were not installed (an extra left out)
    DS_INFERENCE_FAULT=derive_wrong       the derived policy loses its attention table (a wrong derivation: a fused
                                          QKV cut by rows across q, k and v)
    DS_INFERENCE_FAULT=serve_raise:SEED   a served batch holding a row of that seed raises inside generate, at its
                                          second new token, on every rank (a failure no request check foresaw)
    DS_INFERENCE_FAULT=threads_at_exit    not a fault, a probe: each rank prints, last of everything at its exit
                                          (its first atexit handler), how many of gloo's threads are still running
                                          ("gloo threads at exit: N")
    DS_INFERENCE_FAULT=half_scale:RANK:NAME:F
                                          a split wrong only in half precision: after sharding in fp16 or bf16, that
                                          rank's part of the module NAME (a path suffix) is scaled by F, as a
                                          scale applied twice on one rank would

Several faults at once: separated by ";" (one launch for the checks of two tests: `policy check` of a model with
one fault beside a model with another).
"""

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import signal
import sys

# This file shadows the suite's own sitecustomize (tests/interpreter: the collector's thresholds), so it runs that one
runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interpreter",
                            "sitecustomize.py"))

SPEC = os.environ.get("DS_INFERENCE_FAULT", "")
FAULTS = [part.partition(":")[::2] for part in SPEC.split(";") if part]
KIND, ARG = FAULTS[0] if len(FAULTS) == 1 else ("", "")  # the faults that patch at start, one at a time


def _kill_job():
    """SIGKILL to this rank's launcher, every other child of it (the peer ranks) and this rank, in that order."""
    launcher = os.getppid()
    peers = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == launcher:
                peers.append(int(entry))
    for pid in [launcher, *peers, os.getpid()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _patch_trainer(module):
    original = module.DeepSpeedInferenceMixin.prediction_step
    if KIND == "pace":  # every batch of every rank takes ARG seconds longer: a long run, at little CPU
        import time

        def paced(self, *args, **kwargs):
            time.sleep(float(ARG))
            return original(self, *args, **kwargs)

        module.DeepSpeedInferenceMixin.prediction_step = paced
        return
    rank, batch = (int(x) for x in ARG.split(":"))

    def prediction_step(self, model, inputs, *args, **kwargs):
        if self.topology.rank == rank and self.loop.batch_index + 1 == batch:
            if KIND == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif KIND == "killjob":
                _kill_job()
            elif KIND == "stop":
                import time

                print(f"fault: rank {rank} stops at {time.time():.3f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif KIND == "skew":
                inputs["input_ids"] = inputs["input_ids"].flip(0)
            else:
                raise RuntimeError(f"injected fault on rank {rank} at batch {batch} (DS_INFERENCE_FAULT)")
        return original(self, model, inputs, *args, **kwargs)

    module.DeepSpeedInferenceMixin.prediction_step = prediction_step


def _patch_files(module):
    import contextlib

    original = module.atomic_path

    @contextlib.contextmanager
    def atomic_path(path):
        with original(path) as tmp:
            yield tmp
            if os.path.basename(str(path)) == ARG:  # written, not yet renamed: as if killed here
                raise OSError(f"injected write failure for {ARG} (DS_INFERENCE_FAULT)")

    module.atomic_path = atomic_path


def _patch_check(module, arg):
    rank, _, name = arg.partition(":")
    original = module._run_model_naming_failures

    def run(model, inputs, torch, *args, **kwargs):
        out = original(model, inputs, torch, *args, **kwargs)
        config = getattr(getattr(model, "module", model), "config", None)
        where = os.path.basename(str(getattr(config, "name_or_path", "")).rstrip("/"))
        if int(os.environ.get("RANK", "0")) == int(rank) and name in ("", where):
            out["logits"] = out["logits"] + 1.0
        return out

    module._run_model_naming_failures = run


def _patch_half_scale(module, arg):
    rank, name, factor = arg.split(":")
    original = module.shard_model

    def shard_model(model, args, topology, groups, policy, dtype, *rest, **kwargs):
        import torch

        model, report = original(model, args, topology, groups, policy, dtype, *rest, **kwargs)
        if dtype in (torch.float16, torch.bfloat16) and topology.rank == int(rank):
            for path, sub in model.named_modules():
                if path.endswith(name):
                    with torch.no_grad():
                        sub.weight.mul_(float(factor))
        return model, report

    module.shard_model = shard_model


def _patch_autotp(module):
    import builtins

    error = getattr(builtins, ARG)

    def replace(self, child, name, conv_linear_layer):
        raise error("injected inside DeepSpeed's AutoTP (DS_INFERENCE_FAULT)")

    module.AutoTP._replace = replace


def _patch_derive_wrong(module):
    """The derived policy without its attention table: a fused QKV (GPT-2's c_attn) left to DeepSpeed's plain split
    by rows, which cuts it across q, k and v, as a derivation that misreads a layout would."""
    import dataclasses

    derive = module.derive_policy

    def wrong(model):
        return dataclasses.replace(derive(model), attention=None)

    module.derive_policy = wrong


def _patch_abort_at_exit(module):
    if os.environ.get("RANK") == ARG:
        import atexit

        atexit.register(os.abort)  # runs in the teardown of a worker that returns: SIGABRT, exit -6


if KIND == "slow_start":
    _rank, _, _seconds = ARG.partition(":")
    if os.environ.get("RANK") == _rank and "LOCAL_RANK" in os.environ:  # a rank, not its launcher
        import time

        time.sleep(float(_seconds))

if KIND == "threads_at_exit" and "LOCAL_RANK" in os.environ:  # a rank, not its launcher
    import atexit

    def _gloo_threads_at_exit():
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # a thread that ended while listed
                pass
        # one write of the whole line (a pipe takes it whole): print's text and newline went as two, and two ranks'
        # lines on one pipe came interleaved ("... [rank 1]gloo threads at exit: 0 [rank 0]")
        line = f"gloo threads at exit: {sum('gloo' in n for n in names)} [rank {os.environ.get('RANK')}]\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())

    atexit.register(_gloo_threads_at_exit)  # the first registered: it runs last


def _patch_serve_raise(module):
    """`row_end`, which both engines ask of every row at every new token (the batch engine inside generate)."""
    seed, row_end = int(ARG), module.row_end

    def failing(row, last, produced, eos, text):
        if produced == 2 and int(row.seed) == seed:
            raise RuntimeError(f"injected generate failure for seed {seed} (DS_INFERENCE_FAULT)")
        return row_end(row, last, produced, eos, text)

    module.row_end = failing


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == ARG:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if KIND == "hide_module":
    sys.meta_path.insert(0, _Hidden())

# What each module gets when it is first imported: {module: [patch(module), ...]}, applied in order
PATCHES: dict[str, list] = {}
_AT_START = {  # the faults that patch at start, one at a time: the module each patches, and how
    "fail_write": ("ds_inference_integration.run.files", _patch_files),
    "serve_raise": ("ds_inference_integration.serve.rules", _patch_serve_raise),
    "abort_at_exit": ("ds_inference_integration.tools.policy_check", _patch_abort_at_exit),
    "shard_raise": ("deepspeed.module_inject.auto_tp", _patch_autotp),
    "derive_wrong": ("ds_inference_integration.policy.derive", _patch_derive_wrong),
    **dict.fromkeys(("raise", "kill", "killjob", "stop", "skew", "pace"),
                    ("ds_inference_integration.predict.trainer", _patch_trainer)),
}
if KIND in _AT_START:
    PATCHES.setdefault(_AT_START[KIND][0], []).append(_AT_START[KIND][1])
for _kind, _arg in FAULTS:  # the faults that take their argument, any number of them at once
    if _kind == "check_logits":
        PATCHES.setdefault("ds_inference_integration.tools.policy_check", []).append(
            functools.partial(_patch_check, arg=_arg))
    elif _kind == "half_scale":
        PATCHES.setdefault("ds_inference_integration.shard.inject", []).append(
            functools.partial(_patch_half_scale, arg=_arg))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for patch in PATCHES[name]:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())
