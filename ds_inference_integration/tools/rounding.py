"""`policy check` in half precision: telling the rounding of a correct split from a wrong split.

Tensor parallelism adds each row-parallel layer's partial products in another order than one device does. In fp32
that moves logits by about 1e-6 and the token ids do not change; in bf16 or fp16 each partial sum is rounded to 8
or 11 bits before it is added, so logits move by whole units of rounding and a token whose top choices are that
close can change (a random 26M Llama in bf16: 19 of 40 outputs part from one process at tp 2, and 14 of 40 part
between batch 8 and batch 1 in one process alone). A fixed tolerance cannot tell that from a wrong split that is
off by as little. So the verdict measures the unsharded model's own rounding on the same inputs: how far its
half-precision logits and hidden states are from the same model computed in fp32 (root mean square of the
difference). A correct split in half precision is another rounding of the same arithmetic, about as far from
the fp32 result as one device is; a wrong split adds its own error on top.

* logits and every hidden state: the sharded model's RMS distance from the fp32 result within FACTOR x the
  unsharded half-precision model's (plus one rounding unit at that tensor's scale, for tensors both compute
  exactly, such as the embeddings); the first hidden state beyond its bound names the layer where a wrong split
  starts, and every failing line names it;
* token ids (greedy, beam, seeded sampling): identical, or, for each row that parts from the reference, judged at
  the step where it parts, where both models read the same prefix: their logits there within the step bound
  (2 x FACTOR x the unsharded model's largest logit distance from fp32 on the check's inputs and along its own
  generations, at least one rounding unit: each run may be FACTOR x that from fp32), so the choice was
  made from the same numbers up to rounding; for greedy also the reference's margin between its token and the
  sharded model's within twice that (a near-tie). Beam search and sampling can part at tokens far apart in score
  (another beam wins later; a seeded draw crosses a boundary of the cumulative distribution), so there the logits
  rule decides; the reference's top-2 margin is reported for every parting.
"""

from __future__ import annotations

import torch
from torch import nn

from ..arguments import DTYPES

# Measured with `ds-inference policy matrix --tp-sizes 2,4 --dtype bf16` (the 107 tiny random models of the zoo saved in
# bf16, 2026-12-04): the largest ratio of a passing split's RMS distance from fp32 to the unsharded bf16 model's, over
# every model, hidden state and the logits, was 1.58 at tp 2 (LED) and 1.76 at tp 4 (Blenderbot); a wrong split that
# scales one rank's part of one down projection by 1.2 (10% on that layer's output) gives 4.8 on a tiny Llama
# (tests/test_half_precision.py).
FACTOR = 2.0
HALF = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def unit(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """About the RMS error of rounding `reference` once to `dtype`: eps/4 of its RMS (at least of 1)."""
    return torch.finfo(dtype).eps / 4 * max(1.0, reference.float().pow(2).mean().sqrt().item())


def rms_bound(noise: float, reference: torch.Tensor, dtype: torch.dtype) -> float:
    return FACTOR * max(noise, unit(reference, dtype))


def step_bound(noise_max: float, reference: torch.Tensor, dtype: torch.dtype) -> float:
    """The logit bound at a parting step, where two half-precision runs are compared with each other: each may be
    FACTOR x the unsharded model's largest logit distance from fp32 away from the fp32 result, so the two may be
    twice that apart."""
    return 2 * FACTOR * max(noise_max, torch.finfo(dtype).eps * max(1.0, reference.abs().max().item()))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")


def rms_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).pow(2).mean().sqrt().item() if a.shape == b.shape else float("inf")


def hidden_state_names(model: nn.Module, encoder_states: int, total: int) -> list[str]:
    """A name for each hidden state of `_run_model`'s list: the layer whose output it is (`model.layers.3`), the
    embeddings, or `hidden_states[i]` where the list does not map onto a list of layers."""
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and name]

    def layers_of(count: int, part: str) -> list[str] | None:
        found = [name for name, module in lists if len(module) == count - 1 and (not part or part in name)]
        if not found:
            return None
        path = min(found, key=len)
        return [f"the {part + ' ' if part else ''}embeddings"] + [f"{path}.{i}" for i in range(count - 1)]

    if encoder_states:
        names = (layers_of(encoder_states, "encoder") or [None] * encoder_states) + (
            layers_of(total - encoder_states, "decoder") or [None] * (total - encoder_states))
    else:
        names = layers_of(total, "") or [None] * total
    return [n if n else f"hidden_states[{i}]" for i, n in enumerate(names)]


def first_beyond(got: list[torch.Tensor], exact: list[torch.Tensor], noise: list[float], dtype: torch.dtype):
    """(index, distance, bound) of the first hidden state whose RMS distance from fp32 is beyond its bound, or None."""
    for i, (a, b, n) in enumerate(zip(got, exact, noise)):
        limit = rms_bound(n, b, dtype)
        distance = rms_diff(a, b)
        if distance > limit:
            return i, distance, limit
    return None


def token_verdict(mode: str, got: dict, want: dict, logit_bound: float) -> tuple[bool, str, dict]:
    """Token ids of one decoding mode against the reference's: identical, or each parting row judged at the step
    where it parts (see the module's docstring). `got`/`want`: {"ids": [rows, length], "steps": [rows, new tokens,
    vocab] logits of each step on the row's own prefix}."""
    a, b = got["ids"], want["ids"]
    width = min(a.shape[1], b.shape[1])
    differ = a[:, :width] != b[:, :width]
    rows = [r for r in range(a.shape[0]) if differ[r].any() or (a.shape[1] != b.shape[1] and r == 0)]
    if not rows and a.shape == b.shape:
        return True, f"{mode} token ids: identical to unsharded", {"identical": True, "partings": []}
    partings = []
    for r in rows:
        col = int(differ[r].nonzero()[0]) if differ[r].any() else width
        partings.append(_judge(mode, r, col, a, b, got["steps"], want["steps"], logit_bound))
    ok = all(p["near_tie"] for p in partings)
    first = min(partings, key=lambda p: (p["new_token"], p["row"]))
    where = f"(row {first['row']}, new token {first['new_token']})"
    if first["logit_diff"] is None:
        detail = "where one of the two had stopped"
    else:
        detail = (f"the reference's top-2 margin there {first['top2_margin']:.3g}"
                  + (f", its margin to the sharded model's token {first['choice_margin']:.3g}" if mode == "greedy" else "")
                  + f", logits there differ by {first['logit_diff']:.3g} (bound {logit_bound:.3g})")
    verdict = "at a near-tie (rounding)" if first["near_tie"] else "beyond rounding"
    bad = [p for p in partings if not p["near_tie"]]
    text = (f"{mode} token ids: {len(partings)} of {a.shape[0]} rows part from unsharded, first at {where} {verdict}: "
            f"{detail}" + (f"; {len(bad)} parting(s) beyond rounding" if bad and not ok and bad[0] is not first else ""))
    return ok, text, {"identical": False, "partings": partings}


def _judge(mode, row, col, a, b, got_steps, want_steps, logit_bound) -> dict:
    start_a, start_b = a.shape[1] - got_steps.shape[1], b.shape[1] - want_steps.shape[1]
    step = col - start_b
    record = {"row": row, "new_token": step, "logit_diff": None, "top2_margin": None, "choice_margin": None,
              "near_tie": False}
    if start_a != start_b or not (0 <= step < min(got_steps.shape[1], want_steps.shape[1])) or col >= min(
            a.shape[1], b.shape[1]):
        return record
    mine, ref = got_steps[row, step].float(), want_steps[row, step].float()
    top2 = ref.topk(2).values
    diff = (mine - ref).abs().max().item()
    choice = (ref[b[row, col]] - ref[a[row, col]]).item()
    near = diff <= logit_bound and (mode != "greedy" or choice <= 2 * logit_bound)
    record.update(logit_diff=diff, top2_margin=(top2[0] - top2[1]).item(), choice_margin=choice, near_tie=near)
    return record
