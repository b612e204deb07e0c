"""One predict or evaluate loop under a layout: what the Trainer mixin's `prediction_step`, `evaluation_loop` and
`_get_num_items_in_batch` do around upstream's, and the speed metrics of `evaluate` / `predict`. The mixin
(`trainer.DeepSpeedInferenceMixin`) says where upstream's Trainer calls each; this module says what each does.

Each step: the lock-step guard, one sampling seed per batch of the whole data set, the rows accelerate padded the
last batches with taken off before generating, and a decoder-only model's new tokens. Each loop: our gather (over
the data-parallel group only, `gather.replica_gather`) and an exact row check. The state kept between the Trainer's
calls (the batch index, the running batch's rows, the loop's example count) is this object's."""

from __future__ import annotations

import time

import torch

from . import gather, results
from .lockstep import check_lockstep
from .sampling import batch_seed, samples


class PredictLoop:
    """The running predict/evaluate loop of one Trainer (`trainer`: its args, model, accelerator, `topology` and
    `process_groups`, read at each call: sharding replaces the model after this is made)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.batch_index = -1  # this replica's batch in the running loop: the sampling seed and the guard read it
        self.batch_examples = 0  # rows of the running batch: the gather weighs its loss by them
        self.loop_examples: int | None = None  # the running loop's data set size, where it has one
        self.evaluating = False  # inside evaluation_loop: see items_in_batch
        self.lockstep_seconds = 0.0

    # One prediction step ------------------------------------------------------------------------------------

    def step(self, upstream_step, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """`upstream_step` (upstream's `prediction_step`) on this replica's batch, in lock step with its TP peers."""
        t = self.trainer
        self.batch_index += 1
        if "labels" in inputs and inputs["labels"] is None:
            # upstream's DataCollatorForSeq2Seq gives `labels: None` for data without references, and upstream's
            # prediction_step takes the key for labels and runs the model without decoder inputs (a crash)
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        self.batch_examples = gather.batch_examples(inputs)
        if t.topology.tp_size > 1 and t.inference_args.lockstep_guard:
            start = time.perf_counter()
            check_lockstep(inputs, t.topology, t.process_groups.tp, t.args.device, self.batch_index)
            self.lockstep_seconds += time.perf_counter() - start
        prompt_width = inputs["input_ids"].shape[1] if "input_ids" in inputs else 0
        rows, real = self.batch_examples, self.real_rows()
        padded = real is not None and real < rows  # accelerate's padding of the last batches: see gather.real_rows
        if padded:
            inputs = gather.slice_rows(inputs, rows, max(real, 1))
        # when sampling, one seed per batch of the whole data set, as one process's (`sampling.batch_seed`)
        with batch_seed(t.args, t.topology, self.batch_index, self.samples(gen_kwargs)):
            loss, tokens, labels = upstream_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys,
                                                 **gen_kwargs)
        if padded:  # back to the batch's row count: the gather trims these rows off
            tokens, labels = gather.pad_rows(tokens, max(real, 1), rows), gather.pad_rows(labels, max(real, 1), rows)
        if real is not None and isinstance(loss, torch.Tensor):
            loss = loss.as_subclass(gather.BatchLoss)  # so that the gather weighs it as one process does
        if tokens is not None and getattr(t.args, "predict_with_generate", False) and not getattr(
                t.model.config, "is_encoder_decoder", False):
            tokens = tokens[:, prompt_width:]  # decoder-only: return the new tokens, not the (left-padded) prompt
        return loss, tokens, labels

    def real_rows(self) -> int | None:
        """How many rows of this replica's batch are examples, when the loop may have padded it (None: all are):
        `gather.real_rows`."""
        t = self.trainer
        return gather.real_rows(self.loop_examples, self.batch_index, t.topology.dp_size, t.topology.dp_rank,
                                t.args.eval_batch_size, t.accelerator.dataloader_config.split_batches)

    def samples(self, gen_kwargs: dict | None) -> bool:
        """Whether this prediction step samples (`sampling.samples`: the call's kwargs, else those kept by predict)."""
        t = self.trainer
        return samples(t.args, t.model, gen_kwargs or getattr(t, "_gen_kwargs", None))

    def generate_batch(self, k: int, inputs: dict):
        """The token ids of batch `k` of this replica, through the Trainer's `prediction_step` (which counts
        `batch_index` up to `k`: the sampling seed and the lock-step guard read it). Streamed predict's generate."""
        self.batch_index = k - 1
        _, tokens, _ = self.trainer.prediction_step(self.trainer.model, inputs, prediction_loss_only=False)
        return tokens

    # The loop around the steps ------------------------------------------------------------------------------

    def run(self, upstream_loop, dataloader, *args, **kwargs):
        """`upstream_loop` (upstream's `evaluation_loop`) with our gather, each batch's loss as one process takes it,
        and the rows it returns checked: one per example and sequence, exactly."""
        t = self.trainer
        # Seq2SeqTrainer.predict/evaluate reset gather_function before every call: set ours here.
        self.batch_index = -1
        t.gather_function = self.gather
        dataset = getattr(dataloader, "dataset", None)
        self.loop_examples = len(dataset) if hasattr(dataset, "__len__") else None
        # each batch's loss over its own label tokens, as one process takes it: see items_in_batch
        averaged = t.args.average_tokens_across_devices
        t.args.average_tokens_across_devices, self.evaluating = False, True
        try:
            output = upstream_loop(dataloader, *args, **kwargs)
        finally:
            self.loop_examples = None
            t.args.average_tokens_across_devices, self.evaluating = averaged, False
        n, k = output.num_samples, gather.rows_per_example(t.args, t.model, getattr(t, "_gen_kwargs", None))
        if getattr(t.args, "dataloader_drop_last", False):  # upstream's loop drops a short last batch of each
            n -= n % (t.args.eval_batch_size * t.topology.dp_size)  # process, and counts it in num_samples
        gather.check_row_counts(output, n, k)
        return output

    def gather(self, data):
        """The loop's gather (`gather_function`): over the data-parallel group only, the padding of the last
        batches taken off, a batch's loss weighed as one process weighs it (`gather.replica_gather`)."""
        t = self.trainer
        return gather.replica_gather(data, t.topology.dp_size, t.process_groups.dp, t.accelerator.gradient_state,
                                     self.batch_examples, t.args.eval_batch_size)

    def items_in_batch(self, count):
        """While evaluating, `count` (upstream's label tokens of a batch) made the label tokens of this batch alone,
        as one process counts them for the same batch.

        With `average_tokens_across_devices` (transformers 5's default), a model that takes loss kwargs (Llama,
        GPT-2...) divides its batch's loss sum by the tokens of every process's batch, divided by the TP size, and
        `compute_loss` multiplies by the process count over the TP size: a replica's loss is its batch mean only
        where every replica's batch holds as many tokens. The last ones do not, and eval_loss parted from one
        process's (a random Llama, 13 examples, batch 4, dp 2: 6.5691 against 6.5979, 2026-12-04). So `run` turns
        that averaging off (no all-process sum, no scale in `compute_loss`), and here upstream's division by the
        ranks that share a batch, which assumes the sum, is undone. The replicas' batch means are then weighed as
        one process weighs its batches (`gather.gather_batch_loss`). Training keeps upstream's."""
        t = self.trainer
        if self.evaluating and count is not None:
            count = count * (t.get_tp_size() * t.get_cp_size() * t.get_sp_size())
        return count

    # Speed metrics ------------------------------------------------------------------------------------------

    def speed_metrics(self, metrics: dict, prefix: str, dataset) -> dict:
        """Steps per second per replica (`results.speed_metrics`), and the lock-step guard's time at tp > 1."""
        t = self.trainer
        self.lockstep_metric(metrics, prefix)
        count = len(dataset) if hasattr(dataset, "__len__") else None
        return results.speed_metrics(metrics, prefix, count, t.args.eval_batch_size, t.topology.dp_size)

    def lockstep_metric(self, metrics: dict, prefix: str) -> None:
        if self.trainer.topology.tp_size > 1:
            metrics[f"{prefix}_lockstep_guard_seconds"] = round(self.lockstep_seconds, 4)
            self.lockstep_seconds = 0.0
