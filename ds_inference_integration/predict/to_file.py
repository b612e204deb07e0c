"""The Trainer's `predict_to_file`: the checks and preparation upstream's `predict` would do (generation defaults,
unused columns, dropped last batch, length grouping), then the streamed, resumable run (`streaming`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InferenceSetupError
from . import replicas
from .length_grouping import length_grouped
from .positions import check_trainer_inputs_fit
from .streaming import StreamJob, run_identity, streamed_predict


def generation_defaults(args, gen_kwargs: dict) -> dict:
    """`gen_kwargs` with the defaults upstream's `Seq2SeqTrainer.predict` takes from the arguments
    (`--generation_max_length` where neither length is given, `--generation_num_beams`): its own code does this
    inside `predict`, which a streamed run does not call."""
    gen_kwargs = dict(gen_kwargs)
    if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None \
            and args.generation_max_length is not None:
        gen_kwargs["max_length"] = args.generation_max_length
    if gen_kwargs.get("num_beams") is None and args.generation_num_beams is not None:
        gen_kwargs["num_beams"] = args.generation_num_beams
    return gen_kwargs


def predict_to_file(trainer, test_dataset, metric, metric_key_prefix: str, predictions_file: str,
                    fresh: bool | None, gen_kwargs: dict) -> dict:
    """`trainer.predict_to_file` (its docstring says what a user gets)."""
    args = trainer.args
    if not getattr(args, "predict_with_generate", False):
        raise InferenceSetupError("predict_to_file writes generated text: pass --predict_with_generate")
    tokenizer = trainer.processing_class
    if tokenizer is None or not hasattr(tokenizer, "batch_decode"):
        raise InferenceSetupError("predict_to_file decodes with the Trainer's processing_class: pass the tokenizer")
    check_trainer_inputs_fit(args, trainer.model, test_dataset, gen_kwargs)
    gen_kwargs = trainer._gen_kwargs = generation_defaults(args, gen_kwargs)  # where upstream's predict keeps them
    if args.remove_unused_columns and hasattr(test_dataset, "column_names"):
        test_dataset = trainer._remove_unused_columns(test_dataset, description="test")
    test_dataset = replicas.full_batches(test_dataset, args, trainer.topology)  # as predict (upstream's loop)
    test_dataset, order, padding = length_grouped(args, test_dataset, metric_key_prefix)
    trainer.model.eval()
    seed = args.seed if trainer.loop.samples({}) else None
    job = StreamJob(dataset=test_dataset, order=order, topology=trainer.topology, output_dir=Path(args.output_dir),
                    batch_size=args.eval_batch_size, identity=lambda: run_identity(
                        trainer.model, test_dataset, order, trainer.topology, args.eval_batch_size, gen_kwargs, seed),
                    collate=trainer.data_collator, generate=trainer.loop.generate_batch, tokenizer=tokenizer)
    if fresh is None:  # InferenceArgumentParser keeps transformers 4's --overwrite_output_dir on the arguments
        fresh = bool(getattr(args, "overwrite_output_dir", False))
    metrics = streamed_predict(job, metric=metric, metric_key_prefix=metric_key_prefix,
                               predictions_file=predictions_file, fresh=fresh)
    metrics.update(padding)
    trainer.loop.lockstep_metric(metrics, metric_key_prefix)
    return metrics
