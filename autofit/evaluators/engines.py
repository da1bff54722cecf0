"""What accelerate makes of the launcher's config, shared by the measured child
(``_trial_main``) and an exported ``train.py`` (``autofit.launch``): FSDP where accelerate
refuses it on the CPU, and the facts of the engine that really runs.

accelerate and torch are imported lazily: the parent of a measured trial imports none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def fsdp_requested() -> bool:
    """The launcher's environment asks for FSDP (``accelerate launch`` with an fsdp_config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_on_cpu(acc) -> bool:
    """Switch ``acc`` to FSDP where the launcher asked for it and accelerate did not select it
    (the CPU: :func:`switch_to_fsdp`); whether it was switched."""
    from accelerate.utils import DistributedType

    if not fsdp_requested() or acc.distributed_type is DistributedType.FSDP:
        return False
    switch_to_fsdp(acc)
    return True


def fsdp_applied_by(acc, switched: bool) -> str | None:
    """Who made the run FSDP, for the record: autofit (:func:`fsdp_on_cpu`), accelerate, or nobody."""
    from accelerate.utils import DistributedType

    if switched:
        return "autofit (accelerate does not select FSDP on the CPU)"
    return "accelerate" if acc.distributed_type is DistributedType.FSDP else None


def switch_to_fsdp(acc) -> None:
    """Select accelerate's FSDP path where its state machine refused it.

    accelerate never selects FSDP without an accelerator device (``distributed_type``
    stays ``MULTI_CPU``; shared/FIELD-NOTES.md). When the launcher's environment says FSDP
    (``ACCELERATE_USE_FSDP``) the plugin is read from that same environment and the state
    switched before ``prepare``, so accelerate's own FSDP2 path runs over the gloo group
    the launcher created (docs/EVALUATORS.md).
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_*: the exported fsdp_config
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    state = acc.state
    state.fsdp_plugin = plugin
    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    if parallelism_requested() and acc.parallelism_config is None:
        _attach_parallelism(acc)


def parallelism_requested() -> bool:
    """The launcher's environment carries a ``ParallelismConfig`` (the exported ``parallelism_config``:
    context parallelism)."""
    return os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"


@contextlib.contextmanager
def parallelism_deferred() -> Iterator[None]:
    """Build the ``Accelerator`` without the launcher's ``ParallelismConfig`` on the CPU: accelerate
    validates it at construction against the state's ``MULTI_CPU`` (``ParallelismConfig.
    _validate_accelerator``: "only compatible with FSDP (version 2) ..."), before
    :func:`switch_to_fsdp` could select FSDP, which then attaches it."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


def _attach_parallelism(acc) -> None:
    """What ``Accelerator.__init__`` does with a ``ParallelismConfig``, once the state is FSDP: read it
    from the launcher's ``PARALLELISM_CONFIG_*``, build its device mesh (``dp_shard`` × ``cp``, and the
    flattened ``dp_shard_cp`` that FSDP2 shards over) and validate it. ``prepare`` then sets up
    context parallelism itself (``Accelerator._prepare_cp``)."""
    from accelerate import ParallelismConfig

    pc = ParallelismConfig()  # reads PARALLELISM_CONFIG_*
    acc.state.parallelism_config = pc
    acc.state.device_mesh = pc.get_device_mesh(acc.device.type)
    pc._validate_accelerator(acc)


def describe(acc, model, optimizer) -> dict[str, Any]:
    """What really runs: accelerate's view, the engine's class and its settings."""
    import torch

    out: dict[str, Any] = {
        "distributed_type": str(acc.distributed_type.value),
        "num_processes": acc.num_processes,
        "mixed_precision": acc.mixed_precision,
        "model_class": type(model).__name__,
        "optimizer_class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
    }
    if type(model).__name__ == "DeepSpeedEngine":
        out.update(
            zero_stage=model.zero_optimization_stage(),
            train_batch_size=model.train_batch_size(),
            micro_batch=model.train_micro_batch_size_per_gpu(),
            grad_accum=model.gradient_accumulation_steps(),
            reduce_bucket_size=model.zero_reduce_bucket_size(),
            zero_optimizer=type(model.optimizer).__name__,
            inner_optimizer=type(getattr(model.optimizer, "optimizer", model.optimizer)).__name__,
            bf16=model.bfloat16_enabled(),
        )
    try:
        from torch.distributed.fsdp import FSDPModule

        sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        if sharded:
            p = next(model.parameters())
            local = p.to_local() if hasattr(p, "to_local") else p
            out.update(
                fsdp_modules=len(sharded),
                fsdp_param_type=type(p).__name__,
                fsdp_placements=[str(x) for x in getattr(p, "placements", ())],
                fsdp_local_numel=local.numel(),
                fsdp_global_numel=p.numel(),
            )
    except ImportError:
        pass
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        out["ddp"] = True
    pc = acc.parallelism_config
    if pc is not None and pc.cp_enabled:  # what maybe_context_parallel runs over
        out["context_parallel"] = {
            "cp_size": pc.cp_size,
            "dp_shard_size": pc.dp_shard_size,
            "cp_comm_strategy": pc.cp_handler.cp_comm_strategy,
            "mesh": list(acc.torch_device_mesh.mesh_dim_names),
        }
    # FSDP's activation checkpointing (fsdp_activation_checkpointing) wraps each layer
    # (isinstance: fully_shard renames the class of what it shards)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    out["checkpoint_wrappers"] = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return out


def gather_objects(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (one rank: ``[mine]``). End the run with
    :func:`leave_group`, not ``barrier()``: see there why."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def leave_group() -> bool:
    """Wait for every rank, then leave the default process group, before the interpreter exits;
    whether the group was Gloo's (then end the process with :func:`exit_now`).

    Gloo runs a collective on one of its worker threads, and that thread drops the work when it
    is done; a work holding tensors Python made (``all_gather_object``'s) takes the GIL to free
    them. Should the interpreter be finalizing by then, the thread exits inside the destructor and
    the rank aborts after training finished ("terminate called without an active exception",
    SIGABRT; docs/FIELD-NOTES.md). ``barrier()`` made that likely: a Gloo barrier keeps the works
    still in progress when it is called (``ProcessGroupGloo::barrier`` snapshots
    ``workInProgress_`` as weak pointers, ``ProcessGroupGloo.cpp``), so a gather just before it was
    freed with the barrier's work, on a worker thread, as the process exited (a core dump of the
    exported FSDP ``train.py`` showed exactly that stack). ``monitored_barrier`` sends and receives
    a tensor of its own on the calling thread and keeps no work (``monitoredBarrier``); other
    backends (NCCL) keep ``barrier``. It is not enough: a group that something still holds (FSDP2's
    mesh holds its group) keeps its threads past ``destroy_process_group``, and a clean-clone suite
    run still saw one rank of an exported FSDP run abort so."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    gloo = dist.get_backend() == "gloo"
    if gloo:
        dist.monitored_barrier(wait_all_ranks=True)
    else:
        dist.barrier()
    dist.destroy_process_group()
    return gloo


def exit_now(code: int = 0) -> None:
    """End the process at once with ``code``, its output flushed, skipping the interpreter's
    finalization, where Gloo's threads can abort it (:func:`leave_group`): how the measured child
    (``_trial_main``) and a Gloo run's ``train.py`` end; torch has no fix (pytorch/pytorch#179291, an ``atexit``
    ``destroy_process_group``, was abandoned)."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
