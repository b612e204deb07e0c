"""What the Trainer mixin does when it is made: the launch checked against what the Trainer sees, the layout, and
the Trainer's model sharded in place (`shard.setup.setup_inference`) with accelerate given the device mesh its data
loader reads."""

from __future__ import annotations

import weakref

from ..arguments import DeepSpeedInferenceArguments, world_size_from_env
from ..deepspeed_compat import unpin_world_group
from ..errors import InferenceSetupError
from ..load.loaders import is_skeleton
from ..policy.schema import Policy
from ..run import lifecycle
from ..shard.setup import InferenceSetup, setup_inference
from ..topology import Topology


def trainer_topology(args, inference_args: DeepSpeedInferenceArguments, model) -> Topology:
    """The layout of a Trainer's run (tp 1 without `--deepspeed_inference`), refusing in one line a launch the
    Trainer does not see whole and a model built for the flag without it."""
    enabled, world = inference_args.deepspeed_inference, args.world_size
    if enabled and world_size_from_env() != world:
        raise InferenceSetupError(
            f"the launcher started {world_size_from_env()} ranks but the Trainer sees {world}; without a GPU pass "
            "--use_cpu (InferenceArgumentParser adds it)"
        )
    if is_skeleton(model) and not enabled:
        raise InferenceSetupError("the model was built for --deepspeed_inference (weights not loaded); pass the "
                                  "same inference_args to the Trainer")
    return Topology.create(world, args.process_index, inference_args.tp_size if enabled else 1)


def shard_trainers_model(trainer, policy: Policy | str | None) -> InferenceSetup:
    """`setup_inference` on the Trainer's model; the returned model is the one the Trainer keeps."""
    args = trainer.args
    setup = setup_inference(trainer.model, trainer.inference_args, trainer.topology, args.device, fp16=args.fp16,
                            bf16=args.bf16, policy=policy)
    if setup.groups.mesh is not None:
        # accelerate's data loader reads this mesh: ranks of one TP group get identical batches.
        _lend_mesh(trainer.accelerator.state, setup.groups.mesh)
    setup.model._is_accelerate_prepared = True  # keep accelerate from re-wrapping the injected module
    return setup


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
