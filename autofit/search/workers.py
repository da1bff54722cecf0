"""Local worker processes for ``autofit search --parallel K``.

Each worker is a real ``autofit worker`` process joining the study through the
database, exactly as on another node; on a multi-GPU machine each gets its own disjoint
GPU subset through ``CUDA_VISIBLE_DEVICES``, sized by the plans' world size.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import psutil

from autofit.errors import AutofitError


def gpu_subsets(k: int, world_size: int, n_devices: int) -> list[str | None]:
    """``k`` disjoint device lists of ``world_size`` GPUs each (None: no GPUs to split)."""
    if n_devices == 0:
        return [None] * k
    if k * world_size > n_devices:
        raise AutofitError(
            f"--parallel {k} needs {k} × {world_size} = {k * world_size} GPUs, this machine has {n_devices}"
        )
    return [",".join(str(d) for d in range(i * world_size, (i + 1) * world_size)) for i in range(k)]


# What a local worker costs and what it saves, measured for `autofit search --model mistral-7b
# --gpus 2xA10` on 2 cores (benchmarks/results/2026-12-04-time-to-answer.md): a worker process
# starts in ~5 s of one core (Python, torch, transformers, its first model build), a simulated
# trial then takes 1.5-4 s. At the default 8 trials two workers answered no sooner (17.4 vs
# 17.0 s, 27 vs 16 s of CPU); at 16 trials 9% sooner (22.7 vs 24.9 s). So `auto` adds a worker
# per 8 simulated trials, within the cores and the memory this machine has.
TRIALS_PER_WORKER = 8
WORKER_MEMORY = 2 * 2**30  # a worker's resident memory with a 70B trace, rounded up


def auto_parallel(request) -> int:
    """``--parallel auto``: how many local workers this search gets.

    Simulated searches: one per ``TRIALS_PER_WORKER`` trials, at most one per usable core
    and one per ``WORKER_MEMORY`` of available memory. Analytic searches take microseconds a
    plan, and measured trials time the machine itself, so both run in one process (on a
    machine with more GPUs than a plan needs, ask for ``--parallel K``)."""
    if request.evaluator != "simulated":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    by_memory = max(1, _available_memory() // WORKER_MEMORY)
    return max(1, min(request.trials // TRIALS_PER_WORKER, cores, by_memory))


def _available_memory() -> int:
    """Memory available to new processes: psutil reads MemAvailable of /proc/meminfo on Linux
    (and estimates it from free, cached and reclaimable pages on kernels without it)."""
    return psutil.virtual_memory().available


def _local_cuda_devices(request) -> int:
    if request.evaluator != "measured" or request.ctx.cluster.gpu.kind != "cuda":
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA means nothing to split
        return 0


@contextlib.contextmanager
def spawn_local_workers(study: str, db_url: str, k: int, request) -> Iterator[Callable[[], bool]]:
    """Start ``k`` workers; yield "is any still alive"; on exit wait for them.

    On an error or Ctrl-C they get SIGINT, as a terminal would send (a worker stops like
    ``autofit worker`` on Ctrl-C: its trial is failed and queued again on resume), and
    SIGKILL after 30 s."""
    subsets = gpu_subsets(k, request.ctx.cluster.world_size, _local_cuda_devices(request))
    procs = []
    for subset in subsets:
        env = {**os.environ, "AUTOFIT_DB": db_url}  # the URL stays out of argv (ps shows argv)
        if subset is not None:
            env["CUDA_VISIBLE_DEVICES"] = subset
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "autofit", "worker", study, "--quiet"],
                env=env,
                start_new_session=True,
            )
        )
    ok = False
    try:
        yield lambda: any(p.poll() is None for p in procs)
        ok = True
    finally:
        for p in procs:
            if not ok and p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=None if ok else 30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
