"""Beam search in the step engine: a request's `num_beams` beams are a group of slots that decode beside every other
row, reordered only within the request.

`BeamGroup` holds one request's search as transformers' vectorised beam search holds a batch of one
(`GenerationMixin._beam_search`, transformers 5): running and finished sequences, their scores and beam indices,
the early-stop heuristic; each step it takes the group's logits from the shared decoding step and runs the same
helpers generate runs (`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
`_update_finished_beams`, `_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`), with the
processors and stopping criteria generate builds from the same generation config (`length_penalty`,
`early_stopping`, `num_return_sequences`, the minimum, EOS, the maximum length) and our stop strings. So a beam
request's sequences are those of generate run on that request alone. After each step the group's slots are
reordered as generate reorders its cache (`SlotCache.reorder`: a copy within the group's own slots)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from .rules import Refused, unusable


class _StopStrings(StoppingCriteria):
    """A candidate whose new text holds one of the request's stop strings ends as a finished hypothesis (what
    `rules.BeamSteps` does in the batch engine, as transformers' StopStringCriteria would)."""

    def __init__(self, stops: tuple[str, ...], start: int, tokenizer):
        self.stops, self.start, self.tokenizer = stops, start, tokenizer

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)


class BeamGroup:
    """One beam request: `slots` (its num_beams slots, in beam order) and the search's state; `start(config)` gives
    what the beams start from once `config`'s special tokens are prepared (a decoder-only model's prompt, an
    encoder-decoder's decoder start); the request's prompt is what generate's encoder-side processors read."""

    def __init__(self, model, spec, key, slots: list[int], config, eos: list[int], tokenizer, device, start):
        self.model, self.spec, self.key, self.slots, self.device = model, spec, key, slots, device
        self.num_beams = key.num_beams
        model._prepare_special_tokens(config, True, device=device)
        self.start = start(config)
        self.prompt_len = len(self.start)
        self.max_length = self.prompt_len + config.max_new_tokens
        config.max_length = self.max_length  # generate's: the prompt (the decoder's, for an encoder-decoder) + new
        self.config, self.eos = config, eos
        self.length_penalty, self.early_stopping = config.length_penalty, config.early_stopping
        input_ids = torch.tensor([self.start], dtype=torch.long, device=device)
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=self.prompt_len,
            encoder_input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long, device=device),
            logits_processor=LogitsProcessorList(), device=device, model_kwargs={})
        own = StoppingCriteriaList([_StopStrings(key.stop, self.prompt_len, tokenizer)] if key.stop else [])
        self.stopping = model._get_stopping_criteria(generation_config=config, stopping_criteria=own,
                                                     tokenizer=tokenizer)
        eos_tensor = config._eos_token_tensor
        n_eos = eos_tensor.shape[0] if eos_tensor is not None else 0
        self.beams_to_keep = max(2, 1 + n_eos) * self.num_beams
        self.top_num_beam_mask = torch.cat((torch.ones(self.num_beams, dtype=torch.bool),
                                            torch.zeros(self.beams_to_keep - self.num_beams, dtype=torch.bool))
                                           ).to(device)
        pad = config._pad_token_tensor
        fill = pad or eos_tensor[0] if eos_tensor is not None else -1
        b, length = self.num_beams, self.max_length
        self.running_sequences = torch.full((1, b, length), fill_value=int(fill), dtype=torch.int64, device=device)
        self.running_sequences[:, :, :self.prompt_len] = input_ids[:, None, :]
        self.sequences = self.running_sequences.clone()
        self.running_beam_scores = torch.zeros((1, b), dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((1, b), fill_value=-1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((1, b), dtype=torch.bool, device=device)
        self.unsatisfied = torch.ones((1, 1), dtype=torch.bool, device=device)
        self.hits = torch.zeros((1, b), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full((1, b, length - self.prompt_len), fill_value=-1, dtype=torch.int32,
                                               device=device)
        self.beam_indices = self.running_beam_indices.clone()
        self.cur_len = self.prompt_len
        self.done = False

    def last_tokens(self) -> list[int]:
        """Each beam's last token, in slot order: what the next step feeds."""
        return self.running_sequences[0, :, self.cur_len - 1].tolist()

    def position(self) -> int:
        """The position of the token each beam feeds next (every beam of a request is at the same one)."""
        return self.cur_len - 1

    def step(self, logits: torch.Tensor) -> list[int]:
        """The beams' logits (`[num_beams, vocab]`, float32) -> for each slot, the beam (index into `slots`) whose
        cache it continues. Sets `done` when the search ends. Raises Refused when no beam has a token to take."""
        m, b = self.model, self.num_beams
        flat = self.running_sequences[0, :, :self.cur_len]
        log_probs = self.processors(flat, nn.functional.log_softmax(logits, dim=-1))
        verdicts = unusable(log_probs, self.cur_len - self.prompt_len)
        broken = next((v for v in verdicts if v is not None and v[0] == 500), None)
        if broken or all(v is not None for v in verdicts):
            raise Refused(*(broken or verdicts[0]))
        log_probs = (log_probs[None] + self.running_beam_scores[:, :, None]).reshape(1, -1)
        topk_log_probs, topk_sequences, topk_indices = m._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=self.running_sequences,
            running_beam_indices=self.running_beam_indices, cur_len=self.cur_len,
            decoder_prompt_len=self.prompt_len, do_sample=False, beams_to_keep=self.beams_to_keep, num_beams=b,
            batch_size=1)
        hits = self.stopping(topk_sequences[0, :, :self.cur_len + 1], None)
        self.hits = hits.reshape(1, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            m._get_running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs, topk_running_sequences=topk_sequences,
                topk_running_beam_indices=topk_indices, next_token_hits_stopping_criteria=self.hits, num_beams=b))
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = m._update_finished_beams(
            sequences=self.sequences, topk_running_sequences=topk_sequences, beam_scores=self.beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=self.beam_indices, topk_running_beam_indices=topk_indices,
            is_early_stop_heuristic_unsatisfied=self.unsatisfied, is_sent_finished=self.is_sent_finished,
            next_token_hits_stopping_criteria=self.hits, top_num_beam_mask=self.top_num_beam_mask, num_beams=b,
            cur_len=self.cur_len, decoder_prompt_len=self.prompt_len, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)
        sources = self.running_beam_indices[0, :, self.cur_len - self.prompt_len].tolist()
        self.cur_len += 1
        self.unsatisfied = m._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.unsatisfied, running_beam_scores=self.running_beam_scores,
            beam_scores=self.beam_scores, is_sent_finished=self.is_sent_finished, cur_len=self.cur_len,
            max_length=self.max_length, decoder_prompt_len=self.prompt_len, early_stopping=self.early_stopping,
            length_penalty=self.length_penalty)
        self.done = not bool(m._beam_search_has_unfinished_sequences(
            self.unsatisfied, self.is_sent_finished, self.hits, self.early_stopping))
        return sources

    def result(self, pad: int | None) -> tuple[list[list[int]], list[str]]:
        """The request's `num_return_sequences` sequences (new tokens only) and their reasons, as the batch engine
        answers a beam batch: each cut after its first EOS ("stop": the EOS kept, as a greedy row keeps it, so that
        `completion_tokens` counts it alike), else its padding stripped ("length")."""
        k = self.key.num_return_sequences
        sequences, indices = self.sequences[0, :k], self.beam_indices[0, :k]
        generated = int(((indices + 1).bool()).sum(dim=1).max())
        out, reasons = [], []
        for seq in sequences[:, self.prompt_len:self.prompt_len + generated].tolist():
            cut = next((j for j, t in enumerate(seq) if t in self.eos), None)
            if cut is not None:
                out.append(seq[:cut + 1])
            else:
                while seq and pad is not None and seq[-1] == pad:
                    seq = seq[:-1]
                out.append(seq)
            reasons.append("stop" if cut is not None else "length")
        return out, reasons
