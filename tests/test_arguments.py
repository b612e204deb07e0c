"""The flag family, argv preparation and topology: validated once, early, with clear messages."""

import json
import re

import pytest
import torch
from transformers import HfArgumentParser, Seq2SeqTrainingArguments

from ds_inference_integration import DeepSpeedInferenceArguments, InferenceSetupError, Topology, prepare_argv
from ds_inference_integration.arguments import translate_legacy_args


def test_defaults_are_off():
    args = DeepSpeedInferenceArguments()
    assert not args.deepspeed_inference and args.tp_size is None and args.injection_policy == "auto"
    assert args.resolve_dtype() == torch.float32
    assert args.resolve_dtype(bf16=True) == torch.bfloat16
    assert DeepSpeedInferenceArguments(inference_dtype="fp16").resolve_dtype(bf16=True) == torch.float16


def test_flags_parse_beside_seq2seq_arguments():
    parser = HfArgumentParser((Seq2SeqTrainingArguments, DeepSpeedInferenceArguments))
    _, inf = parser.parse_args_into_dataclasses(
        ["--output_dir", "x", "--deepspeed_inference", "--tp_size", "2", "--inference_dtype", "bf16",
         "--injection_policy", "autotp"])
    assert inf.deepspeed_inference and inf.tp_size == 2 and inf.inference_dtype == "bf16"
    assert inf.injection_policy == "autotp"


@pytest.mark.parametrize("kwargs, message", [
    ({"tp_size": 0}, "--tp_size 0 is invalid"),
    ({"inference_dtype": "fp8"}, "--inference_dtype 'fp8' is invalid; valid: fp32, fp16, bf16"),
    ({"inference_timeout": 0}, "--inference_timeout 0"),
])
def test_bad_values_name_the_value_and_the_valid_ones(kwargs, message):
    with pytest.raises(InferenceSetupError, match=message.replace("(", r"\(")):
        DeepSpeedInferenceArguments(**kwargs)


def test_kernel_injection_is_refused_on_the_stack_where_it_cannot_run(monkeypatch):
    """DeepSpeed 0.19's kernels fail on every architecture under transformers 5 (the GPU check's matrix): the
    flag is refused when parsed, before any model loads; a DeepSpeed newer than the last seen broken passes."""
    from ds_inference_integration import deepspeed_compat

    versions = {"deepspeed": "0.19.8", "transformers": "5.24.0"}
    monkeypatch.setattr(deepspeed_compat.metadata, "version", lambda name: versions[name])
    with pytest.raises(InferenceSetupError, match=r"--replace_with_kernel_inject is refused: DeepSpeed 0\.19\.8's "
                                                  r"inference kernels do not run with transformers 5\.24\.0"):
        DeepSpeedInferenceArguments(replace_with_kernel_inject=True)
    versions["deepspeed"] = "0.20.0"
    assert DeepSpeedInferenceArguments(replace_with_kernel_inject=True).replace_with_kernel_inject
    versions.update(deepspeed="0.19.8", transformers="4.43.4")
    assert deepspeed_compat.kernel_injection_problem() is None


def test_cpu_refuses_kernel_injection_and_fp16(monkeypatch):
    from ds_inference_integration import deepspeed_compat

    monkeypatch.setattr(deepspeed_compat, "kernel_injection_problem", lambda: None)  # a stack where they run
    with pytest.raises(InferenceSetupError, match="--replace_with_kernel_inject needs a GPU"):
        DeepSpeedInferenceArguments(replace_with_kernel_inject=True).check_device(False, torch.float32)
    with pytest.raises(InferenceSetupError, match="fp16 is not supported on CPU; valid on CPU: fp32, bf16"):
        DeepSpeedInferenceArguments().check_device(False, torch.float16)
    DeepSpeedInferenceArguments(replace_with_kernel_inject=True).check_device(True, torch.float16)


@pytest.mark.parametrize("world, tp, dp", [(1, None, 1), (2, None, 1), (4, 2, 2), (4, 1, 4), (6, 3, 2)])
def test_topology_layout(world, tp, dp):
    topo = Topology.create(world, world - 1, tp)
    assert topo.dp_size == dp and topo.tp_size * topo.dp_size == world
    # TP groups are consecutive ranks; DP groups take one rank of each TP group.
    assert sorted(r for g in topo.tp_group_ranks() for r in g) == list(range(world))
    assert all(g == list(range(g[0], g[0] + topo.tp_size)) for g in topo.tp_group_ranks())
    assert all(len(g) == dp for g in topo.dp_group_ranks())
    assert topo.tp_rank == (world - 1) % topo.tp_size and topo.dp_rank == (world - 1) // topo.tp_size


@pytest.mark.parametrize("world, tp, valid", [(2, 3, "1, 2"), (4, 3, "1, 2, 4"), (2, 4, "1, 2")])
def test_topology_rejects_tp_that_does_not_divide_world(world, tp, valid):
    with pytest.raises(InferenceSetupError, match=f"--tp_size {tp} does not fit {world} rank.*valid: {valid}$"):
        Topology.create(world, 0, tp)


@pytest.mark.parametrize("world, tp, local, asked, used", [
    (2, 2, "2", None, "gloo"),   # the default, also where DeepSpeed's op could serve the world
    (2, 2, "2", "gloo", "gloo"),
    (2, 2, "2", "shm", "shm"),
    (4, 4, "4", "shm", "shm"),
    (4, 2, "4", "shm", "gloo"),  # DP x TP: the op ignores process groups
    (2, 2, "1", "shm", "gloo"),  # two nodes: the op is single-node only
    (2, 2, None, "shm", "gloo"),
])
def test_cpu_ranks_all_reduce_with_gloo_unless_asked(world, tp, local, asked, used):
    """DeepSpeed's shared-memory all-reduce busy-waits with no timeout: CPU ranks use gloo by default."""
    from ds_inference_integration.deepspeed_compat import cpu_all_reduce

    environ = {k: v for k, v in (("LOCAL_SIZE", local), ("DS_INFERENCE_CPU_ALL_REDUCE", asked)) if v is not None}
    assert cpu_all_reduce(Topology.create(world, 0, tp), environ) == used


def test_a_bad_cpu_all_reduce_is_refused_with_the_arguments(monkeypatch):
    monkeypatch.setenv("DS_INFERENCE_CPU_ALL_REDUCE", "nccl")
    with pytest.raises(InferenceSetupError, match=r"^DS_INFERENCE_CPU_ALL_REDUCE='nccl' is invalid; valid: gloo, shm$"):
        DeepSpeedInferenceArguments(deepspeed_inference=True)


def test_legacy_options_keep_their_old_meaning():
    argv, legacy = translate_legacy_args(["--evaluation_strategy=steps", "--overwrite_output_dir", "--do_eval"])
    assert argv == ["--eval_strategy=steps", "--do_eval"] and legacy == {"overwrite_output_dir": True}
    argv, _ = translate_legacy_args(["--group_by_length", "true", "--do_predict"])
    assert argv == ["--train_sampling_strategy", "group_by_length", "--do_predict"]
    assert translate_legacy_args(["--group_by_length=false"])[0] == []


def test_prepare_argv_validates_tp_before_anything_starts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InferenceSetupError, match="--tp_size 3 does not fit 2"):
        prepare_argv(["--output_dir", "x", "--deepspeed_inference", "--tp_size", "3"])
    argv, _ = prepare_argv(["--output_dir", "x", "--deepspeed_inference", "--inference_timeout", "30"])
    assert argv[argv.index("--ddp_timeout") + 1] == "30"
    if not torch.cuda.is_available():
        assert "--use_cpu" in argv  # else accelerate would make each CPU rank a world of one
    # The flag off: no timeout change; tp is not validated.
    argv, _ = prepare_argv(["--output_dir", "x", "--tp_size", "3"])
    assert "--ddp_timeout" not in argv


@pytest.mark.parametrize("form", ["argv", "json"])
def test_the_parser_prepares_command_lines_and_json_files_alike(monkeypatch, tmp_path, form):
    """InferenceArgumentParser: what a user's copy of an upstream example gets by changing its parser line."""
    import json

    from ds_inference_integration import InferenceArgumentParser, argument_parser, arguments

    # a world of 2 for the preparation only (TrainingArguments itself would start torch.distributed)
    for module in (arguments, argument_parser):
        monkeypatch.setattr(module, "world_size_from_env", lambda: 2)

    out = str(tmp_path / "out")  # the parser claims its output directory (a lock file): not the checkout

    def parse(options: dict):
        parser = InferenceArgumentParser((Seq2SeqTrainingArguments, DeepSpeedInferenceArguments))
        if form == "json":
            path = tmp_path / "args.json"
            path.write_text(json.dumps(options))
            return parser, parser.parse_json_file(json_file=str(path))
        argv = [a for k, v in options.items() for a in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
        return parser, parser.parse_args_into_dataclasses(args=argv)

    with pytest.raises(InferenceSetupError, match="--tp_size 3 does not fit 2"):
        parse({"output_dir": out, "deepspeed_inference": True, "tp_size": 3})
    parser, (training, inference) = parse({"output_dir": out, "deepspeed_inference": True, "inference_timeout": 30,
                                           "evaluation_strategy": "no", "overwrite_output_dir": True})
    assert inference.deepspeed_inference and inference.inference_timeout == 30
    assert training.ddp_timeout == 30 and training.eval_strategy == "no"
    assert parser.legacy == {"overwrite_output_dir": True}
    assert training.use_cpu == (not torch.cuda.is_available())  # else accelerate makes each CPU rank a world of one
    parser, (training, _) = parse({"output_dir": out, "tp_size": 3, "ddp_timeout": 99})  # flag off: tp not checked
    assert training.ddp_timeout == 99 and parser.legacy == {}


def test_help_returns_zero(capsys):
    """In this process, through the scripts' own exit rules (`run_main`): --help prints the flag family and
    returns 0. (How a process ends on a bad argument, below, needs a process.)"""
    from conftest import load_example
    from ds_inference_integration.run.lifecycle import run_main

    assert run_main(load_example("run_generation").main, ["--help"]) == 0
    out, err = capsys.readouterr()
    assert "--deepspeed_inference" in out and "--tp_size" in out, err[-2000:]
    assert "Traceback" not in err


def test_a_command_whose_reader_leaves_ends_quietly(monkeypatch):
    """`ds-inference policy list | head -2`: the pipe closes under the listing; the command ends with exit 1 and
    nothing on stderr (it printed a traceback of BrokenPipeError, and Python another at its exit flush)."""
    import os
    import sys

    from ds_inference_integration.tools import cli

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    stdout = os.fdopen(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert cli.main(["policy", "list"]) == 1
        print("after", flush=True)  # the descriptor now leads nowhere: no second BrokenPipeError at exit's flush
    finally:
        stdout.close()


@pytest.mark.launched
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from conftest import EXAMPLES

    proc = subprocess.run([sys.executable, str(EXAMPLES / "run_generation.py"), "--output_dir", str(tmp_path),
                           "--no_such_flag", "1"], capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "--no_such_flag" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.launched
def test_the_fault_hook_is_not_in_the_package_and_long_sources_are_truncated(tmp_path):
    """DS_INFERENCE_FAULT means nothing to a production run: only the tests' sitecustomize reads it. The same
    run has sources longer than --max_source_length: truncated, as upstream's script truncates them (silently:
    the example no longer tokenizes every source twice to count them), one prediction each."""
    from conftest import TRANSLATE_ARGS, assert_ok, run_example

    run = run_example(["--do_predict", "--max_predict_samples", "10", *TRANSLATE_ARGS, "--max_source_length", "12",
                       "--deepspeed_inference"], tmp_path, env={"DS_INFERENCE_FAULT": "raise:0:0"})
    assert_ok(run)
    assert len(run.predictions()) == 10


def _port_left_in_time_wait() -> int:
    """A port whose listener is gone and whose last connection is in TIME_WAIT on it, as an earlier run leaves it."""
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the side that closes first keeps the connection in TIME_WAIT, on the store's port
    client.close()
    listener.close()
    return port


def test_our_own_rendezvous_store_restarts_on_a_port_an_earlier_run_left_in_time_wait(monkeypatch):
    """`run.ranks._loopback_store` (serve's and the benches' ranks on one machine) binds its listener as torch's
    store does, with SO_REUSEADDR: without it a restart on the same --master_port within a minute failed to bind."""
    import datetime
    import threading

    from ds_inference_integration.run.ranks import _loopback_store

    port = _port_left_in_time_wait()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    timeout = datetime.timedelta(seconds=10)
    peer = []  # rank 1 joins, as the store waits for every rank
    joining = threading.Thread(target=lambda: peer.append(_loopback_store(1, 2, timeout)))
    joining.start()
    store = _loopback_store(0, 2, timeout)
    joining.join(10)
    store.set("up", "1")
    assert peer[0].get("up") == b"1"


def test_a_port_an_earlier_run_left_in_time_wait_is_free_and_a_listened_one_is_not(monkeypatch):
    """`check_rendezvous_port` (rank 0 under the deepspeed launcher): the same command run again within a minute found
    its port held by the last run's connections in TIME_WAIT and was refused ("is in use", nothing listening),
    though torch's store binds it with SO_REUSEADDR. A port another process listens on is still refused."""
    import socket

    from ds_inference_integration.argument_parser import check_rendezvous_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(InferenceSetupError, match=rf"--master_port {port} \(MASTER_PORT\) is in use on"):
            check_rendezvous_port()
    monkeypatch.setenv("MASTER_PORT", str(_port_left_in_time_wait()))
    check_rendezvous_port()  # the earlier run is gone: the port is free for the store


def test_the_parser_turns_upstreams_argument_errors_into_one_line(tmp_path):
    """A user's copy of an upstream example calls the parser itself, without `arguments.parse_args_into_dataclasses`:
    an unknown argument, or one a dataclass's own checks refuse (TrainingArguments'), was a ValueError and so a
    traceback; now the library's one-line error, which the exit rules print as `error:` and exit 2."""
    from transformers import TrainingArguments

    from ds_inference_integration import InferenceArgumentParser

    parser = InferenceArgumentParser((TrainingArguments, DeepSpeedInferenceArguments))
    out = str(tmp_path / "out")
    with pytest.raises(InferenceSetupError, match=r"not used by the HfArgumentParser: \['--no_such_flag', '1'\]"):
        parser.parse_args_into_dataclasses(args=["--output_dir", out, "--no_such_flag", "1"])
    with pytest.raises(InferenceSetupError, match="--load_best_model_at_end requires the save and eval strategy"):
        parser.parse_args_into_dataclasses(args=["--output_dir", out, "--eval_strategy", "steps",
                                                 "--load_best_model_at_end", "--save_strategy", "epoch"])


@pytest.mark.launched
def test_the_exit_rules_leave_an_interactive_session_alone():
    """`install_exit_rules` ends a rank on an uncaught error; typed at the interpreter's prompt, the same error is
    printed as Python prints it and the session goes on."""
    import subprocess
    import sys

    lines = ["from ds_inference_integration.run.lifecycle import install_exit_rules",
             "install_exit_rules()",
             "from ds_inference_integration.errors import InferenceSetupError",
             "raise InferenceSetupError('typed at the prompt')",
             "print('the session goes on')"]
    proc = subprocess.run([sys.executable, "-i", "-q"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=120)
    assert "InferenceSetupError: typed at the prompt" in proc.stderr, proc.stderr[-2000:]
    assert "the session goes on" in proc.stdout and proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_the_parser_checks_the_models_head_counts_before_any_data_or_model_loads(monkeypatch, tmp_path):
    """Under the flag, where the parsed arguments name a local model (upstream's `model_name_or_path`), the parser
    checks the policy and head counts against the tp size from its config.json, before loading data, so that a
    user's copy of upstream's script gets it with the parser line alone (before, a wrong --tp_size surfaced in the
    Trainer, after the data and the model had loaded)."""
    from dataclasses import dataclass

    from transformers import AutoConfig

    from ds_inference_integration import InferenceArgumentParser, argument_parser, arguments

    @dataclass
    class ModelArguments:
        model_name_or_path: str | None = None

    for module in (arguments, argument_parser):  # a world of 2 for the preparation only
        monkeypatch.setattr(module, "world_size_from_env", lambda: 2)
    three, four = tmp_path / "three", tmp_path / "four"
    AutoConfig.for_model("t5", num_heads=3).save_pretrained(three)
    AutoConfig.for_model("t5", num_heads=4).save_pretrained(four)
    out = str(tmp_path / "out")

    def parse(model, *flags):
        parser = InferenceArgumentParser((ModelArguments, Seq2SeqTrainingArguments, DeepSpeedInferenceArguments))
        return parser.parse_args_into_dataclasses(args=["--output_dir", out, "--model_name_or_path", str(model),
                                                        *flags])

    with pytest.raises(InferenceSetupError, match=r"^t5: num_heads=3 is not divisible by --tp_size 2; valid tp sizes: "
                                                  r"1, 3$"):
        parse(three, "--deepspeed_inference")
    parse(three)  # without the flag nothing is split
    parse(four, "--deepspeed_inference")
    parse(tmp_path / "a-hub-id", "--deepspeed_inference")  # not here: the Trainer checks it once it is loaded


def test_the_parser_checks_a_user_scripts_data_files_and_columns_by_upstreams_names(tmp_path):
    """A user's upstream-shaped script (upstream's argument names, no check of its own) gets its data checked by the
    parser line alone, before anything loads: each file as upstream's `load_dataset` reads them all, and the columns
    translation or summarization reads in the splits the run uses. Before, the examples checked these themselves
    and a user's copy met a KeyError inside `datasets.map` or a DatasetGenerationError without file or line."""
    import json
    from dataclasses import dataclass

    from ds_inference_integration import InferenceArgumentParser

    @dataclass
    class TranslationData:
        source_lang: str | None = None
        target_lang: str | None = None
        train_file: str | None = None
        test_file: str | None = None
        dataset_name: str | None = None

    @dataclass
    class SummarizationData:
        text_column: str | None = None
        summary_column: str | None = None
        validation_file: str | None = None
        test_file: str | None = None

    def lines(name, *rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    pair = {"translation": {"en": "seven", "ro": "șapte"}}
    files = {
        "good": lines("good.json", pair, pair),
        "nocol": lines("nocol.json", {"text": "one"}),
        "nolang": lines("nolang.json", {"translation": {"de": "eins", "ro": "unu"}}),
        "null": lines("null.json", pair, {"translation": {"en": None, "ro": "opt"}}),
        "half": lines("half.json", pair, {"translation": {"en": "eight"}}),
        "sources": lines("sources.json", {"translation": {"en": "eight"}}),
    }
    (tmp_path / "broken.json").write_text(json.dumps(pair) + "\n{\n")
    files["broken"] = str(tmp_path / "broken.json")
    out = str(tmp_path / "out")

    def parse(data, *flags):
        return InferenceArgumentParser((data, Seq2SeqTrainingArguments)).parse_args_into_dataclasses(
            args=["--output_dir", out, *flags])

    def translate(*flags):
        return parse(TranslationData, "--source_lang", "en_XX", "--target_lang", "ro", *flags)

    cases = {
        # each line names the file (a null source's did not)
        ("--do_predict", "--test_file", files["nocol"]): r"^--test_file '\S+nocol.json': the test data has no "
                                                          r"'translation' column; columns: \['text'\]$",
        ("--do_predict", "--test_file", files["nolang"]): r"^--test_file '\S+nolang.json': the test data has no "
                                                           r"language 'en' in 'translation'; languages there: "
                                                           r"\['de', 'ro'\]$",
        ("--do_predict", "--test_file", files["null"]): r"^--test_file '\S+null.json': 1 of 2 test examples have an "
                                                         r"empty 'translation.en' \(the first: example 2, null; "
                                                         r"--source_lang en\)",
        ("--do_predict", "--test_file", files["half"]): r"^--test_file '\S+half.json': 1 of 2 test examples have no "
                                                         r"'ro' in 'translation'; valid: every example has it or none "
                                                         r"\(predictions only\)$",
        # a file the run does not predict from is still read by load_dataset: checked as a file
        ("--do_predict", "--test_file", files["good"], "--train_file", files["broken"]):
            r"^--train_file '\S+broken.json': line 2 is not valid JSON",
    }
    for flags, message in cases.items():
        with pytest.raises(InferenceSetupError, match=message):
            translate(*flags)
    translate("--do_predict", "--test_file", files["sources"])  # a test set without references: predictions only
    translate("--do_predict", "--test_file", files["good"], "--train_file", files["nocol"])  # no training here
    translate("--do_predict", "--test_file", files["nocol"], "--dataset_name", "wmt16")  # the hub's data: datasets'
    parquet = tmp_path / "test.parquet"
    parquet.write_bytes(b"PAR1\x00\xff")  # binary: upstream hands the extension to datasets as the builder's name
    translate("--do_predict", "--test_file", str(parquet))
    with pytest.raises(InferenceSetupError, match=r"^--test_file '\S+missing.parquet' does not exist$"):
        translate("--do_predict", "--test_file", str(tmp_path / "missing.parquet"))

    # summarization: upstream's default columns are the file's first two
    docs = lines("docs.json", {"article": "one two", "highlights": "one"}, {"article": "three", "highlights": None})
    with pytest.raises(InferenceSetupError, match=r"^--validation_file '\S+docs.json': 1 of 2 validation examples have "
                                                  r"no 'highlights'; valid: every example has one$"):
        parse(SummarizationData, "--do_eval", "--validation_file", docs)
    with pytest.raises(InferenceSetupError, match=r"^--test_file '\S+docs.json': --text_column 'document' is not a "
                                                  r"column of the test data; columns: article, highlights$"):
        parse(SummarizationData, "--do_predict", "--test_file", docs, "--text_column", "document")
    csv = tmp_path / "docs.csv"
    csv.write_text("document,summary\none two,one\n,three\n")
    with pytest.raises(InferenceSetupError, match=r"^--test_file '\S+docs.csv': 1 of 2 test examples have an empty "
                                                  r"'document' \(the first: example 2, null; --text_column document\)"):
        parse(SummarizationData, "--do_predict", "--test_file", str(csv))
    parse(SummarizationData, "--do_predict", "--test_file", lines("texts.json", {"document": "one"}),
          "--text_column", "document", "--summary_column", "summary")  # no summaries in a test set: predictions only


def test_the_parser_checks_the_generated_length_against_a_local_models_decoder_positions(tmp_path):
    """upstream's `--val_max_target_length` and `--generation_max_length` past a local encoder-decoder's decoder
    positions are one line naming the flag, with the flag or without, before anything loads (an IndexError in
    the forward before, after model and data had loaded; the examples checked it themselves)."""
    from dataclasses import dataclass

    from transformers import AutoConfig

    from ds_inference_integration import InferenceArgumentParser

    @dataclass
    class Args:
        model_name_or_path: str | None = None
        val_max_target_length: int | None = None

    bart = tmp_path / "bart"
    AutoConfig.for_model("bart", max_position_embeddings=64).save_pretrained(bart)
    out = str(tmp_path / "out")

    def parse(*flags):
        return InferenceArgumentParser((Args, Seq2SeqTrainingArguments)).parse_args_into_dataclasses(
            args=["--output_dir", out, "--model_name_or_path", str(bart), *flags])

    with pytest.raises(InferenceSetupError, match=r"^--val_max_target_length 128 is longer than the model's 64 decoder "
                                                  r"positions; valid: at most 64$"):
        parse("--val_max_target_length", "128")
    with pytest.raises(InferenceSetupError, match=r"^--generation_max_length 65 is longer than the model's 64 decoder "
                                                  r"positions; valid: at most 64$"):
        parse("--generation_max_length", "65")
    parse("--val_max_target_length", "64", "--generation_max_length", "64")


def test_a_data_file_is_checked_a_line_at_a_time_and_once_while_unchanged(tmp_path, monkeypatch):
    """The parser checks every --{split}_file on every rank of every run: read whole, a file took twice its size in
    memory on each rank (its bytes and its text), and a resumed bulk predict read it all again. Now a line at a time
    (traced peak under a tenth of an 8 MB file), and a file that passed is read again only once it changes."""
    import json
    import tracemalloc

    from ds_inference_integration.predict import data_files

    monkeypatch.setenv("DS_INFERENCE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "test.json"
    row = json.dumps({"translation": {"en": "seven " * 10, "ro": "șapte " * 10}}) + "\n"
    path.write_text(row * (8_000_000 // len(row)))

    def check():
        data_files.check_data_file(str(path), "--test_file", columns=data_files.TranslationColumns("test", "en", "ro"))

    tracemalloc.start()
    try:
        check()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size / 10, peak
    monkeypatch.setattr(data_files, "_lines", lambda *a: pytest.fail("an unchanged file that passed was read again"))
    check()
    monkeypatch.undo()
    monkeypatch.setenv("DS_INFERENCE_CACHE", str(tmp_path / "cache"))
    path.write_text(row + '{"translation": {"en": null, "ro": "opt"}}\n')  # changed: checked again
    with pytest.raises(InferenceSetupError, match=r"^--test_file '\S+': 1 of 2 test examples have an empty "
                                                  r"'translation.en'"):
        check()
    with pytest.raises(InferenceSetupError, match=r"^--test_file '\S+': 1 of 2 test examples have an empty "
                                                  r"'translation.en'"):
        check()  # a file that failed is not recorded


def test_the_data_check_accepts_every_file_upstreams_load_dataset_reads(tmp_path):
    """The check must never refuse what upstream's `load_dataset` reads: a JSON array on one line (what `json.dump`
    writes) and json lines after a UTF-8 byte-order mark were refused, though the check's own docstring accepted the
    array form. Each file here is given to datasets itself and to the check: the check passes every file datasets
    reads (translation's columns checked where the file has them), and a file datasets cannot read is refused in one
    line naming it."""
    import datasets

    from ds_inference_integration.predict import data_files

    rows = [{"translation": {"en": "seven", "ro": "șapte"}}, {"translation": {"en": "eight", "ro": "opt"}}]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    files = {
        "array_one_line.json": json.dumps(rows), "array_pretty.json": json.dumps(rows, indent=2),
        "array_after_spaces.json": "  " + json.dumps(rows), "bom.jsonl": "\ufeff" + lines,
        "bom_array.json": "\ufeff" + json.dumps(rows), "crlf.jsonl": lines.replace("\n", "\r\n"),
        "no_last_newline.jsonl": lines.rstrip("\n"), "blank_lines.jsonl": "\n" + lines.replace("\n", "\n\n"),
        "strings_array.json": json.dumps(["seven", "eight"]), "one_object.json": json.dumps({"text": ["a", "b"]}),
        "trailing_comma.json": json.dumps(rows)[:-1] + ",]", "bom.csv": "\ufeffen,ro\nseven,șapte\n",
        "crlf.csv": "en,ro\r\nseven,șapte\r\n", "quoted_newline.csv": 'en,ro\n"se\nven",șapte\n',
        "ragged.csv": "en,ro\nseven,șapte,x\n", "not_json.jsonl": lines + "{not json\n",
    }
    read_by_datasets = set()
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        try:
            datasets.load_dataset(data_files.kind_of(name), data_files=str(path), split="train",
                                  cache_dir=str(tmp_path / "cache"))
            read_by_datasets.add(name)
        except Exception:  # noqa: BLE001 - datasets' own verdict is what the check must follow
            pass
    assert {"array_one_line.json", "bom.jsonl", "bom.csv", "crlf.jsonl"} <= read_by_datasets
    assert {"trailing_comma.json", "not_json.jsonl"}.isdisjoint(read_by_datasets)
    for name in files:
        path = str(tmp_path / name)
        columns = data_files.TranslationColumns("test", "en", "ro") if "translation" in files[name] else None
        if name in read_by_datasets:
            data_files.check_data_file(path, "--test_file", columns=columns)
        else:
            with pytest.raises(InferenceSetupError, match=rf"^--test_file '{re.escape(path)}': ") as e:
                data_files.check_data_file(path, "--test_file", columns=columns)
            assert "\n" not in str(e.value)


def test_a_finished_rank_s_watchdog_thread_ends_before_the_interpreter_does(monkeypatch):
    """`watchdog.finished` (at exit, or `run_main`'s end) wakes the watchdog's thread and waits for it: a daemon
    thread left sleeping between heartbeats (up to 5 s) could be inside a store call while the interpreter tears
    down. A store hosted here, a world of 2: the thread is gone within a second of `finished`."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from ds_inference_integration.run import watchdog
    from ds_inference_integration.run.ranks import free_port

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    monkeypatch.setattr(watchdog, "_state", {})
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(watchdog.atexit, "register", lambda f: None)  # this test process is not a rank
    watchdog.start(0, 2, timeout=30.0)  # beats every 3 s
    thread = next(t for t in threading.enumerate() if t.name == "ds-inference-watchdog")
    time.sleep(0.3)  # inside its first sleep between beats
    assert thread.is_alive()
    start = time.monotonic()
    watchdog.finished()
    assert not thread.is_alive() and time.monotonic() - start < 1.0
    assert host.add("ds_inference_watchdog/done/0", 0) == 1
