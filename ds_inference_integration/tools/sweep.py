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

from .architecture_zoo import VOCAB

WIDTH = {"hidden_size": 128, "d_model": 128, "n_embd": 128, "embed_dim": 128, "dim": 128, "emb_dim": 128}
INNER = {"intermediate_size": 256, "ffn_dim": 256, "d_ff": 256, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256,
         "n_inner": 256, "ffn_hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
         "expert_intermediate_size": 128}
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
          "n_layers", "num_encoder_layers", "num_blocks")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_top_k", "top_k")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
MAX_PARAMETERS = 60_000_000


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


def _small_values(config) -> dict:
    """{attribute: small value} for the config's own size attributes (not its sub-configs')."""
    def ints(names):
        return [n for n in names if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool)]

    values: dict = {}
    for names in (WIDTH, INNER):
        values.update({n: min(getattr(config, n), names[n]) for n in ints(names)})
    values.update({n: min(getattr(config, n), 2) for n in ints(LAYERS)})  # (per-layer lists: more, below)
    values.update({n: 4 for n in ints(HEADS)})
    query = next((getattr(config, n) for n in ints(HEADS)), None)
    values.update({n: 4 if query is not None and getattr(config, n) >= query else 2 for n in ints(KV_HEADS)})
    if isinstance(getattr(config, "head_dim", None), int):
        values["head_dim"] = 32
    values.update({n: min(getattr(config, n), 4) for n in ints(EXPERTS)})
    values.update({n: min(getattr(config, n), 2) for n in ints(TOP_K)})
    if isinstance(getattr(config, "vocab_size", None), int):
        values["vocab_size"] = VOCAB
    for n in TOKEN_IDS:
        value = getattr(config, n, None)
        if isinstance(value, int) and value >= VOCAB:
            values[n] = {"pad_token_id": 0, "decoder_start_token_id": 0}.get(n, 1)
        elif isinstance(value, list):
            values[n] = [v if v < VOCAB else 1 for v in value]
    if isinstance(getattr(config, "initializer_range", None), float):
        values["initializer_range"] = 0.2
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # multi-head latent attention's own sizes
        if getattr(config, "head_dim", None) == config.qk_rope_head_dim:
            values["head_dim"] = 16
        values.update(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, kv_lora_rank=32)
        if getattr(config, "q_lora_rank", None) is not None:
            values["q_lora_rank"] = 32
        if isinstance(getattr(config, "qk_head_dim", None), int):
            values["qk_head_dim"] = 32
    for n in ("n_group", "topk_group", "num_expert_group", "topk_expert_group"):  # experts routed in groups: one
        if isinstance(getattr(config, n, None), int):
            values[n] = 1
    values.update(_per_layer_lists(config))
    return values


PER_LAYER = ("layer_types", "mlp_layer_types", "block_types")


def _per_layer_lists(config) -> dict:
    """The per-layer lists (`layer_types` and its kin) cut to one layer of each kind they hold (two to four layers,
    in the model's order), and the layer counts to match: a hybrid keeps a layer of each of its mixers (two layers
    of the default's first kinds were often both linear attention, which the model's own cache refuses)."""
    lists = {a: list(v) for a in PER_LAYER if isinstance(v := getattr(config, a, None), (list, tuple)) and v}
    if not lists:
        return {}
    picked: list[int] = []
    for values in lists.values():
        for kind in dict.fromkeys(values):
            if values.index(kind) not in picked and len(picked) < 4:
                picked.append(values.index(kind))
    picked = sorted(picked)
    while len(picked) < 2:
        picked.append(picked[-1] + 1)
    found = {a: [v[i % len(v)] for i in picked] for a, v in lists.items()}
    layers = [n for n in LAYERS if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool)]
    found.update({n: len(picked) for n in layers})
    return found


def shrink(config, rebuild: bool = True):
    """A small config of the same type: widths 128, inner sizes 256 (experts' 128), 2 layers, 4 query heads and 2
    or 4 key/value heads, head_dim 32, 4 experts of which 2 per token, a vocabulary of 96, a large initialisation
    (greedy tokens depend on the input). The top config is built again from those values where it can be (its
    own checks then derive what depends on them: `layer_types`), else changed in place with the first two kinds of
    its `layer_types`; sub-configs are changed in place."""
    from transformers import AutoConfig, PretrainedConfig

    from ..policy.schema import configured_values

    with configured_values(config):
        values = _small_values(config)
    if rebuild:
        try:
            config = AutoConfig.for_model(config.model_type, **values)
        except Exception:  # noqa: BLE001 (a config that refuses them together: changed in place below)
            rebuild = False
    if not rebuild:
        for n, v in values.items():
            setattr(config, n, v)
    for name in list(getattr(config, "sub_configs", {}) or {}):
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            shrink(sub, rebuild=False)
    if hasattr(config, "is_decoder") and not config.is_encoder_decoder:
        config.is_decoder = True  # BERT-style encoders generate as decoders (their LM-head class asks for it)
    return config


def build(model_type: str, root: Path) -> tuple[Path | None, str]:
    """A tiny random model of `model_type` saved under `root`: (directory, "") or (None, why not)."""
    import torch
    from transformers import AutoConfig

    from ..errors import first_line
    from ..load.skeleton import model_class_for

    try:
        config = shrink(AutoConfig.for_model(model_type))
        torch.manual_seed(0)
        model = model_class_for(config).from_config(config)
        count = sum(p.numel() for p in model.parameters())
        if count > MAX_PARAMETERS:
            return None, f"still {count / 1e6:.0f}M parameters after shrinking (sizes under names of its own)"
        if config.is_encoder_decoder:
            model.generation_config.max_length = 12
        model.save_pretrained(root / model_type)
    except Exception as e:  # noqa: BLE001 (any failure to build is this type's verdict, said in the table)
        return None, f"{type(e).__name__}: {first_line(e)[:200]}"
    return root / model_type, ""


def verdict(checks: list[dict]) -> str:
    """One cell from one type's checks at one tp size."""
    if not checks:
        return "no result"
    kinds = {c["check"] for c in checks}
    if kinds & {"setup", "reference", "sharded_forward", "error"}:
        c = next(c for c in checks if c["check"] in ("setup", "reference", "sharded_forward", "error"))
        label = {"setup": "refused", "reference": "unsharded model fails", "sharded_forward": "FAIL",
                 "error": "CRASH"}[c["check"]]
        return f"{label}: {c['line'].split(' ', 2)[2][:240]}"
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


def table(kinds: dict[str, str], built: dict[str, str], cells: dict[int, dict[str, str]], zoo: dict[str, str]) -> str:
    sizes = sorted(cells)
    lines = ["| model_type | kind | " + " | ".join(f"tp {tp}" for tp in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for model_type, kind in kinds.items():
        if model_type in zoo:
            row = [f"in the architecture table ({zoo[model_type]})"] * len(sizes)
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
        built, dirs = {}, {}
        for model_type in kinds:
            if model_type in zoo and not only:
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
    text = table(kinds, built, cells, {} if only else zoo)
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
