"""`ds-inference policy sweep`: every model type transformers can generate with (its causal-LM, seq2seq-LM and
speech-seq2seq mappings), a tiny random model of each built from its default config made small, checked by
`policy check` at each tp size; the result per type written to a table (docs/sweep.md).

The zoo (`architecture_zoo.py`) holds configs made by hand for the types the project checks in its tests; this
sweep is the rest's first contact: a default config shrunk by the usual attribute names (`shrink`) may not build
(a type with sizes under names of its own, or one that needs sub-configs), and the table says so, with the error,
as "not built", apart from what the checker found. Each launch runs the types left; where a rank stops on one (an
exception mid-collective, a hang killed at `--timeout`), that type is marked and the next launch starts after it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .small_config import shrink

MAX_PARAMETERS = 60_000_000
# the checks that end a model's checks, and what the table calls each
STOPPED = {"setup": "refused", "reference": "unsharded model fails", "sharded_forward": "FAIL", "error": "CRASH"}


def generating_types() -> dict[str, str]:
    """{model_type: which mapping names it}: every type an Auto class builds a generating model of."""
    from transformers.models.auto import modeling_auto as auto

    found: dict[str, str] = {}
    for kind, names in (("speech-seq2seq", auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
                        ("seq2seq", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                        ("causal", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        for model_type in names:
            found.setdefault(model_type, kind)
    return dict(sorted(found.items()))


def build(model_type: str, root: Path) -> tuple[Path | None, str]:
    """A tiny random model of `model_type` saved under `root`: (directory, "") or (None, why not)."""
    from transformers import AutoConfig

    from ..errors import first_line
    from .architecture_zoo import tiny_model

    try:
        config = shrink(AutoConfig.for_model(model_type))
        config.architectures = published_class(model_type)
        model = tiny_model(config)
        count = sum(p.numel() for p in model.parameters())
        if count > MAX_PARAMETERS:
            return None, f"still {count / 1e6:.0f}M parameters after shrinking (sizes under names of its own)"
        model.save_pretrained(root / model_type)
    except Exception as e:  # noqa: BLE001 (any failure to build is this type's verdict, said in the table)
        return None, _default_fails(model_type) or f"{type(e).__name__}: {first_line(e)[:200]}"
    return root / model_type, ""


def published_class(model_type: str) -> list[str] | None:
    """The class a published checkpoint of the type names in its `architectures`, where it is not the causal-LM
    class the sweep would build otherwise: Mllama's and Emu3's causal-LM classes are their text models alone, whose
    saved config transformers' Auto classes do not load back ("Unrecognized configuration class ... TextConfig"); their
    checkpoints are of the image-and-text class."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    both = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if not causal or not both or causal == both:
        return None
    saved = getattr(getattr(transformers, causal, None), "config_class", None)  # what the causal class saves
    reloads = saved is not None and getattr(saved, "model_type", None) in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return None if reloads else [both]


def refusal(model_type: str) -> str | None:
    """The one line predict, the server and `policy check` refuse a checkpoint of the type in before it loads, where
    the class its default config builds generates no text by itself (`load.skeleton.check_generates_text`: Gemma 4's
    assistants, MusicGen, VibeVoice, Dia), else None: such a type is said refused, not built first."""
    import types

    import transformers
    from transformers import AutoConfig

    from ..errors import InferenceSetupError
    from ..load.skeleton import check_generates_text, model_class_for

    try:
        config = AutoConfig.for_model(model_type)
        auto_class = model_class_for(config)
        model_class = auto_class._model_mapping[type(config)]
    except Exception:  # noqa: BLE001 (a default config its own validator refuses, Gemma 4-assistant's: the class by name)
        from transformers.models.auto import modeling_auto as auto

        config = types.SimpleNamespace(model_type=model_type, architectures=None)
        names = (auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                 auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        model_class = getattr(transformers, next(m[model_type] for m in names if model_type in m))
    try:
        check_generates_text(config, model_class, model_type)
    except InferenceSetupError as e:
        return str(e)
    return None


def _default_fails(model_type: str) -> str | None:
    """Why transformers builds no model of the type's own default config (on the meta device: no memory), or None:
    the small config is then not the cause (MusicGen's config, which its causal-LM class reads `dropout` from)."""
    import torch
    from transformers import AutoConfig

    from ..errors import first_line
    from ..load.skeleton import model_class_for

    try:
        config = AutoConfig.for_model(model_type)
        with torch.device("meta"):
            model_class_for(config).from_config(config)
    except Exception as e:  # noqa: BLE001 (transformers' own failure, said in the table)
        return f"transformers builds no model of its default config either ({type(e).__name__}: {first_line(e)[:160]})"
    return None


def verdict(checks: list[dict]) -> str:
    """One cell from one type's checks at one tp size."""
    if not checks:
        return "no result"
    stopped = next((c for c in checks if c["check"] in STOPPED), None)  # the model's only record
    if stopped:
        return f"{STOPPED[stopped['check']]}: {stopped['line'].split(' ', 2)[2][:240]}"
    bad = [c for c in checks if not c["passed"] and not c.get("skipped")]
    share = next((max(c["data"]["shares"]) for c in checks if c["check"] == "weights_per_rank"), None)
    if bad:
        return f"FAIL ({len(checks) - len(bad)}/{len(checks)}): {bad[0]['line'].split(' ', 2)[2][:200]}"
    skipped = [c["check"] for c in checks if c.get("skipped")]
    return f"pass ({share:.0%} per rank" + (f"; {', '.join(skipped)} skipped" if skipped else "") + ")"


def check_all(dirs: dict[str, Path], tp: int, timeout: float, out: Path) -> dict[str, str]:
    """{model_type: verdict} at `tp`: one launch for the types left, again after any type a launch stopped on."""
    from .policy_check import run_check

    left, cells, launch = list(dirs), {}, 0
    while left:  # each launch settles at least one type: it terminates
        path = out / f"sweep_tp{tp}_{launch}.json"
        launch += 1
        run_check([str(dirs[t]) for t in left], tp, "auto", timeout=timeout, json_path=str(path))
        report = json.loads(path.read_text()) if path.is_file() else {"checks": [], "rank_failure": "no report"}
        by_type: dict[str, list] = {}
        for c in report["checks"]:
            if c["model"] is not None:
                by_type.setdefault(c["model"], []).append(c)
        for t in left:
            if t in by_type:
                cells[t] = verdict(by_type[t])
        rest = [t for t in left if t not in by_type]
        ended_by_error = any(c["check"] == "error" for c in report["checks"])
        if rest and not ended_by_error:  # killed or hung in the first type left: it has no record of its own
            cells[rest[0]] = f"CRASH: the ranks stopped in it ({str(report.get('rank_failure'))[:200]})"
            rest = rest[1:]
        left = rest
    return cells


def table(kinds: dict[str, str], built: dict[str, str], cells: dict[int, dict[str, str]], zoo: dict[str, str],
          refused: dict[str, str] | None = None) -> str:
    sizes = sorted(cells)
    lines = ["| model_type | kind | " + " | ".join(f"tp {tp}" for tp in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for model_type, kind in kinds.items():
        if model_type in zoo:
            row = [f"in the architecture table ({zoo[model_type]})"] * len(sizes)
        elif (refused or {}).get(model_type):
            row = [f"refused before loading: {refused[model_type]}"] * len(sizes)
        elif built.get(model_type):
            row = [f"not built: {built[model_type]}"] * len(sizes)
        else:
            row = [cells[tp].get(model_type, "no result") for tp in sizes]
        lines.append(f"| {model_type} | {kind} | " + " | ".join(r.replace("|", "/") for r in row) + " |")
    return "\n".join(lines) + "\n"


def run_sweep(tp_sizes: list[int], out_path: str | None, only: list[str] | None, timeout: float,
              json_dir: str | None = None) -> int:
    from ..run.files import write_text_atomic
    from .architecture_zoo import ZOO

    kinds = generating_types()
    unknown = [t for t in only or [] if t not in kinds]
    if unknown:
        print(f"error: --only {unknown[0]!r} is not a model type transformers generates with; valid: "
              f"{', '.join(kinds)}", file=sys.stderr)
        return 2
    if only:
        kinds = {t: kinds[t] for t in only}
    zoo: dict[str, str] = {}
    for name, make in ZOO.items():
        zoo.setdefault(make().model_type, name)
    cells: dict[int, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="ds_inference_sweep_") as tmp:
        built, dirs, refused = {}, {}, {}
        for model_type in kinds:
            if model_type in zoo and not only:
                continue
            if line := refusal(model_type):
                refused[model_type] = line
                continue
            directory, why = build(model_type, Path(tmp) / "models")
            if directory is None:
                built[model_type] = why
            else:
                dirs[model_type] = directory
        out = Path(json_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for tp in tp_sizes:
            cells[tp] = check_all(dirs, tp, timeout, out)
    text = table(kinds, built, cells, {} if only else zoo, refused)
    print(text, end="")
    if out_path:
        import datetime

        import transformers

        head = (f"# Every model type transformers generates with\n\nWritten by `ds-inference policy sweep --tp-sizes "
                f"{','.join(map(str, tp_sizes))} --out {out_path}` on {datetime.date.today()} with transformers "
                f"{transformers.__version__}: a tiny random model of each type from its default config made small "
                "(`tools/sweep.py`), checked by `policy check`. Types in docs/policies.md's architecture table are "
                "checked there, from configs made by hand; \"not built\" is the sweep's own failure to make a small "
                "model of the type, not a verdict on it.\n\n")
        write_text_atomic(Path(out_path), head + text)
    return 0
