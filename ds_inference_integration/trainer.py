"""Trainer integration: shard once, feed every rank of a TP group the same batches, gather once per
data-parallel replica, and return exactly one row per input example, in input order."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from transformers import Seq2SeqTrainer, Trainer

from .arguments import DeepSpeedInferenceArguments, InferenceSetupError, world_size_from_env
from .policy import Policy, check_head_counts, resolve_policy
from .shard import ShardReport, init_deepspeed_comm, shard_model
from .topology import ProcessGroups, Topology, init_process_groups

logger = logging.getLogger(__name__)


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
                "--use_cpu (ds_inference_integration.prepare_argv adds it)"
            )
        self.topology = Topology.create(world, self.args.process_index, self.inference_args.tp_size if enabled else 1)
        self.process_groups = ProcessGroups(tp=None, dp=None, mesh=None)
        self.shard_report: ShardReport | None = None
        if enabled:
            self._shard(policy)

    def _shard(self, policy: Policy | str | None) -> None:
        inf = self.inference_args
        dtype = inf.resolve_dtype(fp16=self.args.fp16, bf16=self.args.bf16)
        inf.check_device(on_gpu=self.args.device.type == "cuda", dtype=dtype)
        if policy is None and inf.injection_policy != "autotp":
            policy = resolve_policy(inf.injection_policy, self.model.config)
        check_head_counts(policy, self.model.config, self.topology.tp_size)
        self.process_groups = init_process_groups(self.topology, self.args.device.type)
        if self.process_groups.mesh is not None:
            # accelerate's data loader reads this mesh: ranks of one TP group get identical batches.
            self.accelerator.state.device_mesh = self.process_groups.mesh
            init_deepspeed_comm(self.topology)
        model, self.shard_report = shard_model(self.model, inf, self.topology, self.process_groups, policy, dtype)
        model._is_accelerate_prepared = True  # keep accelerate from re-wrapping the injected module
        self.model = self.model_wrapped = model
        logger.warning("deepspeed_inference: %s; %s", self.topology, self.shard_report)

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
        """Gather over the data-parallel group only (TP peers hold identical rows), then drop the
        padding accelerate added to even out the last batch, as `gather_for_metrics` does."""
        dp = self.topology.dp_size
        if dp == 1:
            return data
        group = self.process_groups.dp

        def gather(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            if t.ndim == 0:
                t = t[None]
            parts = [torch.empty_like(t) for _ in range(dp)]
            dist.all_gather(parts, t, group=group)
            return torch.cat(parts)

        gathered = recursively_apply(gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            rows_per_sample = max(1, len(self._first(data)) // self.args.eval_batch_size)
            keep = state.remainder * rows_per_sample
            gathered = recursively_apply(lambda t: t[:keep], gathered)
        return gathered

    @staticmethod
    def _first(data) -> torch.Tensor:
        while isinstance(data, (list, tuple, dict)):
            data = next(iter(data.values())) if isinstance(data, dict) else data[0]
        return data

    def evaluation_loop(self, dataloader, *args, **kwargs):
        # Seq2SeqTrainer.predict/evaluate reset gather_function before every call: set ours here.
        self.gather_function = self._replica_gather
        output = super().evaluation_loop(dataloader, *args, **kwargs)
        n = output.num_samples
        for name, rows in (("predictions", output.predictions), ("label_ids", output.label_ids)):
            if isinstance(rows, torch.Tensor) or hasattr(rows, "shape"):
                if len(rows) % max(n, 1) or (n == 0 and len(rows)):
                    raise RuntimeError(f"{name}: gathered {len(rows)} rows for {n} examples; rows were lost or duplicated")
        return output

    # Speed metrics count samples per replica, not per rank ------------------------------------------

    def _fix_speed_metrics(self, metrics: dict, prefix: str, num_samples: int | None) -> dict:
        runtime = metrics.get(f"{prefix}_runtime")
        if runtime and num_samples:
            steps = math.ceil(num_samples / (self.args.eval_batch_size * self.topology.dp_size))
            metrics[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)
        return metrics

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._fix_speed_metrics(metrics, metric_key_prefix, len(dataset) if hasattr(dataset, "__len__") else None)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **kwargs):
        output = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        self._fix_speed_metrics(output.metrics, metric_key_prefix, len(test_dataset) if hasattr(test_dataset, "__len__") else None)
        return output


class DeepSpeedInferenceSeq2SeqTrainer(DeepSpeedInferenceMixin, Seq2SeqTrainer):
    """`Seq2SeqTrainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""


class DeepSpeedInferenceTrainer(DeepSpeedInferenceMixin, Trainer):
    """`Trainer` with `--deepspeed_inference` tensor-parallel predict/evaluate."""
