"""How long a source and a target may be for an encoder-decoder with learned (absolute) positions: longer ones
index past the position embedding, an `IndexError` deep in the forward (found with LED, whose decoder has 1,024
positions and upstream's default `--val_max_target_length` 128 fits, but a small one's 64 do not). Checked before
the data is tokenized, in one line naming the flag and the limit. Relative positions (T5) have no limit here."""

from __future__ import annotations

from ..errors import InferenceSetupError

# attribute names, most specific first: LED's own, Whisper's and Speech2Text's, then the shared one of BART,
# mBART, Pegasus and Marian (whose encoder and decoder have as many positions each)
ENCODER_POSITIONS = ("max_encoder_position_embeddings", "max_position_embeddings")
DECODER_POSITIONS = ("max_decoder_position_embeddings", "max_target_positions", "max_position_embeddings")


def _first(config, names) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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


def check_sources_fit(config, input_ids, split: str, max_source_length: int) -> None:
    """The data-driven form for a script whose `--max_source_length` default exceeds many models' positions
    (upstream's run_translation.py: 1,024, Marian has 512): one `InferenceSetupError` only where a tokenized,
    truncated source is longer than the encoder's positions, giving the count."""
    limit = _first(config, ENCODER_POSITIONS)
    if limit is None:
        return
    over = sum(len(ids) > limit for ids in input_ids)
    if over:
        raise InferenceSetupError(f"{over} of {len(input_ids)} {split} sources are longer than the model's {limit} "
                                  f"positions (cut at --max_source_length {max_source_length}); valid: "
                                  f"--max_source_length at most {limit}")
