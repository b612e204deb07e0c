"""A speech model's `--language` and `--task` (upstream's run_speech_recognition_seq2seq.py arguments) against its
generation config: a multilingual Whisper knows its languages and tasks; any other model takes neither (upstream
refuses a language for an English-only checkpoint once the model has loaded; Whisper's generate refuses an unknown
language or task only once every rank has loaded and the first batch runs)."""

from __future__ import annotations

from ..errors import InferenceSetupError


def is_multilingual(generation_config) -> bool:
    return bool(getattr(generation_config, "is_multilingual", False))


def check_language_and_task(generation_config, language: str | None, task: str | None) -> None:
    """One `InferenceSetupError` for a language or task `generation_config` (None: the model has none) lacks."""
    if not is_multilingual(generation_config):
        if language is not None or task not in (None, "transcribe"):
            raise InferenceSetupError(f"--language {language} --task {task}: the model is not a multilingual Whisper "
                                      "(its generation config has no languages); valid: neither flag")
        return
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    tasks = getattr(generation_config, "task_to_id", None) or {}
    if task is not None and task not in tasks:
        raise InferenceSetupError(f"--task {task!r} is not a task of this model; valid: {', '.join(sorted(tasks))}")
    if language is not None:
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        if f"<|{code}|>" not in generation_config.lang_to_id:
            known = sorted(t.strip("<|>") for t in generation_config.lang_to_id)
            raise InferenceSetupError(f"--language {language!r} is not a language of this model; valid: a name or "
                                      f"code of {', '.join(known[:20])}{' ...' if len(known) > 20 else ''}")
