"""The fastest fitting plan of each method over the whole search space, as the analytic screen ranks it;
the configs a benchmark writes for `--model`."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.results import TrialResult
from autofit.search.loop import screen
from autofit.search.request import build_context
from autofit.search.space import Allowed, SearchSpace


def best_per_method(
    model: str, gpus: str, methods: str = "full,lora,lora-8bit,qlora", **workload
) -> dict[str, TrialResult]:
    """Method name -> the screen's fastest fitting plan of it (methods with none left out);
    ``workload``: build_context's seq_len and global_batch, where not the defaults."""
    best: dict[str, TrialResult] = {}
    for _, r in screen(SearchSpace(build_context(model, gpus, **workload), Allowed.parse(methods=methods))):
        if r.fits and r.plan.method.value not in best:
            best[r.plan.method.value] = r
    return best


def cells(best: dict[str, TrialResult], with_plan: bool = False) -> list[str]:
    """One table cell per method: tokens/s (device memory[; plan]), or "does not fit"."""
    out = []
    for m in ("full", "lora", "lora-8bit", "qlora"):
        r = best.get(m)
        plan = f"; {r.plan.summary()}" if r and with_plan else ""
        out.append(f"{r.tokens_per_sec:,.0f} ({r.memory.device_total / 2**30:.1f} GiB{plan})" if r else "does not fit")
    return out


def write_configs(configs: dict[str, dict], folder: Path) -> dict[str, str]:
    """Each model's config.json in a folder of its name under ``folder``: what ``--model`` takes."""
    paths = {}
    for name, cfg in configs.items():
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
        paths[name] = str(folder / name)
    return paths
