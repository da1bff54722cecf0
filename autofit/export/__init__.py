"""Export a plan as the files a user launches unchanged: DeepSpeed, Accelerate, Trainer.

``export_plan(plan, ctx, out_dir)`` writes ``ds_config.json`` (DeepSpeed plans),
``accelerate_config.yaml``, ``trainer_args.json``, ``plan.json`` (the plan and what it was
expected to use), ``train.py`` (the training script, ``templates/train.py``) and a short
``README.md`` with the launch command. May import results, techniques, plan and specs (never
an evaluator: the measured evaluator launches these files, so it sits above); imports without
torch. ``train.py`` imports ``autofit.launch`` on the training machine: it is data here.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from autofit.errors import ExportError
from autofit.export.accelerate import accelerate_config, accelerate_yaml, distributed_type, write_accelerate_yaml
from autofit.export.common import (
    ACCELERATE_CONFIG_NAME,
    DS_CONFIG_NAME,
    PLAN_NAME,
    README_NAME,
    TRAIN_SCRIPT_NAME,
    TRAINER_ARGS_NAME,
    checked,
    write_files,
)
from autofit.export.deepspeed import NVME_PATH, deepspeed_config, validate
from autofit.export.trainer import MODEL_DIR, model_reference, trainer_args
from autofit.plan import Offload, OffloadDevice, Plan
from autofit.results import TrialResult
from autofit.specs import Target

__all__ = [
    "accelerate_config",
    "deepspeed_config",
    "export_files",
    "export_plan",
    "plan_record",
    "trainer_args",
    "write_accelerate_yaml",
]

LAUNCH = f"accelerate launch --config_file {ACCELERATE_CONFIG_NAME} {TRAIN_SCRIPT_NAME} --data train.jsonl"


def export_files(
    plan: Plan, ctx: Target, *, nvme_path: str = NVME_PATH, expected: TrialResult | None = None
) -> dict[str, str]:
    """The export as ``{file name: text}``, in the order a reader needs them; ``expected`` is the
    evaluation the plan was chosen by (its peak memory and tokens/s go to ``plan.json``)."""
    checked(plan, ctx)
    files: dict[str, str] = {}
    ds_file = None
    args = trainer_args(plan, ctx, deepspeed_config_file=DS_CONFIG_NAME)
    if plan.engine == "deepspeed":
        cfg = deepspeed_config(plan, ctx, nvme_path=nvme_path)
        validate(cfg, args["training_arguments"], ctx.cluster.world_size)  # as the Trainer will fill it
        files[DS_CONFIG_NAME] = _json(cfg)
        ds_file = DS_CONFIG_NAME
    files[ACCELERATE_CONFIG_NAME] = accelerate_yaml(plan, ctx, ds_file)
    files[TRAINER_ARGS_NAME] = _json(args)
    files[PLAN_NAME] = _json(plan_record(plan, ctx, expected))
    files[TRAIN_SCRIPT_NAME] = train_script()
    files.update(model_reference(ctx.model)[1])
    files[README_NAME] = _readme(plan, ctx, args, nvme_path)
    return files


def export_plan(
    plan: Plan,
    ctx: Target,
    out_dir: str | os.PathLike,
    *,
    nvme_path: str = NVME_PATH,
    expected: TrialResult | None = None,
) -> list[Path]:
    """Write the plan's files into ``out_dir`` (created if needed); returns their paths.

    Raises ``ExportError`` with one line when the directory cannot be written; nothing
    half-written is left behind.
    """
    return write_files(out_dir, export_files(plan, ctx, nvme_path=nvme_path, expected=expected))


def train_script() -> str:
    """The exported ``train.py``: the same for every plan, which it reads from the files beside it."""
    return resources.files(__package__).joinpath("templates", TRAIN_SCRIPT_NAME).read_text(encoding="utf-8")


def plan_record(plan: Plan, ctx: Target, expected: TrialResult | None = None) -> dict[str, Any]:
    """``plan.json``: the plan (which ``autofit.launch`` rebuilds), its target, and what the
    evaluation it was chosen by expects: memory per GPU, tokens/s of the whole cluster (null
    when the export has none)."""
    if expected is not None and expected.plan != plan:
        raise ExportError(f"the expected figures are of plan {expected.plan.plan_id}, not of {plan.plan_id}")
    record: dict[str, Any] = {
        "plan_id": plan.plan_id,
        "summary": plan.summary(),
        "plan": plan.as_dict(),
        "target": {
            "model": ctx.model.name,
            "task": ctx.model.family.task,
            "gpus": ctx.cluster.label,
            "world_size": ctx.cluster.world_size,
            "seq_len": ctx.workload.seq_len,
            "global_batch": ctx.workload.global_batch,
        },
        "expected": None,
    }
    if expected is not None and expected.memory is not None and expected.throughput is not None:
        record["expected"] = {
            "evaluator": expected.evaluator,
            "gpu": ctx.cluster.gpu.name,
            "peak_allocated_bytes": expected.memory.peak_allocated,
            "peak_reserved_bytes": expected.memory.peak_reserved,
            "device_total_bytes": expected.memory.device_total,
            "tokens_per_sec": expected.throughput.tokens_per_sec,
            "step_time_s": expected.throughput.step_time_s,
        }
    return record


def _json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def _allocator_note() -> str:
    """The caching-allocator setting the memory figures assumed (the simulator replays its
    allocations through PyTorch's allocator with it): the environment of this export."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if conf:
        return f"- Memory was estimated with `PYTORCH_CUDA_ALLOC_CONF={conf}`: launch with the same setting."
    return (
        "- Memory was estimated with PyTorch's default caching allocator (`PYTORCH_CUDA_ALLOC_CONF` unset): "
        "another setting (e.g. `expandable_segments:True`) changes the reserved memory."
    )


def _readme(plan: Plan, ctx: Target, args: dict, nvme_path: str) -> str:
    m, c, w = ctx.model, ctx.cluster, ctx.workload
    source = f" ({m.source})" if m.source and m.source != m.name else ""
    return "\n".join(
        [
            f"# autofit plan {plan.plan_id}",
            "",
            f"`{plan.summary()}`",
            "",
            f"{m.name}{source} on {c.label}: sequences of {w.seq_len} tokens, {w.global_batch} per optimizer step "
            + _batch_line(plan, c.world_size),
            "",
            "| file | what it sets |",
            "|---|---|",
            *_file_rows(plan, ctx),
            "",
            "## Launch",
            "",
            *_launch(plan, args),
            "",
            "## Check before launching",
            "",
            *_checks(plan, ctx, args, nvme_path),
            "",
        ]
    )


def _batch_line(plan: Plan, world: int) -> str:
    if plan.context_parallel == 1:
        return f"({plan.micro_batch} per GPU × {plan.grad_accum} accumulation steps × {world} GPU(s))."
    cp = plan.context_parallel
    return (
        f"({plan.micro_batch} per data-parallel rank × {plan.grad_accum} accumulation steps × "
        f"{plan.data_parallel(world)} data-parallel rank(s); each sequence split over {cp} GPUs by context "
        "parallelism, accelerate's `parallelism_config`)."
    )


def _file_rows(plan: Plan, ctx: Target) -> list[str]:
    c = ctx.cluster
    rows = []
    if plan.engine == "deepspeed":
        rows.append(
            f"| `{DS_CONFIG_NAME}` | DeepSpeed ZeRO-{plan.zero_stage}: buckets, offload, optimizer; batch "
            f"sizes, precision and the optimizer's hyperparameters are `auto`, filled by the Trainer from "
            f"`{TRAINER_ARGS_NAME}` (change them there) |"
        )
    rows += [
        f"| `{ACCELERATE_CONFIG_NAME}` | `accelerate launch`: {c.world_size} process(es) on "
        f"{c.nodes} machine(s), {distributed_type(plan, ctx)} |",
        f"| `{TRAINER_ARGS_NAME}` | keyword arguments for `TrainingArguments`, `from_pretrained`, "
        "PEFT and bitsandbytes; data and loss settings |",
        f"| `{PLAN_NAME}` | the plan, its target, and the peak memory and tokens/s it was expected to reach |",
        f"| `{TRAIN_SCRIPT_NAME}` | the training script: the Hugging Face Trainer on the files above |",
    ]
    return rows


def _launch(plan: Plan, args: dict) -> list[str]:
    """How to start it: the command, train.py's options, where the model comes from."""
    model = args["model"]
    if model == MODEL_DIR:
        weights = (
            f"The export carries the model's config only (`{MODEL_DIR}/config.json`): pass `--model` with "
            "the hub id or the folder of its weights."
        )
    else:
        weights = f"`from_pretrained` loads `{model}`; `--model` loads another hub id or folder."
    extra = [_no_switch_line(args)]
    if plan.engine == "fsdp":
        extra.append(
            "FSDP checkpoints are sharded (`SHARDED_STATE_DICT`); `accelerate merge-weights` joins them into one file."
        )
    return [
        "On the training machine (`pip install autofit[train]`: `train.py` imports `autofit.launch`), from "
        "this directory:",
        "",
        f"    {LAUNCH}",
        "",
        f"`{TRAIN_SCRIPT_NAME}` trains with the Hugging Face Trainer on the files beside it. `--data` is a "
        "local .jsonl/.json/.parquet/.csv/.txt file or a datasets hub id, `--text-field` its text column "
        "(default `text`); `--output-dir` (default `out`) and `--max-steps` (default one epoch). " + weights,
        "At the end, `<output-dir>/autofit_result.json` holds what the plan expected beside what the run got "
        "(peak memory per GPU, tokens/s). " + " ".join(extra),
    ]


# the techniques of trainer_args.json that have no Trainer switch (train.py's PlanTrainer applies them)
_NO_SWITCH = {
    "selective_checkpointing": "selective checkpointing",
    "activation_offloading": "activation offloading",
    "optimizer_in_backward": "optimizer step in backward",
}


def _no_switch_line(args: dict) -> str:
    """What train.py's ``autofit.launch.PlanTrainer`` applies for this plan (the Trainer has no switch for it)."""
    parts = [name for key, name in _NO_SWITCH.items() if args[key]["enabled"]]
    if args["fused_loss"]["enabled"] or args["fused_kernels"]["enabled"]:
        parts.append("autofit's stand-ins for Liger's kernels where Liger cannot run")
    if not parts:
        return "The Trainer has a switch for everything this plan uses."
    return f"`autofit.launch.PlanTrainer` applies what the Trainer has no switch for: {', '.join(parts)}."


def _checks(plan: Plan, ctx: Target, args: dict, nvme_path: str) -> list[str]:
    before = []
    if plan.engine == "deepspeed" and plan.offload_device is OffloadDevice.NVME and plan.offload is not Offload.NONE:
        before.append(
            f"- `nvme_path` in `{DS_CONFIG_NAME}` is `{nvme_path}`: make it a directory on a local "
            "NVMe drive of every node."
        )
    if ctx.cluster.nodes > 1:
        before.append("- On node i, add `--machine_rank i --main_process_ip <address of node 0>` to the command.")
    before += [f"- {n[0].upper()}{n[1:]}." for n in args["notes"]]
    before.append(_allocator_note())
    data = args["data"]
    before.append(
        f"- Batches: `{data['data_collator']}` with {json.dumps(data['data_collator_kwargs'])}, "
        f"sequences up to {data['max_length']} tokens."
    )
    if args["fused_loss"]["enabled"]:
        fl = args["fused_loss"]
        before.append(f"- Fused loss: {fl['kernel'] or 'no kernel for this model'}; {fl['fallback']}.")
    if args["fused_kernels"]["enabled"]:
        fk = args["fused_kernels"]
        before.append(f"- Fused kernels: {fk['kernels']}; {fk['fallback']}.")
    for key, name in _NO_SWITCH.items():
        if args[key]["enabled"]:
            entry = args[key]
            before.append(
                f"- {name[0].upper()}{name[1:]} (no Trainer switch; train.py applies it): in your own script, "
                f"`{entry['helper']}`; {entry['how']}."
            )
    return before
