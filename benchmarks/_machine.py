"""What a result file says about the machine it was measured on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def machine() -> str:
    """CPU model, cores, memory and GPU (the first CUDA device torch sees, else none)."""
    model = "unknown CPU"
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {gpu}"


def uptime() -> str:
    """The load average line of ``uptime`` (timings on shared cores carry their noise)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def versions(*packages: str) -> str:
    """``Python 3.11.7, torch 2.13.0+cpu, ...`` for the packages that are installed."""
    import importlib.metadata
    import platform

    out = [f"Python {platform.python_version()}"]
    for name in packages:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)
