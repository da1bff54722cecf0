"""Study files: a YAML spec of a search (model, gpus, workload, allowed choices, budget).

``autofit search --config studies/mistral-7b-2xA10.yaml``; options given on the command
line override the file. Unknown keys and wrong types are refused with the key named;
ranges are the CLI options' own (``autofit search`` converts each value with its
option's click type), so a file cannot pass what the command line refuses.

A study file is a short hand-written mapping, so only such a file is read: at most
:data:`MAX_STUDY_FILE_BYTES`, UTF-8 text, and no YAML aliases (an alias-of-aliases
"billion laughs" document of a few hundred bytes expands to gigabytes).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from autofit.errors import SpecError
from autofit.specs.units import parse_duration

MAX_STUDY_FILE_BYTES = 2**20  # the examples in studies/ are under 1 KiB

# key -> accepted Python types
FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "gpus": (str,),
    "nodes": (int,),
    "inter_node_gbps": (float, int),
    "host_mem": (str, int),
    "seq_len": (int,),
    "global_batch": (int,),
    "lengths": (str,),
    "headroom": (float, int),
    "methods": (str, list),
    "optimizers": (str, list),
    "precisions": (str, list),
    "lora_ranks": (str, int, list),
    "lora_dropout": (float, int),
    "evaluator": (str,),
    "backend": (str,),  # the earlier name of "evaluator", still read
    "trials": (int,),
    "timeout": (str, int, float),
    "seed": (int,),
    "out": (str,),
    "name": (str,),
    "db": (str,),
}
LIST_KEYS = ("methods", "optimizers", "precisions", "lora_ranks")


class _AliasRefused(yaml.YAMLError):
    def __init__(self, mark):
        super().__init__()
        self.problem_mark = mark


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses every alias (``*name``) before it is expanded."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _AliasRefused(self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _short(value: Any) -> str:
    """A value for a one-line message, whatever its size."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def load_study_file(path: str) -> dict[str, Any]:
    """Read and check a study file; lists become the comma form the CLI takes."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_STUDY_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read study file {path!r}: {exc.strerror}") from None
    if len(raw) > MAX_STUDY_FILE_BYTES:
        raise SpecError(
            f"study file {path!r} is over {MAX_STUDY_FILE_BYTES // 2**20} MiB; "
            "a study file is a short YAML mapping like those in studies/"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"study file {path!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}); a study file is a YAML mapping like those in studies/"
        ) from None
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
    except _AliasRefused as exc:
        raise SpecError(
            f"study file {path!r} uses a YAML alias (line {exc.problem_mark.line + 1}); "
            "study files take no anchors or aliases: write each value out"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise SpecError(f"study file {path!r} is not valid YAML{where}") from None
    except RecursionError:
        raise SpecError(
            f"study file {path!r} is nested too deeply; a study file is a flat YAML mapping like those in studies/"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"study file {path!r} must be a mapping of keys to values, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in FIELDS)
    if unknown:
        raise SpecError(f"study file {path!r}: unknown key {_short(unknown[0])} (known: {', '.join(FIELDS)})")
    out: dict[str, Any] = {}
    for key, value in data.items():
        types = FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join("list" if t is list else t.__name__ for t in types)
            raise SpecError(f"study file {path!r}: {key!r} must be {names}, got {_short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"study file {path!r}: {key!r} must be a finite number, got {value!r}")
        if key == "lora_ranks":
            ranks = value if isinstance(value, list) else [value]
            bad = [
                r
                for r in ranks
                if isinstance(r, bool) or not isinstance(r, (int, str)) or (isinstance(r, int) and r < 1)
            ]
            if bad:
                raise SpecError(f"study file {path!r}: 'lora_ranks' must be positive integers, got {_short(bad[0])}")
        if key == "timeout":
            try:
                parse_duration(value)
            except SpecError as exc:
                raise SpecError(f"study file {path!r}: 'timeout': {exc}") from None
        if key in LIST_KEYS and isinstance(value, list):
            value = ",".join(str(v) for v in value)
        out[key] = value
    return out
