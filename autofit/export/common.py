"""What every exported file shares: names, the hyperparameters, safe writes.

The hyperparameters are written once, in ``trainer_args.json``; ``ds_config.json`` leaves them
``"auto"`` for the Trainer to fill (``export.deepspeed``), so the two files cannot disagree.
"""

from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from autofit.errors import ExportError
from autofit.plan import Plan, validate_plan
from autofit.specs import Target

DS_CONFIG_NAME = "ds_config.json"
ACCELERATE_CONFIG_NAME = "accelerate_config.yaml"
TRAINER_ARGS_NAME = "trainer_args.json"
README_NAME = "README.md"
PLAN_NAME = "plan.json"
TRAIN_SCRIPT_NAME = "train.py"


@dataclass(frozen=True)
class Hyperparameters:
    """Optimizer settings that change neither memory nor speed; the user tunes them in trainer_args.json."""

    learning_rate: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    max_grad_norm: float


def hyperparameters(plan: Plan) -> Hyperparameters:
    """Common starting points: 2e-5 for full fine-tuning, 2e-4 for LoRA/QLoRA adapters."""
    return Hyperparameters(
        learning_rate=2e-4 if plan.is_peft else 2e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
    )


def checked(plan: Plan, ctx: Target) -> Plan:
    """The plan, validated against the target: an invalid plan has no faithful config files."""
    return validate_plan(plan, ctx.model, ctx.cluster, ctx.workload)


def write_files(out_dir: str | os.PathLike, files: dict[str, str]) -> list[Path]:
    """Write ``{name: text}`` into ``out_dir`` all or nothing.

    Every file goes to a temporary name in the directory first and is renamed only once
    all are written, so a full disk or a permission problem leaves no half-written file.
    Files are created with mode 0o666 minus the user's umask, like any editor's. A name may hold
    a folder (``model/config.json``).
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ExportError(f"cannot write the configs to {out}: it exists and is not a directory") from None
    except OSError as exc:
        raise ExportError(f"cannot create the output directory {out}: {_reason(exc)}") from None
    staged: list[tuple[Path, Path]] = []
    try:
        for name, text in files.items():
            final = out / name
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".{final.name}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            staged.append((tmp, final))
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        for tmp, final in staged:
            os.replace(tmp, final)
    except OSError as exc:
        for tmp, _ in staged:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        raise ExportError(f"cannot write the configs to {out}: {_reason(exc)}") from None
    return [final for _, final in staged]


def _reason(exc: OSError) -> str:
    hint = {
        errno.ENOSPC: "free some space or pick another --out",
        errno.EDQUOT: "free some space or pick another --out",
        errno.EACCES: "pick a directory you can write to",
        errno.EPERM: "pick a directory you can write to",
        errno.EROFS: "the file system is read-only; pick another --out",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
    }.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({hint})" if hint else text
