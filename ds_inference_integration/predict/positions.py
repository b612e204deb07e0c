"""How long a source and a target may be for an encoder-decoder with learned (absolute) positions: longer ones
index past the position embedding, an `IndexError` deep in the forward (found with LED, whose decoder has 1,024
positions and upstream's default `--val_max_target_length` 128 fits, but a small one's 64 do not). The parser
checks the generated lengths upstream's arguments set against a local model's config, in one line naming the flag
and the limit (`check_lengths_fit`); the Trainer checks the sources and the generation length its caller gives
before any batch (`check_inputs_fit`). Relative positions (T5) have no limit here."""

from __future__ import annotations

from ..errors import InferenceSetupError
from ..policy.configs import text_config
from .length_grouping import input_lengths

# attribute names, most specific first: LED's own, Whisper's and Speech2Text's, then the shared one of BART,
# mBART, Pegasus and Marian (whose encoder and decoder have as many positions each)
ENCODER_POSITIONS = ("max_encoder_position_embeddings", "max_position_embeddings")
DECODER_POSITIONS = ("max_decoder_position_embeddings", "max_target_positions", "max_position_embeddings")
# a decoder-only model's: GPT-2's, older GPTs', ChatGLM's, then the shared one
SEQUENCE_POSITIONS = ("n_positions", "n_ctx", "seq_length", "max_position_embeddings")


def _first(config, names) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def encoder_positions(config) -> int | None:
    """An encoder-decoder's encoder positions, or None (relative positions: T5)."""
    return _first(config, ENCODER_POSITIONS)


def sequence_positions(config) -> int | None:
    """A decoder-only model's positions (prompt + generated tokens), or None where its config names none."""
    return _first(text_config(config), SEQUENCE_POSITIONS)


def decoder_positions(config) -> int | None:
    """The decoder's positions: of `config.decoder` for a composite model (SpeechEncoderDecoderModel)."""
    decoder = getattr(config, "decoder", None)
    return _first(decoder if decoder is not None and hasattr(decoder, "to_dict") else config, DECODER_POSITIONS)


def check_lengths_fit(config, source: dict[str, int | None] | None = None,
                      target: dict[str, int | None] | None = None) -> None:
    """`source` and `target`: flag -> the length it sets (None: unset). One `InferenceSetupError` for the first
    length beyond the encoder's or the decoder's positions."""
    for lengths, limit, side in ((source or {}, _first(config, ENCODER_POSITIONS), ""),
                                 (target or {}, decoder_positions(config), " decoder")):
        for flag, value in lengths.items():
            if limit is not None and value is not None and value > limit:
                raise InferenceSetupError(f"{flag} {value} is longer than the model's {limit}{side} positions; "
                                          f"valid: at most {limit}")


def source_lengths(dataset) -> list[int] | None:
    """Each example's `input_ids` length, or None where the data has none (speech features, an iterable data set)."""
    if "input_ids" not in (getattr(dataset, "column_names", None) or ()):
        return None
    return input_lengths(dataset)


def check_inputs_fit(config, dataset, gen_kwargs: dict, generation_max_length: int | None) -> None:
    """For an encoder-decoder with learned positions: every source within the encoder's positions, and a
    generation length the caller set (`max_length` / `max_new_tokens`, or --generation_max_length) within the
    decoder's. A model's own generation_config is not checked: generation may end long before its max_length."""
    if not getattr(config, "is_encoder_decoder", False):
        return
    limit = _first(config, ENCODER_POSITIONS)
    lengths = source_lengths(dataset) if limit is not None else None
    if lengths:
        over = sum(n > limit for n in lengths)
        if over:
            raise InferenceSetupError(
                f"{over} of {len(lengths)} sources are longer than the model's {limit} positions (the longest has "
                f"{max(lengths)} tokens); valid: sources of at most {limit} tokens (upstream's examples: "
                f"--max_source_length {limit})")
    decoder = decoder_positions(config)
    if decoder is None:
        return
    if gen_kwargs.get("max_new_tokens") is not None:  # a decoder's length counts its start token
        name, value, start = "max_new_tokens", gen_kwargs["max_new_tokens"], 1
    elif gen_kwargs.get("max_length") is not None:
        name, value, start = "max_length", gen_kwargs["max_length"], 0
    elif generation_max_length is not None:
        name, value, start = "--generation_max_length", generation_max_length, 0
    else:
        return
    if value + start > decoder:
        raise InferenceSetupError(f"{name} {value} is longer than the model's {decoder} decoder positions; "
                                  f"valid: at most {decoder - start}")


def check_trainer_inputs_fit(args, model, dataset, gen_kwargs: dict) -> None:
    """`check_inputs_fit` for a Trainer's predict or evaluate: the sources and the generation length the caller set,
    one line before any batch runs (on every rank alike: the same data and arguments), not an IndexError in a
    rank's forward. With the flag or without: it is what the examples rely on for their sources (upstream's
    run_translation.py defaults to --max_source_length 1024, more than many models' positions)."""
    if dataset is None or isinstance(dataset, dict):
        return
    generate = getattr(args, "predict_with_generate", False)
    check_inputs_fit(getattr(model, "config", None), dataset, gen_kwargs if generate else {},
                     getattr(args, "generation_max_length", None) if generate else None)
