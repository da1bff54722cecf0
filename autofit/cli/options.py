"""Reusable option stacks (sqlite-utils style) and the CLI edge (errors, Ctrl-C)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from autofit.errors import AutofitError
from autofit.plan import (
    Attention,
    Checkpointing,
    LoraTargets,
    Method,
    Offload,
    OffloadDevice,
    Optimizer,
    Precision,
    Sharding,
)
from autofit.specs.units import parse_duration, parse_size  # noqa: F401 - the CLI's parsers


def handle_errors(fn: Callable) -> Callable:
    """Turn autofit's errors into one clear line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AutofitError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            interrupted()

    return wrapper


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def interrupted() -> None:
    """Ctrl-C: one line and exit 130, wherever it landed (the library marked its study)."""
    click.echo("interrupted: what finished is stored; `autofit search ... --resume` continues a search", err=True)
    sys.exit(EXIT_INTERRUPTED)


class ParallelType(click.ParamType):
    """``auto`` or a positive count of local workers."""

    name = "auto|K"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) >= 1:
            return int(text)
        self.fail(f"{value!r} is neither auto nor a count of workers (1, 2, ...)", param, ctx)


class EnumChoice(click.Choice):
    """A plan field's values (the help shows ours), also under the names of the tools people come
    from (``autofit.plan.ALIASES``: ``flash_attention_2``, ``adamw_torch``, ``bf16``); it gives the
    canonical value, which the plan line echoes."""

    def __init__(self, enum) -> None:
        super().__init__(enum.values(), case_sensitive=False)
        self.enum = enum

    def convert(self, value, param, ctx):
        try:
            return self.enum(value).value
        except ValueError:
            self.fail(f"{value!r} is none of {self.enum.choices_text()}", param, ctx)


def target_options(fn: Callable | None = None, *, required: bool = True) -> Callable:
    """--model, --gpus and the cluster/workload shape (``required=False`` where a study file may give them)."""
    if fn is None:
        return lambda f: target_options(f, required=required)
    decorators = [
        click.option(
            "--model",
            "-m",
            required=required,
            help="Registered name (`autofit models`), a config.json or directory, or a hub id.",
        ),
        click.option(
            "--gpus",
            "-g",
            required=required,
            help="GPUs per node as COUNTxGPU: a catalog GPU (`autofit gpus`), e.g. 2xA10, 8xH100, 1xcpu; "
            "a memory, e.g. 2x24GiB (rates assumed, and said); or a YAML spec, e.g. 2xcard.yaml (docs/DESIGN.md).",
        ),
        click.option(
            "--nodes",
            "--num-machines",
            "nodes",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Number of nodes (accelerate's --num-machines).",
        ),
        click.option(
            "--inter-node-gbps",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Each node's network between nodes, GB/s one way, all its NICs together (InfiniBand/RoCE; "
            "8x400 Gb/s = 400) [default: 25, one 200 Gb/s NIC]. Used with --nodes > 1.",
        ),
        click.option(
            "--host-mem",
            default=None,
            help="Host memory per node for offload, e.g. 256GiB (default: this node's RAM where the GPUs are "
            "this machine's, else twice the node's GPU memory, which the answer names as assumed).",
        ),
        click.option(
            "--seq-len", type=click.IntRange(min=1), default=2048, show_default=True, help="Sequence length in tokens."
        ),
        click.option(
            "--global-batch",
            type=click.IntRange(min=1),
            default=None,
            help=(
                "Sequences per optimizer step (default: --micro-batch × --grad-accum × GPUs where both are given, "
                "else 16 rounded up to a multiple of the GPU count)."
            ),
        ),
        click.option(
            "--lengths",
            "lengths_path",
            type=click.Path(dir_okay=False),
            default=None,
            help="Dataset lengths: a .jsonl with text/num_tokens, or a .json histogram.",
        ),
        click.option(
            "--headroom",
            type=click.FloatRange(0.0, 0.9),
            default=0.05,
            show_default=True,
            help="Fraction of GPU memory kept free.",
        ),
    ]
    for d in reversed(decorators):
        fn = d(fn)
    return fn


def plan_options(fn: Callable) -> Callable:
    """One option per Plan field."""
    decorators = [
        click.option("--method", type=EnumChoice(Method), default="full", show_default=True),
        click.option(
            "--lora-rank",
            type=click.IntRange(min=1),
            default=None,
            help="LoRA rank (lora, lora-8bit, qlora; default 16).",
        ),
        click.option("--lora-targets", type=EnumChoice(LoraTargets), default="all-linear", show_default=True),
        click.option(
            "--lora-dropout",
            type=click.FloatRange(0.0, 1.0, max_open=True),
            default=None,
            help="Dropout on the adapters' inputs (lora, lora-8bit, qlora; peft's default: 0.0).",
        ),
        click.option(
            "--precision",
            type=EnumChoice(Precision),
            default=None,
            help="Default: bf16-mixed where the GPU has bf16, else fp16-mixed.",
        ),
        click.option("--optimizer", type=EnumChoice(Optimizer), default="adamw", show_default=True),
        click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True),
        click.option(
            "--grad-accum", type=click.IntRange(min=1), default=None, help="Default: what the global batch needs."
        ),
        click.option("--checkpointing", type=EnumChoice(Checkpointing), default="none", show_default=True),
        click.option(
            "--checkpoint-every",
            type=click.IntRange(min=2),
            default=None,
            metavar="K",
            help="With --checkpointing selective: checkpoint every K-th block (blocks K, 2K, ... counted from 1; "
            "torchtitan's selective_ac_option). Default: 2, unless --checkpoint-ops.",
        ),
        click.option(
            "--checkpoint-ops/--no-checkpoint-ops",
            default=False,
            show_default=True,
            help="With --checkpointing selective: checkpoint every block, but save the outputs of its matmuls and "
            "attention kernel (every second bias-free matmul recomputed): torchtitan's op-level SelectiveAC.",
        ),
        click.option(
            "--attention",
            type=EnumChoice(Attention),
            default=None,
            help="Default: sdpa where the model implements it, else eager (BLOOM).",
        ),
        click.option("--sharding", type=EnumChoice(Sharding), default="none", show_default=True),
        click.option("--offload", type=EnumChoice(Offload), default="none", show_default=True),
        click.option("--offload-device", type=EnumChoice(OffloadDevice), default="cpu", show_default=True),
        click.option("--packing/--no-packing", default=False, show_default=True),
        click.option("--fused-loss/--no-fused-loss", default=False, show_default=True),
        click.option(
            "--fused-kernels/--no-fused-kernels",
            default=False,
            show_default=True,
            help="Liger's fused RMSNorm, SwiGLU and RoPE kernels (llama-like blocks: llama, mistral, qwen2, qwen3).",
        ),
    ]
    for d in reversed(decorators + _technique_options()):
        fn = d(fn)
    return fn


def _technique_options() -> list[Callable]:
    """plan_options' switches: the techniques beside the knobs every plan sets."""
    return [
        click.option(
            "--offload-activations/--no-offload-activations",
            default=False,
            show_default=True,
            help="Saved activations to host memory in forward, back in backward (torchtune's activation offloading).",
        ),
        click.option(
            "--optimizer-in-backward/--no-optimizer-in-backward",
            default=False,
            show_default=True,
            help="Step each parameter as soon as its gradient is made, and free it (torchtune's optimizer_in_bwd; "
            "one GPU, grad_accum 1).",
        ),
        click.option(
            "--torch-compile/--no-torch-compile",
            default=False,
            show_default=True,
            help="torch.compile of every decoder block with inductor (accelerate's regional compilation; "
            "the Trainer's torch_compile).",
        ),
        click.option(
            "--context-parallel",
            type=click.IntRange(min=1),
            default=None,
            metavar="N",
            help="Split every sequence over N GPUs (torch's ring attention over FSDP2: --sharding fsdp, sdpa; "
            "accelerate's ParallelismConfig cp_size). Data-parallel ranks: GPUs / N.",
        ),
    ]


def measured_options(fn: Callable) -> Callable:
    """How ``--evaluator measured`` runs its trials; ``--cpu-mem-budget`` also sets the CPU target's memory."""
    decorators = [
        click.option(
            "--cpu-mem-budget",
            default=None,
            metavar="SIZE",
            help="Memory of each CPU rank (--gpus Nxcpu), e.g. 600MiB: every evaluator judges by it, "
            "measured runs stop with OOM at the first allocation over it.",
        ),
        click.option(
            "--steps", type=click.IntRange(min=1), default=None, help="Measured: timed steps per trial [default: 3]."
        ),
        click.option(
            "--warmup-steps",
            type=click.IntRange(min=1),
            default=None,
            help="Measured: warm-up steps per trial, where memory is tracked (2 steps at least) [default: 2].",
        ),
        click.option(
            "--trial-timeout", default=None, help="Measured: stop a trial after this long, e.g. 10m [default: 15m]."
        ),
        click.option(
            "--work-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="Measured: keep each trial's files (spec, exported configs, logs, results) here.",
        ),
    ]
    for d in reversed(decorators):
        fn = d(fn)
    return fn


def evaluator_options(opts: dict) -> dict:
    """The measured evaluator's keyword options from ``measured_options`` (unset ones left out).

    ``--work-dir`` is checked here, so a bad one is refused before a study is created."""
    out = {}
    if opts.get("steps") is not None:
        out["timed_steps"] = opts["steps"]
    if opts.get("warmup_steps") is not None:
        out["warmup_steps"] = opts["warmup_steps"]
    if opts.get("trial_timeout") is not None:
        out["timeout_s"] = parse_duration(opts["trial_timeout"])
    if opts.get("work_dir"):
        from autofit.evaluators.measured import check_work_dir

        out["work_dir"] = check_work_dir(opts["work_dir"])  # here, before any study is created
    return out


def evaluator_option(fn: Callable) -> Callable:
    """--evaluator (``--backend`` is its earlier name, still read): which fidelity evaluates."""
    from autofit.evaluators import EVALUATOR_CHOICES

    return click.option(
        "--evaluator",
        "--backend",
        "evaluator",
        type=click.Choice(EVALUATOR_CHOICES),
        default="auto",
        show_default=True,
        help="auto: measure on matching local GPUs, else the most faithful estimator.",
    )(fn)


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")(fn)


def db_option(fn: Callable) -> Callable:
    """--db URL; without it the Store reads $AUTOFIT_DB, else the default SQLite file."""
    return click.option(
        "--db",
        "db_url",
        default=None,
        metavar="URL",
        help="Database: a SQLite file path, sqlite:///PATH or postgresql+psycopg://USER@HOST/DB "
        "(default: $AUTOFIT_DB, an absolute path or a URL, else autofit.db in your data directory).",
    )(fn)
