"""The admitted rows' prompts through the model in one forward, with transformers' own cache: what a step of the
step engine (`serve/steps.py`) runs for its admissions before its slots take each row's keys, values and states.
Decoder-only prompts are packed into one sequence (each row at its own positions under a block-diagonal causal mask)
where that costs less than right-padding them (`packing_pays`), right-padded otherwise, left-padded where the model
keeps states; an encoder-decoder's prompts run their encoder together (and, for the first rows a server takes, the
decoder's first step). The model's facts these forwards read are found once, here."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from ..policy.configs import text_config
from .slots import state_layers

# At most this many tokens prefilled packed: the mask, and the attention weights where attention is computed with
# them, are [packed tokens]^2 a head (1,024: 4 MiB a head in fp32), where right-padded rows hold rows x longest^2;
# a wide model's cost rule alone would pack 16 rows of 2,048 tokens into one sequence of ~20k (1.6 GB a head)
PACKED_TOKENS = 1024


def top_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple]:
    """Positions' log probabilities as OpenAI's `logprobs` gives them, one per row of `logits` (`[positions,
    vocab]`): (that of its token in `tokens`, ((id, log probability) of the `k` likeliest, likeliest first)), from
    the model's own logits (before a row's penalties, temperature or masks: vLLM's default, "raw" log
    probabilities), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, index[:, None])[:, 0].tolist()
    if k == 0:
        return [(lp, ()) for lp in chosen]
    top = torch.topk(logprobs, k)
    return [(lp, tuple(zip(ids, values))) for lp, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist())]


class Prefill:
    """The prefill forwards of one model, and the facts of the model they read (found once)."""

    def __init__(self, model, tokenizer, device, pack_prefill: bool = True):
        self.model, self.device = model, device
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        text = text_config(model.config)
        # sliding-window attention: every key kept (the prefill's cache is transformers' plain one), the window the
        # decoding step's mask's
        self.window = getattr(text, "sliding_window", None)
        # state-space or linear-attention layers (`slots.SlotStateLayer`): a state is the sum of every token before,
        # so rows are prefilled left-padded (the padding zeroed by the model's own mask, as generate batches them),
        # never packed or right-padded (the tokens after a row's own would enter its state)
        self.states = not self.encoder_decoder and state_layers(model)
        # a decoder-only model's admitted prompts prefilled packed (`packed`): one sequence, each row's positions
        # from 0 and a block-diagonal causal mask, no padding; where the probe finds that wrong, right-padded
        self.pack = pack_prefill and not self.encoder_decoder and self.window is None and not self.states
        self.width = next((w for w in (getattr(text, n, None) for n in ("hidden_size", "n_embd", "d_model"))
                           if isinstance(w, int)), 1024)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        parameters = set(inspect.signature(model.forward).parameters)
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self.source_state = None  # an encoder-decoder's encoder output: (width, dtype), for the steps' stand-in

    def run(self, rows: list[tuple], wants: list | None = None) -> tuple:
        """The rows' prompts (each `(prompt ids, ids the row starts from)`: the prompt again, or an encoder-decoder's
        decoder start) through the model at once: (its cache, each row's last logits in float32, where each row is in
        the cache: (its batch row, its first position), and the prompt log probabilities of the rows whose spec is
        given in `wants` (those that asked for them: every position's logits go through the head then), by row id).
        Several decoder-only rows are prefilled packed where `self.pack` and `packing_pays` say so."""
        n, prompts = len(rows), [list(prompt) for prompt, _ in rows]
        if self.pack and n > 1 and not any(spec is not None for spec in wants or ()) and self.packing_pays(prompts):
            prefilled, logits, places = self.packed(prompts)
            prompt = {}
        elif self.states:
            prefilled, logits, places, prompt = self.left_padded(prompts, wants)
        else:
            prefilled, logits, places, prompt = self.padded_prefill(rows, prompts, wants)
        return prefilled, logits.to(dtype=torch.float32), places, prompt

    def padded(self, prompts: list, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts padded to the longest, on the right (or `left`): (ids, attention mask)."""
        width = max(len(p) for p in prompts)

        def pad(row, fill):
            return [fill] * (width - len(row)) + row if left else row + [fill] * (width - len(row))

        ids = torch.tensor([pad(list(p), self.pad) for p in prompts], dtype=torch.long, device=self.device)
        mask = torch.tensor([pad([1] * len(p), 0) for p in prompts], dtype=torch.long, device=self.device)
        return ids, mask

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """An encoder-decoder's encoder over padded prompts (`_padded`) at once: its last hidden state."""
        with torch.no_grad():
            state = self.model.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True).last_hidden_state
        self.source_state = (state.shape[-1], state.dtype)
        return state

    def packed(self, prompts: list[list[int]]) -> tuple:
        """Decoder-only prompts through the model as one sequence: each row's positions from 0, each token seeing its
        own row's tokens before it (an additive block-diagonal causal mask, as the decoding steps pass theirs), no
        padding; only each row's last position through the head (`packing_pays` says when). A forward of 16 rows of
        4 to 16 tokens took 78 ms right-padded to the longest, 50 packed (256 against 154 tokens; 303 against 216 ms
        at 16 to 64 tokens; a random Llama of width 512, 4 layers, 1 thread, 2026-12-07). (cache, each row's last
        logits, places)."""
        sizes = [len(p) for p in prompts]
        device = self.device
        ids = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(size, device=device) for size in sizes])
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        seen = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
        dtype = self.model.dtype
        mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        last = torch.tensor([start + size - 1 for start, size in zip(starts, sizes)], device=device)
        prefilled = DynamicCache(config=self.model.config)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions[None], use_cache=True,
                             **{self.cache_name: prefilled}, **({"logits_to_keep": last} if self.keep else {}))
        logits = out.logits[0] if self.keep else out.logits[0, last]
        return prefilled, logits, [(0, start) for start in starts]

    def packing_pays(self, prompts: list[list[int]]) -> bool:
        """Whether a packed prefill costs less than a right-padded one, by their multiply-adds: per token ~6 x width
        for the projections and MLP (against 1 per attention score), and attention over every pair of the packed
        sequence's tokens, masked or not, where padded rows attend within their own width. 16 rows of L/4 to L
        tokens on a random Llama of width 512 (4 layers, 1 thread, `bench steps --together 16`, runs back to back,
        2026-12-07): packed 0.81x the padded time at L 16, 0.65x at 64, 1.06x at 256 (16 x 256 padded tokens against
        2,560 packed, whose 6.6M attention scores outweigh the tokens saved)."""
        sizes = [len(p) for p in prompts]
        total, longest, n = sum(sizes), max(sizes), len(sizes)
        if total > PACKED_TOKENS:
            return False
        per_token = 6 * self.width
        return total * per_token + total * total <= n * longest * per_token + n * longest * longest

    def padded_prefill(self, rows: list[tuple], prompts: list[list[int]], wants: list | None) -> tuple:
        """`run`'s way for an encoder-decoder, one row, or a model not packed: right-padded to the longest. (cache,
        each row's last logits, places, prompt log probabilities by row id)."""
        n = len(rows)
        ids, mask = self.padded(prompts)
        width = ids.shape[1]
        places, prompt = [(b, 0) for b in range(n)], {}
        with torch.no_grad():
            if self.encoder_decoder:
                encoded = BaseModelOutput(last_hidden_state=self.encode(ids, mask))
                prefilled = EncoderDecoderCache(DynamicCache(config=self.model.config),
                                                DynamicCache(config=self.model.config))
                start = torch.tensor([list(first) for _, first in rows], dtype=torch.long, device=self.device)
                out = self.model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=start,
                                 use_cache=True, **{self.cache_name: prefilled}, **self.keep)
                logits = out.logits[:, -1]
            else:
                # with a window, transformers' sliding layers keep only its last keys: the plain cache keeps them all
                prefilled = DynamicCache() if self.window else DynamicCache(config=self.model.config)
                last = [len(p) - 1 for p in prompts]
                keep = {}
                whole = any(spec is not None for spec in wants or ())
                if self.keep and not whole:  # only the rows' last positions through the head (generate: logits_to_keep=1)
                    kept = sorted(set(last))
                    keep = {"logits_to_keep": 1 if kept == [width - 1] else torch.tensor(kept, device=self.device)}
                    last = [kept.index(i) - len(kept) for i in last]
                out = self.model(input_ids=ids, attention_mask=mask, use_cache=True,
                                 position_ids=torch.arange(width, device=self.device)[None].expand(n, -1),
                                 **{self.cache_name: prefilled}, **keep)
                logits = out.logits[torch.arange(n), torch.tensor(last)]
                for b, spec in enumerate(wants or ()):
                    if spec is not None:
                        n_b = len(prompts[b])
                        prompt[spec.id] = top_logprobs(out.logits[b, :n_b - 1], prompts[b][1:], spec.logprobs)
        return prefilled, logits, places, prompt

    def left_padded(self, prompts: list[list[int]], wants: list | None) -> tuple:
        """A state-keeping model's prompts through it at once, left-padded to the longest (generate's own batching of
        such models: the model's 2D mask zeroes the padding's inputs, so a row's states start from zero at its first
        token, and its attention layers' keys sit at the last `len(prompt)` positions); each row's positions from 0 at
        its first token. (cache, each row's last logits, places: (its batch row, where its first token is), prompt
        log probabilities by row id)."""
        ids, mask = self.padded(prompts, left=True)
        width = ids.shape[1]
        pads = [width - len(p) for p in prompts]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        whole = any(spec is not None for spec in wants or ())
        prefilled = DynamicCache(config=self.model.config)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self.cache_name: prefilled}, **({} if whole else self.keep))
        prompt = {spec.id: top_logprobs(out.logits[b, pads[b]:width - 1], prompts[b][1:], spec.logprobs)
                  for b, spec in enumerate(wants or ()) if spec is not None}
        return prefilled, out.logits[:, -1], [(b, pad) for b, pad in enumerate(pads)], prompt
