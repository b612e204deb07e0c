"""predict/positions.py: sources and targets longer than an encoder-decoder's learned positions end in one line naming the
flag and the limit (they were an IndexError in the forward: LED's decoder, found by the summarization example)."""

import pytest
import transformers as tr

from ds_inference_integration import InferenceSetupError
from ds_inference_integration.predict.positions import check_lengths_fit, check_sources_fit, decoder_positions


def test_each_family_s_decoder_positions():
    assert decoder_positions(tr.LEDConfig(max_encoder_position_embeddings=512, max_decoder_position_embeddings=64)) == 64
    assert decoder_positions(tr.BartConfig(max_position_embeddings=96)) == 96
    assert decoder_positions(tr.WhisperConfig(max_target_positions=48)) == 48
    assert decoder_positions(tr.Speech2TextConfig(max_target_positions=40)) == 40
    assert decoder_positions(tr.T5Config()) is None  # relative positions: no limit
    composite = tr.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(
        tr.Wav2Vec2Config(), tr.BartConfig(max_position_embeddings=32, is_decoder=True, add_cross_attention=True))
    assert decoder_positions(composite) == 32


def test_a_target_or_source_beyond_the_positions_is_one_line():
    led = tr.LEDConfig(max_encoder_position_embeddings=512, max_decoder_position_embeddings=64)
    with pytest.raises(InferenceSetupError, match=r"^--val_max_target_length 128 is longer than the model's 64 "
                                                  r"decoder positions; valid: at most 64$"):
        check_lengths_fit(led, source={"--max_source_length": 512}, target={"--val_max_target_length": 128})
    with pytest.raises(InferenceSetupError, match=r"^--max_source_length 1024 is longer than the model's 512 positions"):
        check_lengths_fit(led, source={"--max_source_length": 1024})
    check_lengths_fit(led, source={"--max_source_length": 512}, target={"--val_max_target_length": 64,
                                                                      "--generation_max_length": None})
    check_lengths_fit(tr.T5Config(), source={"--max_source_length": 10_000}, target={"--val_max_target_length": 10_000})


def test_sources_are_checked_by_their_lengths_where_the_flag_default_is_larger():
    """run_translation.py's --max_source_length defaults to 1,024 (upstream's); Marian has 512 positions: only a
    source that is really longer is refused, with the count."""
    marian = tr.MarianConfig(max_position_embeddings=8)
    check_sources_fit(marian, [[1] * 8, [1] * 3], "test", 1024)
    with pytest.raises(InferenceSetupError, match=r"^1 of 2 test sources are longer than the model's 8 positions "
                                                  r"\(cut at --max_source_length 1024\); valid: --max_source_length at "
                                                  r"most 8$"):
        check_sources_fit(marian, [[1] * 9, [1] * 3], "test", 1024)
