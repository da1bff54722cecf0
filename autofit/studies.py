"""Study files: a YAML spec of a search (model, gpus, workload, allowed choices, budget).

``autofit search --config studies/mistral-7b-2xA10.yaml``; options given on the command
line override the file. Unknown keys and wrong types are refused with the key named.
"""

from __future__ import annotations

from typing import Any

import yaml

from autofit.errors import SpecError

# key -> accepted Python types
FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "gpus": (str,),
    "nodes": (int,),
    "host_mem": (str, int),
    "seq_len": (int,),
    "global_batch": (int,),
    "lengths": (str,),
    "headroom": (float, int),
    "methods": (str, list),
    "optimizers": (str, list),
    "precisions": (str, list),
    "lora_ranks": (str, int, list),
    "backend": (str,),
    "trials": (int,),
    "timeout": (str, int, float),
    "seed": (int,),
    "out": (str,),
    "name": (str,),
    "db": (str,),
}
LIST_KEYS = ("methods", "optimizers", "precisions", "lora_ranks")


def load_study_file(path: str) -> dict[str, Any]:
    """Read and check a study file; lists become the comma form the CLI takes."""
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise SpecError(f"cannot read study file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise SpecError(f"study file {path!r} is not valid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"study file {path!r} must be a mapping of keys to values, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in FIELDS)
    if unknown:
        raise SpecError(f"study file {path!r}: unknown key {unknown[0]!r} (known: {', '.join(FIELDS)})")
    out: dict[str, Any] = {}
    for key, value in data.items():
        types = FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join("list" if t is list else t.__name__ for t in types)
            raise SpecError(f"study file {path!r}: {key!r} must be {names}, got {value!r}")
        if key in LIST_KEYS and isinstance(value, list):
            value = ",".join(str(v) for v in value)
        out[key] = value
    return out
