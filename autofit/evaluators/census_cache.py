"""The analytic evaluator's block censuses (``traced.py``) kept on disk, across processes.

A census runs one block on fake tensors (well under a second), a compiled one an AOTAutograd
compile of it (about a second); a search, and each CLI call, paid each of them once per process.
What one gives is a few numbers, which depend only on its arguments and on the code and the
libraries that ran it. So each is kept in a JSON file under ``$AUTOFIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/autofit/census`` (``~/.cache/autofit/census``), named by a hash of the function,
the model's fingerprint, the plan's fields, the kernels (the CPU's, or the class of CUDA capabilities
that pick the same sdpa kernel: ``traced._by_kernels``), autofit's
own source of what a census runs (evaluators, techniques, plan, specs) and the versions of torch,
transformers, peft, bitsandbytes and accelerate: a change to any of them is a new name.
``AUTOFIT_CACHE_DIR=off`` keeps nothing. A file that cannot be read is ignored and written again;
one that cannot be written is left out (the census is run each time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV_VAR = "AUTOFIT_CACHE_DIR"
# the libraries a census runs, whose versions decide what it counts
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")


def cache_dir() -> Path | None:
    """Where the censuses are kept (None: nowhere)."""
    raw = os.environ.get(ENV_VAR)
    if raw is not None:
        return None if raw.strip().lower() in ("", "0", "off", "none") else Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autofit" / "census"


@functools.cache
def stamp() -> str:
    """What a census depends on beyond its arguments: autofit's source of what it runs, and the
    libraries' versions."""
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    sources = [*root.joinpath("evaluators").glob("*.py"), *root.joinpath("specs").glob("*.py")]
    h = hashlib.sha256()
    for path in sorted([*sources, root / "techniques.py", root / "plan.py"]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for dist in LIBRARIES:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{dist}={version}".encode())
    return h.hexdigest()


def on_disk(encode: Callable[[Any], Any], decode: Callable[[Any], Any]):
    """A census function of ``(model, plan, cpu, capability)`` whose values are kept on disk,
    as JSON through ``encode`` and back through ``decode``."""

    def wrap(fn):
        @functools.wraps(fn)
        def cached(model, plan, cpu: bool, capability: tuple[int, int]):
            folder = cache_dir()
            if folder is None:
                return fn(model, plan, cpu, capability)
            key = [fn.__qualname__, model.fingerprint, plan.as_dict(), bool(cpu), list(capability), stamp()]
            path = folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")
            try:
                return decode(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError, KeyError, IndexError):
                pass  # not there yet, or unreadable: census it again
            value = fn(model, plan, cpu, capability)
            _write(path, encode(value))
            return value

        return cached

    return wrap


def _write(path: Path, data: Any) -> None:
    """Write ``data`` whole or not at all (a concurrent reader sees the old file or the new one)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
