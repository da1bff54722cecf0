"""The measured evaluator: a short real run of the plan on this machine's devices.

Writes a trial spec, starts the child (:mod:`autofit.evaluators._trial_main`, alone or
under ``accelerate launch`` with the exported config files) in a session of its own,
tails its progress (pruning, timeout: the whole process tree is killed) and classifies
the outcome from its result files and exit status, never from its logs. Imports torch
only to list local GPUs, and from autofit what lies below the evaluators plus the
exporter, and psutil to walk process trees; Linux only (a trial dies with its parent through
``PR_SET_PDEATHSIG``). The protocol and the design: docs/EVALUATORS.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from autofit.errors import AutofitError
from autofit.evaluators._trial_main import EXIT_OOM  # the child's protocol (stdlib-only module)
from autofit.evaluators.base import Evaluator, StepCallback, StepReport
from autofit.plan import Offload, Optimizer, Plan
from autofit.results import TENSOR_COMPONENTS, MemoryAnatomy, Status, Throughput, TrialResult, judge
from autofit.specs import Target

DEFAULT_WARMUP_STEPS = 2  # the first step creates the optimizer states, the second is steady
DEFAULT_TIMED_STEPS = 3
DEFAULT_TIMEOUT_S = 900.0
STDERR_TAIL_LINES = 30
POLL_S = 0.1
KILL_GRACE_S = 3.0

CHILD_MODULE = "autofit.evaluators._trial_main"


@dataclass(frozen=True)
class MeasuredOptions:
    """How a measured trial runs. ``cpu_mem_budget``: bytes per rank on the CPU target
    (default: the target's memory, which ``--cpu-mem-budget`` sets). ``work_dir``: keep each
    trial's directory there (spec, exported files, logs, results); default: a temporary
    directory removed after the trial. ``env``: extra environment for the child."""

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    timed_steps: int = DEFAULT_TIMED_STEPS
    timeout_s: float = DEFAULT_TIMEOUT_S
    cpu_mem_budget: int | None = None
    work_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.warmup_steps < 1:
            problems.append(f"warm-up steps must be at least 1 (the tracked step), got {self.warmup_steps}")
        if self.timed_steps < 1:
            problems.append(f"timed steps must be at least 1, got {self.timed_steps}")
        if self.timeout_s <= 0:
            problems.append(f"the trial timeout must be positive, got {self.timeout_s}")
        if self.cpu_mem_budget is not None and self.cpu_mem_budget <= 0:
            problems.append(f"the CPU memory budget must be positive, got {self.cpu_mem_budget}")
        if problems:
            raise AutofitError("; ".join(problems))


def check_work_dir(path: str | os.PathLike) -> str:
    """``path`` if it is, or can be created as, a writable directory; else one clear error.

    Checked when the options are read, before a study is created: otherwise the first
    trial fails on ``mkdir`` with a traceback and leaves its study ``running``. Nothing is
    created here (the evaluator creates the directory when a trial runs).
    """
    given = str(path)
    p = Path(given).expanduser().absolute()
    fix = "give --work-dir a directory that exists or can be created"
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise AutofitError(f"work directory {given} is {'a broken link' if not p.exists() else 'a file'}; {fix}")
        if not os.access(p, os.W_OK | os.X_OK):
            raise AutofitError(f"work directory {given} is not writable; {fix}")
        return given
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise AutofitError(f"cannot create work directory {given}: {parent} is a file; {fix}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AutofitError(f"cannot create work directory {given}: {parent} is not writable; {fix}")
    return given


def device_kind(ctx: Target) -> str:
    """``cpu`` for the local-CPU target, else ``cuda`` (no check that this machine has it)."""
    return "cpu" if ctx.cluster.gpu.kind == "cpu" else "cuda"


def target_device(ctx: Target) -> str:
    """``cpu`` for the local-CPU target, else ``cuda``; raises when this machine cannot run it."""
    cluster = ctx.cluster
    if cluster.nodes != 1:
        raise AutofitError(f"measured runs use this machine only; {cluster.label} spans {cluster.nodes} nodes")
    if cluster.gpu.kind == "cpu":
        return "cpu"
    if cluster.gpu.analytic_only:  # ROCm: the runner and its memory tracking are CUDA's
        raise AutofitError(f"the measured evaluator cannot run {cluster.gpu.name} (ROCm); use --evaluator analytic")
    local = local_gpus()
    if not local_gpus_match(cluster, local):
        have = f"{len(local)}x{local[0].name if local[0] else 'unknown GPU'}" if local else "no CUDA GPU"
        raise AutofitError(f"--evaluator measured needs {cluster.label} on this machine; it has {have}")
    return "cuda"


def local_gpus_match(cluster, local: list | None = None) -> bool:
    """The target is this machine: same GPU model, at least as many of them, one node."""
    local = local_gpus() if local is None else local
    if cluster.nodes != 1 or len(local) < cluster.gpus_per_node:
        return False
    return all(g is not None and g.name == cluster.gpu.name for g in local[: cluster.gpus_per_node])


def not_measurable(plan: Plan, ctx: Target, device: str) -> str:
    """Why this plan cannot be measured here ('' when it can)."""
    if device == "cpu":
        if plan.optimizer is Optimizer.PAGED_ADAMW_8BIT:
            return "paged-adamw-8bit pages optimizer states through CUDA unified memory; it has no CPU path"
        if plan.offload is not Offload.NONE:
            return "offloading to host memory moves nothing when the device is the host (CPU target)"
    if plan.fused_loss and (plan.engine != "torch" or ctx.cluster.world_size > 1) and not liger_runs(ctx, device):
        return (
            "the chunked loss calls the model body outside the engine's forward (DDP, DeepSpeed, FSDP); "
            "without Liger (CUDA), a fused loss is measured in single-process runs only"
        )
    return ""


def liger_runs(ctx: Target, device: str) -> bool:
    """Liger's fused loss will be used by the child (see ``_trial_main.liger``)."""
    import importlib.util

    return device == "cuda" and ctx.model.family.liger and importlib.util.find_spec("liger_kernel") is not None


def launcher(plan: Plan, ctx: Target) -> str:
    """``python`` for one plain-torch rank, else ``accelerate`` (launched with the exported files)."""
    return "python" if ctx.cluster.world_size == 1 and plan.engine == "torch" else "accelerate"


def trial_spec(plan: Plan, ctx: Target, opts: MeasuredOptions, device: str, budget: int | None) -> dict:
    """What the child needs, as JSON: the architecture (not its name), plan, workload, steps."""
    return {
        "model": ctx.model.as_dict(),
        "plan": plan.as_dict(),
        "workload": ctx.workload.as_dict(),
        "device": device,
        "launcher": launcher(plan, ctx),
        "world_size": ctx.cluster.world_size,
        "warmup_steps": opts.warmup_steps,
        "timed_steps": opts.timed_steps,
        "cpu_mem_budget": budget,
        "seed": opts.seed,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(plan: Plan, ctx: Target, spec_path: Path, port: int | None = None) -> list[str]:
    """The child's argv (run in the trial directory)."""
    if launcher(plan, ctx) == "python":
        return [sys.executable, "-m", CHILD_MODULE, str(spec_path)]
    from autofit.export.common import ACCELERATE_CONFIG_NAME

    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        ACCELERATE_CONFIG_NAME,
        "--main_process_port",
        str(port or free_port()),
        "-m",
        CHILD_MODULE,
        str(spec_path),
    ]


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: this process's, with the autofit being run first on the path.

    ``ACCELERATE_*``/``FSDP_*`` left over in this environment would change what the
    launcher sets up from the exported files, so they are dropped.
    """
    import autofit

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    root = str(Path(autofit.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.update(extra)
    return env


# -- the process tree ----------------------------------------------------------------------------
def _tree(proc: subprocess.Popen) -> set[psutil.Process]:
    """The child and every live process below it, whatever session or group each moved to.

    Empty once the child is reaped (its pid may then be another process's). psutil's
    ``children(recursive=True)`` reads every process's parent and skips a pid reused since.
    """
    if proc.poll() is not None:
        return set()
    try:
        root = psutil.Process(proc.pid)
        return {root, *root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(process: int | psutil.Process) -> bool:
    """Running (zombies, which hold nothing but a table entry, do not count)."""
    try:
        p = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # is_running: False for a reused pid
    except psutil.NoSuchProcess:
        return False


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies.

    Trials run in their own session (so a timeout can kill the whole tree); this keeps a
    SIGKILLed search or worker from leaving its trial running. Set in the launched child
    (``preexec_fn``) and again in each rank (whose parent is the launcher).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def kill_tree(proc: subprocess.Popen) -> set[int]:
    """SIGTERM, then SIGKILL, the child, its group, and every process below it; returns the pids.

    torchrun starts every worker in a session of its own, so the launcher's group alone
    would leave them behind. The tree is read before each signal and while waiting: once a launcher dies its
    workers are re-parented and no longer findable from it. A process that ignores
    SIGTERM gets SIGKILL after ``KILL_GRACE_S``. (Not ``psutil.wait_procs``: it would reap
    the child out from under ``proc``, losing its exit status, and the tree must be re-read while waiting.)
    """
    seen: set[psutil.Process] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        seen |= _tree(proc)
        _signal(seen, proc.pid, sig)
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and any(alive(p) for p in seen):
            seen |= _tree(proc)
            time.sleep(0.05)
        if not any(alive(p) for p in seen):
            break
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    return {p.pid for p in seen} | {proc.pid}


def _signal(procs: set[psutil.Process], group: int, sig: signal.Signals) -> None:
    """``sig`` to each process still running, to its group unless ours, and to ``group`` (the
    child's own, which outlives it while any member lives: a worker re-parented before the tree was read)."""
    groups = {group}
    for p in procs:
        try:
            if p.is_running():  # psutil: not gone, not a pid reused since it was seen
                groups.add(os.getpgid(p.pid))
                p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            pass
    for g in groups - {os.getpgrp(), 0, 1}:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def local_gpus() -> list:
    """This machine's CUDA GPUs as catalog entries (``[]`` without CUDA; None entries unknown)."""
    if sys.platform == "linux" and not os.path.exists("/proc/driver/nvidia/version"):
        return []  # no NVIDIA driver: answer without importing torch (``auto`` asks on every command)
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    from autofit.specs.gpus import match_gpu

    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(match_gpu(props.name, props.total_memory))
    return out


# -- the evaluator -------------------------------------------------------------------------------
class MeasuredEvaluator(Evaluator):
    """A short real run on this machine: warm-up steps (memory), then timed steps (speed)."""

    name = "measured"

    def __init__(
        self,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        timed_steps: int = DEFAULT_TIMED_STEPS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cpu_mem_budget: int | None = None,
        work_dir: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        seed: int = 0,
    ) -> None:
        self.options = MeasuredOptions(
            warmup_steps,
            timed_steps,
            float(timeout_s),
            cpu_mem_budget,
            str(work_dir) if work_dir is not None else None,
            dict(env or {}),
            seed,
        )

    def evaluate(self, plan: Plan, ctx: Target, on_step: StepCallback | None = None) -> TrialResult:
        opts = self.options
        t0 = time.perf_counter()
        device = target_device(ctx)
        budget = (opts.cpu_mem_budget or ctx.capacity_bytes) if device == "cpu" else None
        base_extra: dict[str, Any] = {
            "device": device,
            "world_size": ctx.cluster.world_size,
            "warmup_steps": opts.warmup_steps,
            "timed_steps": opts.timed_steps,
        }
        if budget is not None:
            base_extra["cpu_mem_budget"] = budget
        why = not_measurable(plan, ctx, device)
        if why:
            return TrialResult(
                plan,
                Status.FAILED,
                self.name,
                capacity_bytes=ctx.capacity_bytes,
                reason=f"not measurable here: {why}",
                extra={**base_extra, "launched": False},
            )

        try:
            if opts.work_dir:
                Path(opts.work_dir).mkdir(parents=True, exist_ok=True)
            trial_dir = Path(tempfile.mkdtemp(prefix=f"trial-{plan.plan_id}-", dir=opts.work_dir))
        except OSError as exc:  # every later trial would fail the same way: stop with one line
            where = opts.work_dir or tempfile.gettempdir()
            raise AutofitError(
                f"cannot create a trial directory in {where}: {exc.strerror or exc}; "
                "give --work-dir a writable directory"
            ) from None
        try:
            return self._run(plan, ctx, on_step, trial_dir, device, budget, base_extra, t0)
        finally:
            if not opts.work_dir:
                shutil.rmtree(trial_dir, ignore_errors=True)

    def _run(
        self,
        plan: Plan,
        ctx: Target,
        on_step: StepCallback | None,
        trial_dir: Path,
        device: str,
        budget: int | None,
        extra: dict[str, Any],
        t0: float,
    ) -> TrialResult:
        from autofit.export import export_plan

        opts = self.options
        # the files a user gets; for engine / multi-rank plans they are what the launcher reads
        exported = export_plan(plan, ctx, trial_dir)
        extra["exported_sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in exported}
        spec_path = trial_dir / "trial.json"
        spec_path.write_text(json.dumps(trial_spec(plan, ctx, opts, device, budget), indent=1))
        cmd = launch_command(plan, ctx, spec_path)
        extra["launch"] = " ".join(["python" if a == sys.executable else a for a in cmd[:-1]] + ["trial.json"])
        if opts.work_dir:
            extra["trial_dir"] = str(trial_dir)

        with open(trial_dir / "stdout.log", "wb") as out, open(trial_dir / "stderr.log", "wb") as err:
            proc = subprocess.Popen(
                cmd,
                cwd=trial_dir,
                env=child_env(opts.env),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            try:
                stopped, last = self._watch(proc, trial_dir, on_step, t0)
            except BaseException:  # Ctrl-C or a failing on_step: the child's own session would outlive us
                kill_tree(proc)
                raise
        rc = proc.returncode
        extra["exit_status"] = rc
        duration = time.perf_counter() - t0
        return classify(plan, ctx, trial_dir, rc, stopped, last, extra, duration, opts.timeout_s)

    def _watch(
        self, proc: subprocess.Popen, trial_dir: Path, on_step: StepCallback | None, t0: float
    ) -> tuple[str, StepReport | None]:
        """Follow the child until it exits, times out or is pruned; returns (why it stopped, last step)."""
        progress = trial_dir / "progress.jsonl"
        offset = 0
        last: StepReport | None = None
        deadline = t0 + self.options.timeout_s
        while True:
            done = proc.poll() is not None
            offset, records = _read_new_lines(progress, offset)
            for rec in records:
                last = StepReport(
                    step=int(rec["step"]),
                    tokens_per_sec=float(rec["tokens_per_sec"]),
                    peak_bytes=int(rec["peak_bytes"]),
                )
                if on_step is not None and on_step(last) is False and not done:
                    kill_tree(proc)
                    return "pruned", last
            if done:
                return "", last
            if time.perf_counter() > deadline:
                kill_tree(proc)
                return "timeout", last
            time.sleep(POLL_S)


def _read_new_lines(path: Path, offset: int) -> tuple[int, list[dict]]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return offset, []
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
    records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return offset + end, records


def _tail(path: Path, n: int = STDERR_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def anatomy(mem: dict[str, Any], host_bytes: int = 0) -> MemoryAnatomy:
    """One rank's measured memory as the anatomy: the tracker's components, CUDA's totals.

    The tracker sees tensors; what CUDA counts beyond them (kernel workspaces) goes to
    ``temporary`` so that the components sum to ``peak_allocated``.
    """
    comps = {c: int((mem.get("components") or {}).get(c, 0)) for c in TENSOR_COMPONENTS}
    peak = int(mem.get("peak_allocated") or sum(comps.values()))
    comps["temporary"] = max(0, comps["temporary"] + peak - sum(comps.values()))
    reserved = int(mem.get("peak_reserved") or peak)
    total = int(mem.get("device_total") or reserved)
    return MemoryAnatomy(
        **comps,
        overhead=max(0, total - peak),
        peak_allocated=peak,
        peak_reserved=reserved,
        device_total=total,
        host_bytes=host_bytes,
    )


def classify(
    plan: Plan,
    ctx: Target,
    trial_dir: Path,
    rc: int | None,
    stopped: str,
    last: StepReport | None,
    extra: dict[str, Any],
    duration: float,
    timeout_s: float,
) -> TrialResult:
    """The outcome, from the child's result files and exit status (never from its logs)."""
    result = _read_json(trial_dir / "result.json")
    ranks = sorted((r for p in trial_dir.glob("rank-*.json") if (r := _read_json(p))), key=lambda r: r["rank"])
    extra["ranks"] = [
        {k: r.get(k) for k in ("rank", "pid", "status", "error", "losses")}
        | {"memory": _rank_memory(r.get("memory") or {})}
        for r in ranks
    ]
    if ranks and ranks[0].get("engine"):
        extra["engine"] = ranks[0]["engine"]
    mk = lambda status, reason, memory=None, throughput=None: TrialResult(  # noqa: E731
        plan,
        status,
        "measured",
        memory=memory,
        throughput=throughput,
        capacity_bytes=ctx.capacity_bytes,
        reason=reason,
        duration_s=duration,
        extra=extra,
    )

    if last is not None:
        extra["last_step"] = {"step": last.step, "tokens_per_sec": last.tokens_per_sec, "peak_bytes": last.peak_bytes}
    if stopped == "timeout":
        at = f" after step {last.step}" if last else " before its first step"
        return mk(Status.TIMEOUT, f"no result within {timeout_s:g} s (stopped{at}); its processes were killed")
    if stopped == "pruned":
        extra["pruned_by"] = "pruner"
        return mk(
            Status.PRUNED,
            f"stopped at step {last.step}: {last.tokens_per_sec:,.0f} tokens/s cannot beat the best trials so far",
        )
    oom = [r for r in ranks if r.get("status") == "oom"]
    if oom:
        reason, memory = _oom(oom, extra)
        return mk(Status.OOM, reason[:500], memory)
    failed = [r for r in ranks if r.get("status") == "failed"]
    if result is None or rc != 0 or failed:
        return mk(Status.FAILED, _failure(trial_dir, rc, failed, extra)[:500])
    memory, throughput = _finished(result, extra)
    status, reason = judge(memory, ctx)
    return mk(status, reason, memory, throughput)


def _oom(oom: list[dict[str, Any]], extra: dict[str, Any]) -> tuple[str, MemoryAnatomy | None]:
    """Why the rank that ran out of memory with the most allocated did, and its anatomy."""
    r = max(oom, key=lambda r: (r.get("memory") or {}).get("peak_allocated", 0))
    mem = r.get("memory") or {}
    hit = r.get("budget_hit")
    extra["oom_rank"] = r["rank"]
    extra["error"] = r.get("error", "")
    where = f"step {mem.get('peak_step', '?')} ({mem.get('peak_phase', '?')})"
    if hit:
        extra["budget_hit"] = hit
        reason = (
            f"out of memory at {where}: {hit['live_before'] / 2**20:.1f} MiB allocated + "
            f"{hit['requested'] / 2**20:.1f} MiB requested > the {hit['budget'] / 2**20:.1f} MiB budget "
            f"(rank {r['rank']})"
        )
    else:
        reason = f"out of memory at {where} on rank {r['rank']}: {r.get('error', '')}"
    return reason, anatomy(mem) if mem.get("peak_allocated") else None


def _failure(trial_dir: Path, rc: int | None, failed: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    """Why a trial left no result: a rank's error, a signal, the OOM exit code or the exit status."""
    stderr = _tail(trial_dir / "stderr.log")
    extra["stderr_tail"] = stderr
    if failed:
        extra["traceback"] = failed[0].get("traceback", [])
        return f"rank {failed[0]['rank']} failed: {failed[0].get('error', '')}"
    if rc is not None and rc < 0:
        return f"the trial was killed by signal {signal.Signals(-rc).name}" + (
            " (the kernel's OOM killer?)" if rc == -signal.SIGKILL else ""
        )
    if rc == EXIT_OOM:
        return "out of memory (the rank's result file is missing)"
    return f"the trial exited with status {rc} without a result" + (f": {stderr[-1]}" if stderr else "")


def _finished(result: dict[str, Any], extra: dict[str, Any]) -> tuple[MemoryAnatomy, Throughput]:
    """The worst rank's anatomy (with every rank's host memory) and the timed steps' throughput."""
    per_rank = [anatomy(r["memory"]) for r in result["ranks"]]
    host = sum(int(r["memory"].get("rss_peak_bytes", 0)) for r in result["ranks"])
    worst = max(range(len(per_rank)), key=lambda i: per_rank[i].device_total)
    memory = anatomy(result["ranks"][worst]["memory"], host_bytes=host)
    extra.update(
        engine=result["engine"],
        device_name=result["device_name"],
        worst_rank=worst,
        step_times_s=result["step_times_s"],
        tokens_per_step=result["tokens_per_step"],
        loss_finite=result["loss_finite"],
        setup_peak_bytes=result["ranks"][worst]["memory"].get("setup_peak_bytes"),
        rss_peak_bytes=[r["memory"].get("rss_peak_bytes") for r in result["ranks"]],
    )
    throughput = Throughput(
        tokens_per_sec=float(result["tokens_per_sec"]),
        step_time_s=float(result["step_time_s"]),
        compute_s=float(result["step_time_s"]),
    )
    return memory, throughput


def _rank_memory(mem: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "peak_allocated",
        "peak_reserved",
        "device_total",
        "setup_peak_bytes",
        "rss_peak_bytes",
        "peak_phase",
        "peak_step",
        "compiled_peak_allocated",
        "standin_peak_allocated",
    )
    return {k: mem[k] for k in keys if k in mem}
