"""One rank of a measured trial: a short real training run of one plan (the child process).

Started by :mod:`autofit.evaluators.measured` as ``python -m autofit.evaluators._trial_main
SPEC`` (or under ``accelerate launch`` with the exported config); writes ``progress.jsonl``
(rank 0), ``rank-<r>.json`` (every rank) and ``result.json`` (rank 0) next to ``SPEC`` and
exits with ``EXIT_OOM`` on out-of-memory. Imports only the standard library at module
level (torch, accelerate and autofit's runtime lazily), so the parent may import its
protocol constants. The protocol and the design: docs/EVALUATORS.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAULT_ENV = "AUTOFIT_TEST_TRIAL_FAULT"
EXIT_OOM = 3  # any other non-zero exit is a failure
TAIL_LINES = 20


# -- the spec --------------------------------------------------------------------------------
def load_spec(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)


# -- faults (tests only) ------------------------------------------------------------------------
def injected_fault(plan_id: str, step: int) -> None:
    """Misbehave for real at ``step`` when ``AUTOFIT_TEST_TRIAL_FAULT`` asks for it (tests)."""
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        kind, _, rest = item.partition("@")
        at, _, only = rest.partition(":")
        if int(at) != step or (only and only != plan_id):
            continue
        if kind == "crash":
            raise RuntimeError(f"injected crash at step {step} ({FAULT_ENV})")
        if kind == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(3600)


# -- memory probes --------------------------------------------------------------------------------
def rss_bytes() -> int:
    import psutil  # lazily: this module imports only the standard library at its top

    return psutil.Process().memory_info().rss  # Linux: /proc/self/statm's resident pages × the page size


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def cuda_device_used(index: int) -> int | None:
    """Device-level bytes in use (what nvidia-smi shows): NVML when importable, else mem_get_info."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:  # noqa: BLE001 - NVML missing or not permitted: torch's figure
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return int(total - free)


# -- the engine ---------------------------------------------------------------------------------
class Setup:
    """What one rank trains with: the (prepared) model, optimizer and how a step is driven."""

    def __init__(
        self,
        model,
        optimizer,
        *,
        accelerator=None,
        backward=None,
        micro_batch_context=None,
        engine: dict[str, Any] | None = None,
        step_plan=None,
    ):
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.backward, self.micro_batch_context = backward, micro_batch_context
        self.engine = engine or {}
        self.step_plan = step_plan


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def build(spec, plan, device: str, seed: int):
    from autofit.evaluators import runtime as rt
    from autofit.plan import Method, Sharding

    if plan.method is Method.LORA_8BIT:  # never sharded (plan_problems): int8 weights as transformers loads them
        return rt.build_quantized_model(spec, plan, device, seed=seed)
    if plan.method is Method.QLORA:
        import torch

        sharded = plan.sharding in (Sharding.ZERO3, Sharding.FSDP)
        storage = rt.half_dtype(plan) if sharded else None  # the export's bnb_4bit_quant_storage
        return rt.build_quantized_model(spec, plan, device, seed=seed, quant_storage=storage or torch.uint8)
    return rt.build_model(spec, plan, device, seed=seed)


def liger(spec, plan, device: str, model) -> bool:
    """Liger's kernels where the exported trainer_args ask for them and they run (CUDA,
    liger-kernel installed, a family it patches): the Trainer's own call, on the base model."""
    from autofit.techniques import liger_config

    if not (plan.fused_loss or plan.fused_kernels) or device != "cuda" or not spec.family.liger:
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, **liger_config(plan))
    return True


def _loss_plan(spec, plan, device: str, model):
    """The plan the step runs: with Liger patched in, the model's own forward computes the
    fused loss and runs the fused kernels (StepRunner's plain path); otherwise runtime's
    chunked loss and ``evaluators.fused`` stand in."""
    if liger(spec, plan, device, model):
        return plan.replace(fused_loss=False, fused_kernels=False), ("liger" if plan.fused_loss else None)
    return plan, ("chunked" if plan.fused_loss else None)


def set_up(spec, plan, device: str, launcher: str, seed: int, tracker=None) -> Setup:
    """Build the model and optimizer; hand them to the engine the launcher configured."""
    import torch

    from autofit.evaluators import runtime as rt
    from autofit.plan import Checkpointing

    if launcher == "python":  # one process, plain torch
        model = build(spec, plan, device, seed)
        step_plan, fused = _loss_plan(spec, plan, device, model)
        optimizer = rt.make_optimizer(plan, model)
        engine = {
            "distributed_type": "NO",
            "world_size": 1,
            "model_class": type(model).__name__,
            "optimizer_class": type(optimizer).__name__,
            "fused_loss": fused,
            **_model_facts(model),
        }
        return Setup(model, optimizer, engine=engine, step_plan=step_plan)

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from autofit.evaluators import engines

    use_ds = _flag("ACCELERATE_USE_DEEPSPEED")
    # DeepSpeed: Accelerator(cpu=True) would silently drop it; its CPU accelerator needs no flag
    plugin = {"deepspeed_plugin": _deepspeed_plugin()} if use_ds else {}
    with engines.parallelism_deferred() if device == "cpu" else contextlib.nullcontext():
        acc = Accelerator(cpu=device == "cpu" and not use_ds, gradient_accumulation_steps=plan.grad_accum, **plugin)
    if plan.context_parallel > 1 and device == "cpu":
        from autofit.evaluators import ring

        # torch's ring has no handler for the CPU's attention kernel; its buffers are tracked
        ring.register(tracker.again if tracker is not None else None)
    engine: dict[str, Any] = {
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    }
    step_plan = plan
    fsdp_by_us = engines.fsdp_on_cpu(acc)
    if acc.distributed_type is DistributedType.FSDP and plan.checkpointing is Checkpointing.FULL:
        # FSDP checkpoints each wrapped layer itself (fsdp_activation_checkpointing); the
        # model's own checkpointing stays off, as the exported trainer_args say
        step_plan = plan.replace(checkpointing=Checkpointing.NONE)
    with _zero3_init(acc) if use_ds else contextlib.nullcontext():
        model = build(spec, step_plan, device, seed)
    step_plan, engine["fused_loss"] = _loss_plan(spec, step_plan, device, model)
    if use_ds:
        from accelerate.utils import DummyOptim

        ds_cfg = acc.state.deepspeed_plugin.deepspeed_config
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = DummyOptim(params) if "optimizer" in ds_cfg else rt.make_optimizer(plan, model)
    else:
        optimizer = rt.make_optimizer(plan, model)
    facts = _model_facts(model)
    model, optimizer = acc.prepare(model, optimizer)
    engine.update(engines.describe(acc, model, optimizer), **facts)
    engine["fsdp_applied_by"] = engines.fsdp_applied_by(acc, fsdp_by_us)
    # accelerator.accumulate and accelerator.backward around each micro-batch, as the Trainer does
    backward = acc.backward
    if use_ds:
        backward = _deepspeed_backward(acc, model, tracker)
    return Setup(
        model,
        optimizer,
        accelerator=acc,
        backward=backward,
        micro_batch_context=_micro_batch_context(acc, model, plan),
        engine=engine,
        step_plan=step_plan,
    )


def _micro_batch_context(acc, model, plan):
    """``accelerator.accumulate`` around each micro-batch, as the Trainer does; under context
    parallelism also what the Trainer's ``training_step`` enters around forward and backward: its
    inputs prepared (``runtime.context_parallel_inputs``) and sharded along the sequence by
    ``accelerator.maybe_context_parallel``, which runs attention through torch's ring."""
    if plan.context_parallel == 1:
        return lambda i, n, batch: acc.accumulate(model)
    from autofit.evaluators import runtime as rt

    def context(i, n, batch):
        stack = contextlib.ExitStack()
        stack.enter_context(acc.accumulate(model))
        buffers = rt.context_parallel_inputs(batch)
        dims = [1] * len(buffers)
        stack.enter_context(acc.maybe_context_parallel(buffers, dims, no_restore_buffers=set(buffers)))
        return stack

    return context


def _deepspeed_plugin():
    """accelerate's DeepSpeed plugin on the exported ds_config.json as the Trainer runs it: its
    ``"auto"`` values filled from the trainer_args.json beside it (``export.deepspeed.trainer_values``,
    transformers' rules) before accelerate fills any itself, as ``TrainingArguments`` does before the
    Trainer's accelerator exists. Left to accelerate, bf16 would follow its own mixed precision,
    which the exported accelerate config leaves out next to a DeepSpeed file (accelerate refuses
    both). A relative path is read from the working directory, as accelerate reads it."""
    from accelerate import DeepSpeedPlugin

    from autofit.export.common import TRAINER_ARGS_NAME
    from autofit.export.deepspeed import filled, trainer_values

    ds_file = Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"])
    ta = json.loads((ds_file.parent / TRAINER_ARGS_NAME).read_text())["training_arguments"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DeepSpeedPlugin(hf_ds_config=filled(json.loads(ds_file.read_text()), trainer_values(ta, world)))


@contextlib.contextmanager
def _zero3_init(acc):
    """Build under ``deepspeed.zero.Init`` exactly when the exported ``zero3_init_flag`` says so.

    accelerate registers its DeepSpeed config with transformers whatever the flag, and
    ``from_config`` then partitions at construction for any ZeRO-3 config; the export turns
    the flag off for QLoRA (from_pretrained skips zero.Init for 4-bit weights), so here too.
    """
    plugin = acc.state.deepspeed_plugin
    if plugin.zero_stage != 3 or _flag("ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _deepspeed_backward(acc, engine, tracker):
    """``accelerator.backward`` under DeepSpeed (engine backward, and its step at the accumulation
    boundary), with the engine's step seen by the tracker as the optimizer phase it is."""

    def backward(loss):
        boundary = acc.sync_gradients
        engine.set_gradient_accumulation_boundary(is_boundary=boundary)
        engine.backward(loss)
        if boundary:
            with tracker.in_phase("optimizer") if tracker is not None else contextlib.nullcontext():
                engine.step()

    return backward


def _model_facts(model) -> dict[str, Any]:
    """What the plan made of the model (before an engine reshapes it): 4-bit layers, trainables, checkpointing."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = getattr(model, "get_base_model", lambda: model)()
    return {
        "linear4bit": sum(type(m).__name__ == "Linear4bit" for m in model.modules()),
        # bitsandbytes' own layers (peft's lora.bnb wrapper shares the class name)
        "linear8bit": sum(
            type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")
            for m in model.modules()
        ),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in trainable}),
        "checkpointing": bool(
            getattr(inner, "is_activation_checkpointing", getattr(inner, "is_gradient_checkpointing", False))
        ),
    }


def _engine_marks(tracker, setup: Setup) -> None:
    """Tell the tracker which engine buffers are gradients / optimizer state / weights."""
    model = setup.model
    if type(model).__name__ == "DeepSpeedEngine":
        zopt = model.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            tracker.mark(list(getattr(zopt, attr, None) or []), "optimizer")
        for attr in ("averaged_gradients",):
            grads = getattr(zopt, attr, None)
            if isinstance(grads, dict):
                tracker.mark([g for gs in grads.values() for g in (gs or []) if g is not None], "gradients")
        tracker.mark([p.ds_tensor for p in model.module.parameters() if hasattr(p, "ds_tensor")], "weights")
    inner = getattr(setup.optimizer, "optimizer", setup.optimizer)
    inner = getattr(inner, "optimizer", inner)  # DeepSpeed's ZeRO optimizer wraps torch's
    params = {id(p) for p in model.parameters()}
    masters = [p for g in getattr(inner, "param_groups", []) for p in g["params"] if id(p) not in params]
    tracker.mark([_local(p) for p in masters], "optimizer")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# -- the run ------------------------------------------------------------------------------------
class Trial:
    def __init__(self, spec_path: str):
        self.path = Path(spec_path)
        self.dir = self.path.parent
        self.spec = load_spec(spec_path)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.memory: dict[str, Any] = {}
        self.tracker = None
        self.tracking = False  # the tracker is entered (setup and warm-up steps)

    def progress(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open(self.dir / "progress.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def write(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.dir / name)

    def write_rank(self, data: dict[str, Any]) -> None:
        self.write(f"rank-{self.rank}.json", {"rank": self.rank, "pid": os.getpid(), **data})

    def run(self) -> dict[str, Any]:
        """Set up, run the warm-up steps under the tracker and the timed steps without it."""
        from autofit.evaluators.memtrack import StorageTracker
        from autofit.plan import Plan
        from autofit.specs import ModelSpec, Workload

        s = self.spec
        spec, plan, wl = ModelSpec.from_dict(s["model"]), Plan.from_dict(s["plan"]), Workload.from_dict(s["workload"])
        dev = _torch_device(s["device"])
        budget = s.get("cpu_mem_budget") if dev.type != "cuda" else None
        self.tracker = StorageTracker(budget=budget, skip_meta=True)
        self.write_rank({"status": "running"})

        self.tracker.__enter__()
        self.tracking = True
        try:
            setup, runner = self._set_up(spec, plan, dev)
            steps = self._train(runner, setup, spec, plan, wl, dev)
            self._stop_tracking(setup)  # no timed steps
        finally:
            if self.tracking:
                self.tracker.__exit__(None, None, None)
        runner.close()
        self._final_memory(dev, steps.device_used)
        return {
            "engine": setup.engine,
            "step_times_s": steps.times,
            "real_tokens": steps.tokens,
            "losses": steps.losses,
            "loss_finite": all(math.isfinite(x) for x in steps.losses),
        }

    def _set_up(self, spec, plan, dev) -> tuple[Setup, Any]:
        """Model, optimizer and engine under the tracker's ``setup`` phase; the step runner."""
        import torch

        from autofit.evaluators import runtime as rt

        tracker, cuda = self.tracker, dev.type == "cuda"
        with tracker.in_phase("setup"):
            setup = set_up(spec, plan, dev.type, self.spec["launcher"], int(self.spec.get("seed", 0)), tracker)
        model = setup.model
        tracker.track(list(model.parameters()) + list(model.buffers()), "weights")
        _engine_marks(tracker, setup)
        self.memory["setup_peak_bytes"] = tracker.peak
        # the training step's peak from here on, as torch.cuda.reset_peak_memory_stats starts one
        tracker.reset_peak()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        runner = rt.StepRunner(
            spec,
            setup.step_plan,
            model,
            setup.optimizer,
            device=dev,
            tracker=tracker,
            backward=setup.backward,
            micro_batch_context=setup.micro_batch_context,
        )
        self.write_rank({"status": "running", "engine": setup.engine})
        return setup, runner

    def _stop_tracking(self, setup: Setup) -> None:
        """Record the tracker's anatomy of the warm-up steps and leave it (once)."""
        if not self.tracking:
            return
        tracker = self.tracker
        _engine_marks(tracker, setup)
        snap = tracker.snapshot()
        self.memory.update(
            tracked_peak=tracker.peak, components=snap.components, peak_phase=snap.peak_phase, peak_step=snap.peak_step
        )
        tracker.__exit__(None, None, None)
        self.tracking = False

    def _train(self, runner, setup: Setup, spec, plan, wl, dev) -> _Steps:
        """Warm-up steps (tracked: memory; two at least), then timed steps (untracked: speed); progress per step."""
        from autofit.evaluators import runtime as rt

        cuda = dev.type == "cuda"
        warmup, timed = int(self.spec["warmup_steps"]), int(self.spec["timed_steps"])
        # memory is tracked through the second step at least: the optimizer's states exist only
        # from the first step's end, and the steady state the estimators predict has them
        tracked = max(warmup, min(2, warmup + timed))
        # a compiled plan on a GPU: the tracked steps run the stand-in for torch.compile (dynamo
        # compiles nothing under the tracker), then torch.compile itself compiles the blocks in
        # one more untimed step, and the timed steps run what it compiled (on the CPU the stand-in
        # runs throughout: inductor's C++ compile would be most of a CPU trial)
        compile_at = tracked if plan.torch_compile and cuda else None
        cp = plan.context_parallel
        first_timed = warmup if compile_at is None else compile_at + 1
        out = _Steps()
        for step in range(first_timed + timed):
            if step == tracked:  # later steps run untracked: its Python bookkeeping would slow them
                self._stop_tracking(setup)
            if step == compile_at:
                self._compile(runner, dev)
            injected_fault(plan.plan_id, step)
            # warm-up steps take the worst case of the length distribution (memory), timed steps
            # samples of it (speed); ranks see different data, but the ranks of a context-parallel
            # group the same rows, each training on 1/cp of their tokens (accelerate's mesh puts cp
            # inside dp_shard)
            row = step * (self.world // cp) + self.rank // cp
            batches = rt.batches_for(spec, plan, wl, dev, step=row, worst_case=step < warmup)
            n_tok = sum(rt.real_tokens(b) for b in batches) // cp
            loss, dt = _timed_step(runner, batches, step, cuda)
            if cuda:
                out.device_used.append(cuda_device_used(dev.index))
            out.losses.append(loss)
            if step >= first_timed:
                out.times.append(dt)
                out.tokens.append(n_tok)
            peak = self._cuda_peak(dev)[0] if cuda else self.tracker.peak
            self.progress(
                {
                    "step": step,
                    "warmup": step < first_timed,
                    "step_time_s": dt,
                    "tokens_per_sec": n_tok * self.world / dt,
                    "peak_bytes": int(peak),
                }
            )
        return out

    def _compile(self, runner, dev) -> None:
        """torch.compile of the blocks in place of the tracked steps' stand-in; CUDA's peaks from here
        on are the compiled steps' own (``compiled_peak_allocated``), the run's the larger of the two."""
        import torch

        self.memory["standin_peak_allocated"], self.memory["standin_peak_reserved"] = self._cuda_peak(dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        runner.compile_blocks()

    def _cuda_peak(self, dev) -> tuple[int, int]:
        """CUDA's peak allocated and reserved bytes of the run (over a compiled plan's stand-in steps too)."""
        import torch

        return (
            max(int(torch.cuda.max_memory_allocated(dev)), int(self.memory.get("standin_peak_allocated", 0))),
            max(int(torch.cuda.max_memory_reserved(dev)), int(self.memory.get("standin_peak_reserved", 0))),
        )

    def _final_memory(self, dev, device_used: list[int | None]) -> None:
        """The rank's totals: CUDA's allocator and device figures, or the tracker's on the CPU. A
        compiled plan's are the larger of its stand-in steps' (whose ops run unfused) and its compiled
        steps' (``compiled_peak_allocated``, what a launched run holds)."""
        import torch

        if dev.type == "cuda":
            if "standin_peak_allocated" in self.memory:
                self.memory["compiled_peak_allocated"] = int(torch.cuda.max_memory_allocated(dev))
            peak, reserved = self._cuda_peak(dev)
            self.memory.update(
                peak_allocated=peak,
                peak_reserved=reserved,
                device_total=int(max(device_used)) if device_used else 0,
            )
        else:
            peak = int(self.memory["tracked_peak"])
            # no caching allocator and no context on the CPU: the tracked tensors are the device
            self.memory.update(peak_allocated=peak, peak_reserved=peak, device_total=peak)
        self.memory.update(rss_bytes=rss_bytes(), rss_peak_bytes=rss_peak_bytes())


@dataclass
class _Steps:
    """What the steps of a trial leave: timed steps' seconds and real tokens, every step's loss
    and device-level bytes (CUDA)."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    device_used: list[int | None] = field(default_factory=list)


def _torch_device(device: str):
    """The rank's torch device: its ``LOCAL_RANK`` GPU (made current) on CUDA, else the CPU."""
    import torch

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _timed_step(runner, batches, step: int, cuda: bool) -> tuple[float, float]:
    """One training step and its wall time (CUDA synchronized on both sides)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = runner.step(batches, step=step)
    if cuda:
        torch.cuda.synchronize()
    return loss, time.perf_counter() - t0


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    import platform

    return platform.machine()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m autofit.evaluators._trial_main TRIAL_SPEC.json", file=sys.stderr)
        return 2
    from autofit.evaluators.measured import die_with_parent

    die_with_parent()  # a rank must not outlive its launcher (or the search, for one rank)
    trial = Trial(argv[1])
    rank_file = f"rank-{trial.rank}.json"
    base = {"rank": trial.rank, "pid": os.getpid(), "world_size": trial.world}
    try:
        out = trial.run()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, classified by type
        import torch

        oom = isinstance(exc, torch.OutOfMemoryError)
        tb = traceback.format_exc().strip().splitlines()
        hit = getattr(trial.tracker, "budget_hit", None)
        memory = dict(trial.memory)
        if oom and hit is not None:
            snap = trial.tracker.snapshot(hit["event"])
            memory.update(
                components=snap.components,
                peak_allocated=snap.peak,
                peak_reserved=snap.peak,
                device_total=snap.peak,
                peak_phase=hit["phase"],
                peak_step=hit["step"],
            )
        trial.write(
            rank_file,
            {
                **base,
                "status": "oom" if oom else "failed",
                "error": f"{type(exc).__name__}: {exc}".strip(),
                "traceback": tb[-TAIL_LINES:],
                "budget_hit": hit,
                "memory": memory,
            },
        )
        sys.stdout.flush()
        print(f"autofit trial rank {trial.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        # leave at once: a rank that stops must not wait for collectives the others will never join
        os._exit(EXIT_OOM if oom else 1)
    mine = {
        **base,
        "status": "completed",
        "memory": trial.memory,
        "real_tokens": out["real_tokens"],
        "losses": out["losses"],  # each rank's own: a context-parallel rank's are its tokens' alone
        "engine": out["engine"],
    }
    trial.write(rank_file, mine)
    from autofit.evaluators import engines

    ranks = engines.gather_objects(mine)
    if trial.rank == 0:
        times = out["step_times_s"]
        tokens_per_step = sum(sum(r["real_tokens"]) for r in ranks) / max(1, len(times))
        step_time = sum(times) / len(times) if times else 0.0
        trial.write(
            "result.json",
            {
                "status": "completed",
                "device": trial.spec["device"],
                "device_name": _device_name(trial.spec["device"]),
                "world_size": trial.world,
                "engine": out["engine"],
                "step_times_s": times,
                "step_time_s": step_time,
                "tokens_per_step": tokens_per_step,
                "tokens_per_sec": tokens_per_step / step_time if step_time else 0.0,
                "losses": out["losses"],
                "loss_finite": out["loss_finite"],
                "ranks": ranks,
            },
        )
    engines.leave_group()  # every rank here, the group left (the process then ends with os._exit below)
    return 0


if __name__ == "__main__":
    from autofit.evaluators import engines

    # the results are on disk; skip the interpreter's teardown, where threads left by gloo
    # and the engines can abort the process (engines.leave_group)
    engines.exit_now(main(sys.argv))
