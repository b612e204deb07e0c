"""Trainer integration: shard once, feed every rank of a TP group the same batches, gather once per
data-parallel replica, and return exactly one row per input example, in input order."""

from __future__ import annotations

import datetime
import logging
import time
import uuid
import weakref
from pathlib import Path

import torch
from transformers import Seq2SeqTrainer, Trainer

from ..arguments import DeepSpeedInferenceArguments, world_size_from_env
from ..deepspeed_compat import unpin_world_group
from ..errors import InferenceSetupError
from ..load.loaders import is_skeleton
from ..policy.schema import Policy
from ..run import lifecycle
from ..shard.inject import ShardReport
from ..shard.setup import setup_inference
from ..topology import ProcessGroups, Topology
from . import gather, replicas, results
from .length_grouping import length_grouped, unsort
from .lockstep import check_lockstep
from .positions import check_trainer_inputs_fit
from .sampling import batch_seed, samples
from .streaming import StreamJob, run_identity, streamed_predict

logger = logging.getLogger(__name__)


def _lend_mesh(state, mesh) -> None:
    """`mesh` to accelerate's `state`, which is process-wide and outlives the Trainer: the mesh (which holds its
    groups) is taken back at exit, with the world group DeepSpeed pinned (`unpin_world_group`), so that the groups'
    threads end before the interpreter's teardown (`lifecycle.tear_down_at_exit`)."""
    lent = weakref.ref(mesh)
    state.device_mesh = mesh

    def release() -> None:
        if state.device_mesh is lent():
            state.device_mesh = None
        unpin_world_group()

    lifecycle.release_at_exit(release)


class DeepSpeedInferenceMixin:
    """Adds `--deepspeed_inference` to a `Trainer` (or `Seq2SeqTrainer`) subclass.

    Also fixes, with or without the flag, the duplicated rows that upstream `Seq2SeqTrainer`
    returns when the data set size is not a multiple of batch size x replicas.
    """

    def __init__(self, *args, inference_args: DeepSpeedInferenceArguments | None = None,
                 policy: Policy | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.inference_args = inference_args or DeepSpeedInferenceArguments()
        enabled = self.inference_args.deepspeed_inference
        world = self.args.world_size
        if enabled and world_size_from_env() != world:
            raise InferenceSetupError(
                f"the launcher started {world_size_from_env()} ranks but the Trainer sees {world}; without a GPU pass "
                "--use_cpu (InferenceArgumentParser adds it)"
            )
        if is_skeleton(self.model) and not enabled:
            raise InferenceSetupError("the model was built for --deepspeed_inference (weights not loaded); pass the "
                                      "same inference_args to the Trainer")
        self.topology = Topology.create(world, self.args.process_index, self.inference_args.tp_size if enabled else 1)
        self.process_groups = ProcessGroups(tp=None, dp=None, mesh=None)
        self.shard_report: ShardReport | None = None
        # This run's identity, stamped into every results file: a later run into the same --output_dir never
        # merges its results with an earlier run's, and `ds-inference summary` shows one run's files only.
        self.run_id = f"{datetime.datetime.now():%Y%m%dT%H%M%S.%f}-{uuid.uuid4().hex[:6]}"
        self._batch_index = -1
        self._local_batch_examples = 0
        self._evaluating = False  # inside evaluation_loop: see _get_num_items_in_batch
        self.lockstep_seconds = 0.0
        if enabled:
            self._shard(policy)

    def _shard(self, policy: Policy | str | None) -> None:
        setup = setup_inference(self.model, self.inference_args, self.topology, self.args.device,
                                fp16=self.args.fp16, bf16=self.args.bf16, policy=policy)
        self.process_groups, self.shard_report = setup.groups, setup.report
        if setup.groups.mesh is not None:
            # accelerate's data loader reads this mesh: ranks of one TP group get identical batches.
            _lend_mesh(self.accelerator.state, setup.groups.mesh)
        setup.model._is_accelerate_prepared = True  # keep accelerate from re-wrapping the injected module
        self.model = self.model_wrapped = setup.model

    def _move_model_to_device(self, model, device):
        if is_skeleton(model):
            return  # its weights do not exist yet: shard_model reads them straight onto the device
        super()._move_model_to_device(model, device)

    def train(self, *args, **kwargs):
        if self.inference_args.deepspeed_inference:
            raise InferenceSetupError(
                "--deepspeed_inference shards the model for predict/evaluate only; drop --do_train or the flag"
            )
        return super().train(*args, **kwargs)

    def get_tp_size(self) -> int:
        return self.topology.tp_size

    # Gathering ------------------------------------------------------------------------------------

    def _replica_gather(self, data):
        """The loop's gather (`gather_function`): over the data-parallel group only, the padding of the last
        batches taken off, a batch's loss weighed as one process weighs it (`gather.replica_gather`)."""
        return gather.replica_gather(data, self.topology.dp_size, self.process_groups.dp,
                                     self.accelerator.gradient_state, self._local_batch_examples,
                                     self.args.eval_batch_size)

    # Data layout: replicas split the data, TP peers share it ----------------------------------------------

    def get_eval_dataloader(self, eval_dataset=None):
        return self._replica_loader(super().get_eval_dataloader, eval_dataset, "eval_dataset")

    def get_test_dataloader(self, test_dataset):
        return self._replica_loader(super().get_test_dataloader, test_dataset, "test_dataset")

    def _replica_loader(self, make, dataset, name: str):
        """accelerate's loader without batch dispatching under our mesh (`replicas.replica_loader`)."""
        return replicas.replica_loader(make, dataset, name, self.process_groups.mesh,
                                       getattr(self, "eval_dataset", None), self.topology, self.args,
                                       self.accelerator.dataloader_config)

    # Lock step: same inputs, same random numbers, on every rank of a TP group ---------------------

    def _check_lockstep(self, inputs: dict) -> None:
        check_lockstep(inputs, self.topology, self.process_groups.tp, self.args.device, self._batch_index)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        self._batch_index += 1
        if "labels" in inputs and inputs["labels"] is None:
            # upstream's DataCollatorForSeq2Seq gives `labels: None` for data without references, and upstream's
            # prediction_step takes the key for labels and runs the model without decoder inputs (a crash)
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        self._local_batch_examples = gather.batch_examples(inputs)
        if self.topology.tp_size > 1 and self.inference_args.lockstep_guard:
            start = time.perf_counter()
            self._check_lockstep(inputs)
            self.lockstep_seconds += time.perf_counter() - start
        prompt_width = inputs["input_ids"].shape[1] if "input_ids" in inputs else 0
        rows, real = self._local_batch_examples, self._real_rows()
        padded = real is not None and real < rows  # accelerate's padding of the last batches: see gather.real_rows
        if padded:
            inputs = gather.slice_rows(inputs, rows, max(real, 1))
        # when sampling, one seed per batch of the whole data set, as one process's (`sampling.batch_seed`)
        with batch_seed(self.args, self.topology, self._batch_index, self._samples(gen_kwargs)):
            loss, tokens, labels = super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        if padded:  # back to the batch's row count: the gather trims these rows off
            tokens, labels = gather.pad_rows(tokens, max(real, 1), rows), gather.pad_rows(labels, max(real, 1), rows)
        if real is not None and isinstance(loss, torch.Tensor):
            loss = loss.as_subclass(gather.BatchLoss)  # so that _replica_gather weighs it as one process does
        if tokens is not None and getattr(self.args, "predict_with_generate", False) and not getattr(
                self.model.config, "is_encoder_decoder", False):
            tokens = tokens[:, prompt_width:]  # decoder-only: return the new tokens, not the (left-padded) prompt
        return loss, tokens, labels

    def _real_rows(self) -> int | None:
        """How many rows of this replica's batch are examples, when the loop may have padded it (None: all are):
        `gather.real_rows`."""
        return gather.real_rows(getattr(self, "_loop_examples", None), self._batch_index, self.topology.dp_size,
                                self.topology.dp_rank, self.args.eval_batch_size,
                                self.accelerator.dataloader_config.split_batches)

    def _samples(self, gen_kwargs: dict | None) -> bool:
        """Whether this prediction step samples (`sampling.samples`: the call's kwargs, else those kept by predict)."""
        return samples(self.args, self.model, gen_kwargs or getattr(self, "_gen_kwargs", None))

    def evaluation_loop(self, dataloader, *args, **kwargs):
        # Seq2SeqTrainer.predict/evaluate reset gather_function before every call: set ours here.
        self._batch_index = -1
        self.gather_function = self._replica_gather
        dataset = getattr(dataloader, "dataset", None)
        self._loop_examples = len(dataset) if hasattr(dataset, "__len__") else None
        # each batch's loss over its own label tokens, as one process takes it: see _get_num_items_in_batch
        averaged = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices, self._evaluating = False, True
        try:
            output = super().evaluation_loop(dataloader, *args, **kwargs)
        finally:
            self._loop_examples = None
            self.args.average_tokens_across_devices, self._evaluating = averaged, False
        n, k = output.num_samples, gather.rows_per_example(self.args, self.model, getattr(self, "_gen_kwargs", None))
        if getattr(self.args, "dataloader_drop_last", False):  # upstream's loop drops a short last batch of each
            n -= n % (self.args.eval_batch_size * self.topology.dp_size)  # process, and counts it in num_samples
        gather.check_row_counts(output, n, k)
        return output

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """While evaluating, the label tokens of this batch alone, as one process counts them for the same batch.

        With `average_tokens_across_devices` (transformers 5's default), a model that takes loss kwargs (Llama,
        GPT-2...) divides its batch's loss sum by the tokens of every process's batch, divided by the TP size, and
        `compute_loss` multiplies by the process count over the TP size: a replica's loss is its batch mean only
        where every replica's batch holds as many tokens. The last ones do not, and eval_loss parted from one
        process's (a random Llama, 13 examples, batch 4, dp 2: 6.5691 against 6.5979, 2026-12-04). So
        `evaluation_loop` turns that averaging off (no all-process sum, no scale in `compute_loss`), and here
        upstream's division by the ranks that share a batch, which assumes the sum, is undone. The replicas' batch
        means are then weighed as one process weighs its batches (_gather_batch_loss). Training keeps upstream's."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if self._evaluating and count is not None:
            count = count * (self.get_tp_size() * self.get_cp_size() * self.get_sp_size())
        return count

    # Results files and speed metrics (`results`) ---------------------------------------------------------------

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """Upstream's, written atomically and stamped with the layout and this run (`results.save_metrics`)."""
        if self.is_world_process_zero():
            results.save_metrics(self.args.output_dir, split, metrics, self.topology.tp_size, self.topology.dp_size,
                                 self.run_id, combined)

    def _fix_speed_metrics(self, metrics: dict, prefix: str, num_samples: int | None) -> dict:
        """Steps per second per replica (`results.speed_metrics`), and the lock-step guard's time at tp > 1."""
        self._lockstep_metric(metrics, prefix)
        return results.speed_metrics(metrics, prefix, num_samples, self.args.eval_batch_size, self.topology.dp_size)

    def _lockstep_metric(self, metrics: dict, prefix: str) -> None:
        if self.topology.tp_size > 1:
            metrics[f"{prefix}_lockstep_guard_seconds"] = round(self.lockstep_seconds, 4)
            self.lockstep_seconds = 0.0

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        check_trainer_inputs_fit(self.args, self.model, eval_dataset if eval_dataset is not None else self.eval_dataset,
                                 kwargs)
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._fix_speed_metrics(metrics, metric_key_prefix, len(dataset) if hasattr(dataset, "__len__") else None)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **kwargs):
        check_trainer_inputs_fit(self.args, self.model, test_dataset, kwargs)
        test_dataset, order, padding = length_grouped(self.args, test_dataset, metric_key_prefix)
        output = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        count = len(test_dataset) if hasattr(test_dataset, "__len__") else None
        self._fix_speed_metrics(output.metrics, metric_key_prefix, count)
        if order is None:
            return output
        output.metrics.update(padding)
        return type(output)(predictions=unsort(output.predictions, order), label_ids=unsort(output.label_ids, order),
                            metrics=output.metrics)

    # Streamed, resumable predict ---------------------------------------------------------------------------

    def predict_to_file(self, test_dataset, metric=None, metric_key_prefix: str = "predict",
                        predictions_file: str = "generated_predictions.txt", fresh: bool | None = None,
                        **gen_kwargs) -> dict:
        """`predict` with `predict_with_generate` for data sets of any size: each finished batch's decoded
        predictions are written to `<output_dir>/<prefix>_parts/` as it completes, a re-run of the same call
        continues where a crash stopped it (`fresh=True`, by default `--overwrite_output_dir`, starts afresh), and
        the parts are merged into `<output_dir>/<predictions_file>` in input order. `metric` (e.g.
        `metrics.CorpusBleu()`) is computed from statistics stored with each prediction. Host memory does not grow
        with the data set; returns the metrics (on every rank). See `predict/streaming.py`."""
        if not getattr(self.args, "predict_with_generate", False):
            raise InferenceSetupError("predict_to_file writes generated text: pass --predict_with_generate")
        if self.processing_class is None or not hasattr(self.processing_class, "batch_decode"):
            raise InferenceSetupError("predict_to_file decodes with the Trainer's processing_class: pass the tokenizer")
        check_trainer_inputs_fit(self.args, self.model, test_dataset, gen_kwargs)
        gen_kwargs = dict(gen_kwargs)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None \
                and self.args.generation_max_length is not None:
            gen_kwargs["max_length"] = self.args.generation_max_length
        if gen_kwargs.get("num_beams") is None and self.args.generation_num_beams is not None:
            gen_kwargs["num_beams"] = self.args.generation_num_beams
        self._gen_kwargs = gen_kwargs
        if self.args.remove_unused_columns and hasattr(test_dataset, "column_names"):
            test_dataset = self._remove_unused_columns(test_dataset, description="test")
        test_dataset = replicas.full_batches(test_dataset, self.args, self.topology)  # as predict (upstream's loop)
        test_dataset, order, padding = length_grouped(self.args, test_dataset, metric_key_prefix)
        self.model.eval()
        job = StreamJob(dataset=test_dataset, order=order, topology=self.topology, output_dir=Path(self.args.output_dir),
                        batch_size=self.args.eval_batch_size, identity=lambda: run_identity(
                            self.model, test_dataset, order, self.topology, self.args.eval_batch_size, gen_kwargs,
                            self.args.seed if self._samples({}) else None),
                        collate=self.data_collator, generate=self._generate_batch, tokenizer=self.processing_class)
        if fresh is None:  # InferenceArgumentParser keeps transformers 4's --overwrite_output_dir on the arguments
            fresh = bool(getattr(self.args, "overwrite_output_dir", False))
        metrics = streamed_predict(job, metric=metric, metric_key_prefix=metric_key_prefix,
                                   predictions_file=predictions_file, fresh=fresh)
        metrics.update(padding)
        self._lockstep_metric(metrics, metric_key_prefix)
        return metrics

    def _generate_batch(self, k: int, inputs: dict):
        """The token ids of batch `k` of this replica (`prediction_step` counts `_batch_index` up to `k`: the
        sampling seed and the lock-step guard use it)."""
        self._batch_index = k - 1
        _, tokens, _ = self.prediction_step(self.model, inputs, prediction_loss_only=False)
        return tokens

    def _get_eval_sampler(self, eval_dataset):
        # Prediction order is ours (sorted above, restored after); never a randomised length sampler here.
        return None if self.args.world_size > 1 else torch.utils.data.SequentialSampler(eval_dataset)


class DeepSpeedInferenceSeq2SeqTrainer(DeepSpeedInferenceMixin, Seq2SeqTrainer):
    """`Seq2SeqTrainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""


class DeepSpeedInferenceTrainer(DeepSpeedInferenceMixin, Trainer):
    """`Trainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""

