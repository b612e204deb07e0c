"""`InferenceArgumentParser`: upstream's `HfArgumentParser` with the flag family's preparation built in, so
that a user's copy of an upstream example changes its parser line and nothing else around it.

Apart from `arguments.py` because it subclasses transformers' parser, whose import costs ~1.9 s on this
machine (`python -c 'from transformers import HfArgumentParser'`), which `ds-inference policy list` and
the other commands that read only the flags should not pay.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from .arguments import DeepSpeedInferenceArguments, prepare_argv, run_defaults, world_size_from_env
from .errors import InferenceSetupError
from .run import lifecycle, output_dir


class InferenceArgumentParser(HfArgumentParser):
    """`HfArgumentParser` that runs `prepare_argv` first (legacy options, the flag family validated before
    torch.distributed starts, `--use_cpu` for CPU ranks, `--inference_timeout` as `--ddp_timeout`), for
    command lines and for a single .json file of arguments alike. What the legacy options asked for is
    kept in `self.legacy` (for example `{"overwrite_output_dir": True}`)."""

    legacy: dict[str, bool]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the first call of the library in an upstream-shaped script: from here an uncaught error ends the rank in
        # one line, as in a script that runs through `run_main`
        lifecycle.install_exit_rules()

    def parse_args_into_dataclasses(self, args=None, *rest, **kwargs):
        argv = list(sys.argv[1:] if args is None else args)
        argv, self.legacy = prepare_argv(argv)
        values, _ = argparse.ArgumentParser.parse_known_args(self, argv)  # no dataclass built yet
        check_settings(vars(values))
        with _one_line():
            outputs = super().parse_args_into_dataclasses(argv, *rest, **kwargs)
        keep_legacy(outputs, self.legacy)
        check_run(outputs)
        return outputs

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False):
        args = self._prepare_dict(dict(args))
        check_settings(args)
        with _one_line():
            outputs = super().parse_dict(args, allow_extra_keys=allow_extra_keys)
        keep_legacy(outputs, self.legacy)
        check_run(outputs)
        return outputs

    def _prepare_dict(self, args: dict[str, Any]) -> dict[str, Any]:
        """The same preparation as `prepare_argv`, for arguments given as a dict (a .json / .yaml file)."""
        if "evaluation_strategy" in args:
            args.setdefault("eval_strategy", args.pop("evaluation_strategy"))
        self.legacy = {"overwrite_output_dir": bool(args.pop("overwrite_output_dir"))} \
            if "overwrite_output_dir" in args else {}
        known = DeepSpeedInferenceArguments.__dataclass_fields__
        try:
            inference_args = DeepSpeedInferenceArguments(**{k: v for k, v in args.items() if k in known})
        except TypeError as e:
            raise InferenceSetupError(str(e)) from None
        for name, value in run_defaults(inference_args, world_size_from_env(),
                                        int(os.environ.get("RANK", "0"))).items():
            args.setdefault(name, value)
        return args


def keep_legacy(outputs, legacy: dict[str, bool]) -> None:
    """`training_args.overwrite_output_dir` as transformers 4 had it (transformers 5 dropped the field): a script
    written for 4 reads it (upstream's checkpoint detection did), and `predict_to_file` starts afresh by it."""
    from transformers import TrainingArguments

    for output in outputs:
        if isinstance(output, TrainingArguments) and not hasattr(output, "overwrite_output_dir"):
            output.overwrite_output_dir = bool(legacy.get("overwrite_output_dir"))


def check_run(outputs) -> None:
    """What the parsed arguments say about the run, checked before the script loads any data or model, by the names
    every upstream example uses: the model (`check_model_for_run`) and the data files (`check_run_data`)."""
    from .predict.data_files import check_run_data

    check_model_for_run(outputs)
    check_run_data(outputs)


# upstream's names for the generated length: past an encoder-decoder's decoder positions either is an IndexError in
# the forward, after the model and data loaded
TARGET_LENGTHS = ("val_max_target_length", "generation_max_length")


def check_model_for_run(outputs) -> None:
    """Where the parsed arguments name a local model (a `model_name_or_path` field, as every upstream example has,
    or its `config_name`): from its config.json, the generated lengths upstream's arguments set against its decoder
    positions, and under --deepspeed_inference the policy for the run and the head counts against the tp size
    (a wrong --tp_size was a failure in the Trainer, after data and model loaded). A hub id is checked by the
    Trainer, once the model is there."""
    found = [o for o in outputs if is_dataclass(o)]
    model = next((o for o in found if getattr(o, "model_name_or_path", None)), None)
    if model is None:
        return
    path = Path(getattr(model, "config_name", None) or model.model_name_or_path)
    if not (path / "config.json").is_file():
        return
    from .load.own_code import check_trust, load_config
    from .policy.schema import policy_for_run
    from .predict.positions import check_lengths_fit
    from .topology import Topology

    # a directory with its own code and no --trust_remote_code: one line here, before any data or model loads (each
    # rank of a launched run says it; transformers would ask on every rank's stdin)
    trust = bool(getattr(model, "trust_remote_code", False))
    check_trust(Path(model.model_name_or_path), trust)
    try:
        config = load_config(path, trust)
    except InferenceSetupError:
        raise
    except (OSError, ValueError):
        return  # the script's own loading says what is wrong with it, as without the flag
    if getattr(config, "is_encoder_decoder", False):
        check_lengths_fit(config, target={f"--{name}": getattr(o, name) for o in found for name in TARGET_LENGTHS
                                          if hasattr(o, name)})
    check_speech_language(found, config, path)
    inference = next((o for o in found if isinstance(o, DeepSpeedInferenceArguments)), None)
    if inference is None or not inference.deepspeed_inference:
        return
    topology = Topology.create(world_size_from_env(), int(os.environ.get("RANK", "0")), inference.tp_size)
    policy_for_run(inference.injection_policy, config, topology.tp_size)


def check_speech_language(found: list, config, path: Path) -> None:
    """upstream's speech script's `--language` and `--task`, for a speech encoder-decoder, against its generation
    config (`predict/languages.py`), before anything loads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    args = next((o for o in found if hasattr(o, "language") and hasattr(o, "task")), None)
    if args is None or getattr(config, "model_type", None) not in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return
    from transformers import GenerationConfig

    from .predict.languages import check_language_and_task

    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: no languages
        generation_config = None
    check_language_and_task(generation_config, args.language, args.task)


@contextlib.contextmanager
def _one_line():
    """A bad or unknown argument (a ValueError from HfArgumentParser or from a dataclass's own checks, such as
    TrainingArguments') as one `error:` line, not a traceback."""
    try:
        yield
    except InferenceSetupError:
        raise
    except ValueError as e:
        raise InferenceSetupError(" ".join(str(e).split())) from None


# Settings a user can get wrong, checked on every rank before torch.distributed starts and before any model or data
# loads: each is one line naming the value and the valid ones. `None` means "not given" (the library's default).
# Without these, --num_beams 0 and --per_device_eval_batch_size 0 failed deep in generate or the data loader with
# a traceback per rank, --generation_max_length 1 wrote empty predictions with exit 0 (the decoder start token
# fills the one position), and --max_predict_samples 0 failed in the predict loop after the model loaded.
_AT_LEAST = {
    "per_device_eval_batch_size": (1, "a positive batch size"),
    "per_device_train_batch_size": (1, "a positive batch size"),
    "num_beams": (1, "1 (greedy or sampling) or more beams"),
    "generation_num_beams": (1, "1 (greedy or sampling) or more beams"),
    "num_return_sequences": (1, "1 or more sequences per example"),
    "generation_max_length": (2, "2 or more: the length counts the decoder's start token (or the prompt)"),
    "val_max_target_length": (2, "2 or more: the length counts the decoder's start token"),
    "max_new_tokens": (1, "1 or more new tokens"),
    "max_source_length": (1, "1 or more tokens"),
    "max_train_samples": (1, "1 or more examples, or leave it out for all of them"),
    "max_eval_samples": (1, "1 or more examples, or leave it out for all of them"),
    "max_predict_samples": (1, "1 or more examples, or leave it out for all of them"),
}


def check_settings(values: dict[str, Any]) -> None:
    """The run's settings that no dataclass of ours owns but that decide whether it can work: the numbers above,
    the output directory (a file, below a file, not writable: `output_dir.check`; rank 0 also takes its lock,
    so a second run into it is refused here, `output_dir.claim`), and rank 0's rendezvous port."""
    for name, (least, valid) in _AT_LEAST.items():
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < least:
            raise InferenceSetupError(f"--{name} {value} is out of range; valid: {valid}")
    if values.get("output_dir"):
        output_dir.check(values["output_dir"])
        if os.environ.get("RANK", "0") == "0":
            output_dir.claim(values["output_dir"])
    check_rendezvous_port()


def check_rendezvous_port() -> None:
    """Under the deepspeed launcher rank 0 itself opens the rendezvous store on MASTER_PORT (torchrun's agent opens
    it before any rank starts, and fails on its own there): a port another process listens on made rank 0 fail in
    torch with a traceback while the other ranks waited. Checked here, on rank 0, before anything starts."""
    port = os.environ.get("MASTER_PORT")
    if (os.environ.get("RANK") != "0" or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            or int(os.environ.get("WORLD_SIZE", "1")) < 2):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # the store is up already: this is a second parse in a running process
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As torch's store binds it: with SO_REUSEADDR, which a listener still refuses but a connection of an earlier
    # run left in TIME_WAIT (about 60 s on Linux) does not. Without it, running the same deepspeed command again
    # within a minute (as after a crash, to resume) was refused: "--master_port 29500 ... is in use" with nothing
    # listening (2026-12-04).
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("", int(port)))
    except OSError as e:
        raise InferenceSetupError(
            f"--master_port {port} (MASTER_PORT) is in use on {socket.gethostname()} ({e.strerror}): another process "
            "listens there; valid: a free port for the launcher's --master_port", ranks=[0]) from None
    finally:
        probe.close()
