"""The Trainer mixin: every override below is a seam of upstream's Trainer, with why; what each does lives in the
`predict/` module it names. Shard once, feed every rank of a TP group the same batches, gather once per data-parallel
replica, and return exactly one row per input example, in input order."""

from __future__ import annotations

import torch
from transformers import Seq2SeqTrainer, Trainer

from ..arguments import DeepSpeedInferenceArguments
from ..errors import InferenceSetupError
from ..load.loaders import is_skeleton
from ..policy.schema import Policy
from ..shard.inject import ShardReport
from ..topology import ProcessGroups
from . import replicas, results, to_file
from .length_grouping import length_grouped, unsort
from .loop import PredictLoop
from .positions import check_trainer_inputs_fit
from .setup import shard_trainers_model, trainer_topology


class DeepSpeedInferenceMixin:
    """Adds `--deepspeed_inference` to a `Trainer` (or `Seq2SeqTrainer`) subclass.

    Also fixes, with or without the flag, the duplicated rows that upstream `Seq2SeqTrainer`
    returns when the data set size is not a multiple of batch size x replicas.
    """

    def __init__(self, *args, inference_args: DeepSpeedInferenceArguments | None = None,
                 policy: Policy | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.inference_args = inference_args or DeepSpeedInferenceArguments()
        self.topology = trainer_topology(self.args, self.inference_args, self.model)  # the launch checked (`setup`)
        self.process_groups = ProcessGroups(tp=None, dp=None, mesh=None)
        self.shard_report: ShardReport | None = None
        self.run_id = results.new_run_id()  # stamped into every results file: one run's results are never merged
        self.loop = PredictLoop(self)  # the running predict/evaluate loop's state and steps (`loop`)
        if self.inference_args.deepspeed_inference:  # sharded once, here, in place (`setup`)
            setup = shard_trainers_model(self, policy)
            self.process_groups, self.shard_report = setup.groups, setup.report
            self.model = self.model_wrapped = setup.model

    # The model: sharded when made, never moved or trained ----------------------------------------------------

    def _move_model_to_device(self, model, device):
        if not is_skeleton(model):  # a skeleton's weights do not exist yet: shard_model reads them onto the device
            super()._move_model_to_device(model, device)

    def train(self, *args, **kwargs):
        if self.inference_args.deepspeed_inference:
            raise InferenceSetupError(
                "--deepspeed_inference shards the model for predict/evaluate only; drop --do_train or the flag"
            )
        return super().train(*args, **kwargs)

    def get_tp_size(self) -> int:  # upstream's loss scaling reads it
        return self.topology.tp_size

    # The data: replicas split it, the ranks of a TP group share it (`replicas`) -------------------------------

    def get_eval_dataloader(self, eval_dataset=None):
        return self._replica_loader(super().get_eval_dataloader, eval_dataset, "eval_dataset")

    def get_test_dataloader(self, test_dataset):
        return self._replica_loader(super().get_test_dataloader, test_dataset, "test_dataset")

    def _replica_loader(self, make, dataset, name: str):  # accelerate's, without batch dispatching under our mesh
        return replicas.replica_loader(make, dataset, name, self.process_groups.mesh,
                                       getattr(self, "eval_dataset", None), self.topology, self.args,
                                       self.accelerator.dataloader_config)

    def _get_eval_sampler(self, eval_dataset):
        # Prediction order is ours (sorted by length_grouped, restored after); never a randomised length sampler.
        return None if self.args.world_size > 1 else torch.utils.data.SequentialSampler(eval_dataset)

    # The loop: lock step, a seed per batch, padded rows, one gather per replica, rows checked (`loop`) ---------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        return self.loop.step(super().prediction_step, model, inputs, prediction_loss_only, ignore_keys=ignore_keys,
                              **gen_kwargs)

    def evaluation_loop(self, dataloader, *args, **kwargs):
        return self.loop.run(super().evaluation_loop, dataloader, *args, **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        # a batch's loss over its own label tokens while evaluating, as one process takes it (`loop.items_in_batch`)
        return self.loop.items_in_batch(super()._get_num_items_in_batch(batch_samples, device))

    # Results: inputs checked first, rows in input order, files atomic and stamped (`results`, `to_file`) -------

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """Upstream's, written atomically and stamped with the layout and this run (`results.save_metrics`)."""
        if self.is_world_process_zero():
            results.save_metrics(self.args.output_dir, split, metrics, self.topology.tp_size, self.topology.dp_size,
                                 self.run_id, combined)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        check_trainer_inputs_fit(self.args, self.model, dataset, kwargs)
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        return self.loop.speed_metrics(metrics, metric_key_prefix, dataset)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **kwargs):
        check_trainer_inputs_fit(self.args, self.model, test_dataset, kwargs)
        test_dataset, order, padding = length_grouped(self.args, test_dataset, metric_key_prefix)
        output = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        self.loop.speed_metrics(output.metrics, metric_key_prefix, test_dataset)
        if order is None:
            return output
        output.metrics.update(padding)
        return type(output)(predictions=unsort(output.predictions, order), label_ids=unsort(output.label_ids, order),
                            metrics=output.metrics)

    def predict_to_file(self, test_dataset, metric=None, metric_key_prefix: str = "predict",
                        predictions_file: str = "generated_predictions.txt", fresh: bool | None = None,
                        **gen_kwargs) -> dict:
        """`predict` with `predict_with_generate` for data sets of any size: each finished batch's decoded
        predictions are written to `<output_dir>/<prefix>_parts/` as it completes, a re-run of the same call
        continues where a crash stopped it (`fresh=True`, by default `--overwrite_output_dir`, starts afresh), and
        the parts are merged into `<output_dir>/<predictions_file>` in input order. `metric` (e.g.
        `metrics.CorpusBleu()`) is computed from statistics stored with each prediction. Host memory does not grow
        with the data set; returns the metrics (on every rank). See `predict/streaming.py`."""
        return to_file.predict_to_file(self, test_dataset, metric, metric_key_prefix, predictions_file, fresh,
                                       gen_kwargs)


class DeepSpeedInferenceSeq2SeqTrainer(DeepSpeedInferenceMixin, Seq2SeqTrainer):
    """`Seq2SeqTrainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""


class DeepSpeedInferenceTrainer(DeepSpeedInferenceMixin, Trainer):
    """`Trainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""

