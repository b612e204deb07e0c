"""`InferenceArgumentParser`: upstream's `HfArgumentParser` with the flag family's preparation built in, so
that a user's copy of an upstream example changes its parser line and nothing else around it.

Apart from `arguments.py` because it subclasses transformers' parser, whose import costs ~1.9 s on this
machine (`python -c 'from transformers import HfArgumentParser'`), which `ds-inference policy list` and
the other commands that read only the flags should not pay.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from transformers import HfArgumentParser

from .arguments import DeepSpeedInferenceArguments, prepare_argv, run_defaults, world_size_from_env
from .errors import InferenceSetupError


class InferenceArgumentParser(HfArgumentParser):
    """`HfArgumentParser` that runs `prepare_argv` first (legacy options, the flag family validated before
    torch.distributed starts, `--use_cpu` for CPU ranks, `--inference_timeout` as `--ddp_timeout`), for
    command lines and for a single .json file of arguments alike. What the legacy options asked for is
    kept in `self.legacy` (for example `{"overwrite_output_dir": True}`)."""

    legacy: dict[str, bool]

    def parse_args_into_dataclasses(self, args=None, *rest, **kwargs):
        argv = list(sys.argv[1:] if args is None else args)
        argv, self.legacy = prepare_argv(argv)
        return super().parse_args_into_dataclasses(argv, *rest, **kwargs)

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False):
        return super().parse_dict(self._prepare_dict(dict(args)), allow_extra_keys=allow_extra_keys)

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
