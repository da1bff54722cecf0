"""The plan inside the user's training run: what an exported ``train.py`` imports.

The Hugging Face Trainer has no switch for some of a plan's techniques, and accelerate does not
shard FSDP on the CPU. ``train.py`` builds its model, data and ``TrainingArguments`` as any
Trainer script does and hands them to these helpers, which apply the plan with the code autofit's
measured runs use (``autofit.evaluators``): what the user's script trains is what autofit measured.

- :func:`load` reads ``plan.json`` and ``trainer_args.json`` beside the script;
- :func:`model_path` says what ``from_pretrained`` loads, and refuses a config without weights;
- :func:`training_arguments` is ``trainer_args.json``'s ``TrainingArguments`` for this machine;
- :class:`PlanTrainer` is the Trainer plus selective checkpointing, the chunked loss and the
  fused-kernel stand-ins where Liger cannot run, activation offloading, the optimizer step in
  backward, and FSDP where accelerate refuses it;
- :func:`report` writes what the plan expected beside what the run got (``autofit_result.json``).

Sits beside the search, above the evaluators; imports torch and transformers (the training
machine has them); nothing in autofit imports it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from autofit.errors import AutofitError
from autofit.evaluators import engines, fused, offload, runtime
from autofit.export.common import PLAN_NAME, TRAINER_ARGS_NAME
from autofit.plan import Checkpointing, Plan

RESULT_NAME = "autofit_result.json"
# what a folder holding a model's weights has (transformers' WEIGHTS_NAME, SAFE_WEIGHTS_NAME and
# their sharded index files: utils/__init__.py)
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


class LaunchError(AutofitError):
    """The training run cannot start as exported; the message says what to change."""


@dataclass(frozen=True)
class Export:
    """An export folder as the training script reads it."""

    directory: Path
    plan: Plan
    record: dict[str, Any]  # plan.json
    trainer_args: dict[str, Any]  # trainer_args.json


def load(directory: str | Path) -> Export:
    """The export in ``directory`` (the folder of train.py)."""
    directory = Path(directory).resolve()
    files = {}
    for name in (PLAN_NAME, TRAINER_ARGS_NAME):
        try:
            files[name] = json.loads((directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LaunchError(
                f"cannot read {name} in {directory} ({exc}): run train.py from the folder `autofit export` wrote"
            ) from None
    record = files[PLAN_NAME]
    task = record["target"].get("task", "causal-lm")
    if task != "causal-lm":
        raise LaunchError(
            f"train.py trains causal LMs; {record['target']['model']} is a {task} model: build its Trainer script "
            "from trainer_args.json by hand"
        )
    return Export(directory, Plan.from_dict(record["plan"]), record, files[TRAINER_ARGS_NAME])


def model_path(export: Export, given: str | None = None) -> str:
    """What ``from_pretrained`` loads: ``given`` (a hub id or a folder, from ``--model``), else the
    exported reference (a relative one is inside the export). A local folder must hold weights."""
    ref = given or export.trainer_args["model"]
    path = Path(ref) if given or Path(ref).is_absolute() else export.directory / ref
    if not path.exists():
        if given is None and Path(ref).is_absolute():
            raise LaunchError(
                f"the exported model folder {ref} is not on this machine: pass --model with the folder that "
                "holds the model (config.json and weights) or its hub id"
            )
        return ref  # a hub id
    if not path.is_dir():
        raise LaunchError(f"--model {ref}: give the folder that holds config.json and the weights, not a file")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_FILES):
        raise LaunchError(
            f"{path} holds a model config but no weights (*.safetensors or pytorch_model*.bin): pass --model "
            "with the model's hub id or a folder holding its weights, e.g. one written by save_pretrained"
        )
    return str(path)


def liger_runs() -> bool:
    """Liger's Triton kernels run here: a CUDA device and liger-kernel installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def training_arguments(export: Export, **given: Any) -> dict[str, Any]:
    """``TrainingArguments`` keywords: ``trainer_args.json``'s, with ``given`` (output_dir,
    max_steps, ...) on top. Without a GPU the run is a CPU run (``use_cpu``: transformers
    refuses bf16 otherwise); where Liger cannot run, :class:`PlanTrainer` applies autofit's
    stand-ins instead of ``use_liger_kernel``. The DeepSpeed file is named by its full path."""
    ta = dict(export.trainer_args["training_arguments"])
    if not torch.cuda.is_available():
        ta["use_cpu"] = True
    if ta.get("use_liger_kernel") and not liger_runs():
        ta.pop("use_liger_kernel")
        ta.pop("liger_kernel_config", None)
    if ta.get("deepspeed"):
        ta["deepspeed"] = str(export.directory / ta["deepspeed"])
    return {**ta, **given}


class _StepTimer(TrainerCallback):
    """Seconds and real tokens of each optimizer step (the GPU synchronized at both ends)."""

    def __init__(self, trainer: PlanTrainer) -> None:
        self.trainer = trainer
        self.steps: list[tuple[float, int]] = []
        self._t0 = 0.0
        self._tokens0 = 0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t0, self._tokens0 = time.perf_counter(), self.trainer.tokens

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.steps.append((time.perf_counter() - self._t0, self.trainer.tokens - self._tokens0))


class PlanTrainer(Trainer):
    """``transformers.Trainer`` plus what the plan needs and the Trainer has no switch for, the
    way autofit's measured runs apply it (``evaluators/_trial_main.py``, ``runtime.StepRunner``)."""

    def __init__(self, *args: Any, export: Export, **kwargs: Any) -> None:
        self.export = export
        self.plan = export.plan
        if self.plan.torch_compile:  # block by block as modelled, also where accelerate launch did not set it
            os.environ.setdefault("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "True")
            runtime.compile_checkpointed_blocks()  # else a checkpointed block runs eagerly
        self.tokens = 0  # real tokens this rank trained on
        self.fsdp_switched = False
        super().__init__(*args, **kwargs)
        self.applied = self._apply(self.model)
        self.timer = _StepTimer(self)
        self.add_callback(self.timer)

    def _apply(self, model: torch.nn.Module) -> list[str]:
        plan, applied = self.plan, []
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        liger = bool(self.args.use_liger_kernel)
        self.chunked_loss = plan.fused_loss and not liger
        self._rope = self._offload = None
        if plan.checkpointing is Checkpointing.SELECTIVE:
            runtime.enable_checkpointing(model, {"use_reentrant": False}, plan)
            if plan.checkpoint_ops:
                applied.append("op-level selective activation checkpointing (torchtitan's SelectiveAC policy)")
            else:
                applied.append(f"selective activation checkpointing, one block in {plan.checkpoint_every}")
        if liger:
            applied.append("Liger's kernels (use_liger_kernel)")
        if self.chunked_loss:
            applied.append("chunked cross-entropy (autofit's stand-in for Liger's fused loss)")
        if plan.fused_kernels and not liger:
            fused.apply(base)
            self._rope = base
            applied.append("RMSNorm, SwiGLU and RoPE saving what Liger's kernels save (autofit's torch stand-ins)")
        if plan.offload_activations:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._offload = offload.ActivationOffload(base, device)
            self._offload.stop_at(base.get_output_embeddings())
            applied.append("activation offloading to host memory")
        if plan.optimizer_in_backward:
            applied.append("optimizer step in backward")
        if self.args.torch_compile:
            applied.append("torch.compile of every decoder block (accelerate's regional compilation)")
        return applied

    def create_accelerator_and_postprocess(self) -> None:
        cpu = not torch.cuda.is_available()
        # accelerate refuses a ParallelismConfig on the CPU before FSDP could be selected: attached below
        with engines.parallelism_deferred() if cpu else contextlib.nullcontext():
            super().create_accelerator_and_postprocess()
        # accelerate runs an FSDP config undistributed on the CPU; switch as the measured runs do
        self.fsdp_switched = engines.fsdp_on_cpu(self.accelerator)
        if self.fsdp_switched:
            self.is_fsdp_enabled = True
        if self.plan.context_parallel > 1 and cpu:
            from autofit.evaluators import ring

            ring.register()  # torch's ring has no handler for the CPU's attention kernel

    def create_optimizer(self, model: torch.nn.Module | None = None):
        if not self.plan.optimizer_in_backward:
            return super().create_optimizer(model)
        if self.optimizer is None:  # each parameter steps in its gradient hook (runtime.BackwardOptimizer)
            self.optimizer = runtime.make_optimizer(self.plan, model or self.model, lr=self.args.learning_rate)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        # a context-parallel rank trains on 1/cp of each row's tokens (the Trainer shards them next)
        self.tokens += runtime.real_tokens(inputs) // self.plan.context_parallel
        # Liger's RoPE stand-in rotates in forward, backward and any checkpoint recompute
        with fused.rope(self._rope) if self._rope is not None else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._offload if self._offload is not None else contextlib.nullcontext():
            if not self.chunked_loss:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inner = runtime.unwrap(model)
            base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
            before_head = (lambda _: self._offload.stop()) if self._offload is not None else None
            loss = runtime.chunked_loss(base, inputs, before_head=before_head)
        self.loss_is_scaled_for_ga = False  # a mean over this micro-batch: the Trainer divides by accumulation
        return (loss, None) if return_outputs else loss


def report(trainer: PlanTrainer, output: Any, path: str | Path | None = None) -> dict[str, Any]:
    """What the plan expected (``plan.json``) beside what this run got, gathered from every rank;
    rank 0 writes it to ``path`` (``<output_dir>/autofit_result.json``) and prints a summary."""
    mine = _rank_figures(trainer)
    ranks = engines.gather_objects(mine)
    result = _result(trainer, output, ranks)
    if mine["rank"] == 0:
        path = Path(path or Path(trainer.args.output_dir) / RESULT_NAME)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(_summary(result, path), file=sys.stderr)
    return result


def close() -> None:
    """Leave the process group once every rank is done, and on Gloo end the process at once (a
    Gloo rank can otherwise abort at interpreter exit after training finished: ``engines.leave_group``).
    The last call of ``train.py``."""
    if engines.leave_group():
        engines.exit_now(0)


def _rank_figures(trainer: PlanTrainer) -> dict[str, Any]:
    timed = trainer.timer.steps[1:] or trainer.timer.steps  # the first step warms up
    cuda = torch.cuda.is_available()
    return {
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "tokens": sum(t for _, t in timed),
        "seconds": sum(s for s, _ in timed),
        "timed_steps": len(timed),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "checkpointed_layers": _checkpointed_layers(runtime.unwrap(trainer.model_wrapped)),
        "applied": trainer.applied,
        "offloaded_bytes": trainer._offload.offloaded_bytes if trainer._offload is not None else 0,
        "cpu_ring_calls": _cpu_ring_calls(trainer.plan),
        "engine": {
            **engines.describe(trainer.accelerator, trainer.model_wrapped, trainer.optimizer),
            "fsdp_applied_by": engines.fsdp_applied_by(trainer.accelerator, trainer.fsdp_switched),
        },
    }


def _cpu_ring_calls(plan: Plan) -> dict[str, int] | None:
    """Attention calls through the CPU ring handler (``evaluators/ring.py``), where it is registered."""
    if plan.context_parallel == 1 or torch.cuda.is_available():
        return None
    from autofit.evaluators import ring

    return dict(ring.calls)


def _checkpointed_layers(model: torch.nn.Module) -> list[int]:
    """The decoder layers whose own checkpointing flag is on (transformers' ``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [i for i, m in enumerate(layers) if m.gradient_checkpointing]


def _result(trainer: PlanTrainer, output: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    record, cuda = trainer.export.record, torch.cuda.is_available()
    rates = [r["tokens"] / r["seconds"] for r in ranks if r["seconds"] > 0]
    got = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "world_size": len(ranks),
        "steps": output.global_step,
        "training_loss": output.training_loss,
        "tokens_per_sec": sum(rates) if len(rates) == len(ranks) else None,  # the whole cluster's
        "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in ranks) if cuda else None,
        "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in ranks) if cuda else None,
    }
    expected = record.get("expected")
    compared: dict[str, Any] = {}
    if not cuda:
        compared["why_not"] = "a CPU run: the figures autofit expected are of a GPU"
    elif expected:
        compared = {
            "same_gpu": expected["gpu"].lower() in got["device"].lower(),
            "peak_allocated": got["peak_allocated_bytes"] / expected["peak_allocated_bytes"],
            "tokens_per_sec": (got["tokens_per_sec"] or 0.0) / expected["tokens_per_sec"],
        }
    return {
        "plan_id": record["plan_id"],
        "summary": record["summary"],
        "expected": expected,
        "got": got,
        "got_over_expected": compared,
        "ranks": ranks,
    }


def _summary(result: dict[str, Any], path: Path) -> str:
    got, exp, ratio = result["got"], result["expected"], result["got_over_expected"]
    gib = 2**30
    lines = [f"autofit: plan {result['summary']}: {got['steps']} steps on {got['world_size']} x {got['device']}"]
    if got["tokens_per_sec"] is not None:
        lines.append(
            f"  tokens/s: got {got['tokens_per_sec']:,.0f}"
            + (f", expected {exp['tokens_per_sec']:,.0f}" if exp else "")
        )
    if got["peak_allocated_bytes"] is not None:
        lines.append(
            f"  peak allocated per GPU: got {got['peak_allocated_bytes'] / gib:.2f} GiB"
            + (f", expected {exp['peak_allocated_bytes'] / gib:.2f} GiB" if exp else "")
        )
    if ratio.get("why_not"):
        lines.append(f"  not compared: {ratio['why_not']}")
    elif ratio and not ratio["same_gpu"]:
        lines.append(f"  not the GPU autofit planned for ({exp['gpu']})")
    lines.append(f"  written to {path}")
    return "\n".join(lines)
