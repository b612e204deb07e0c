"""Reading a model's config the same way everywhere."""

from __future__ import annotations


def text_config(config: object) -> object:
    """The config of the part that generates text: transformers' `get_text_config()`, or its decoder's where the
    config holds two text configs (MusicGen's `text_encoder` and `decoder`, where `get_text_config()` raises "would be
    ambiguous"); the config itself where it has no such method."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError:
        return config.get_text_config(decoder=True)
