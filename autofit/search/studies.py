"""Study files: a YAML spec of a search (model, gpus, workload, allowed choices, budget).

``autofit search --config studies/mistral-7b-2xA10.yaml``; options given on the command
line override the file. The keys and their types are :class:`StudyFile`, a pydantic model:
unknown keys and wrong types are refused in one line that names the file and the key;
ranges are the CLI options' own (``autofit search`` converts each value with its
option's click type), so a file cannot pass what the command line refuses.

A study file is a short hand-written mapping, so only such a file is read: at most
:data:`MAX_STUDY_FILE_BYTES`, UTF-8 text, and no YAML aliases (an alias-of-aliases
"billion laughs" document of a few hundred bytes expands to gigabytes).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, field_validator

from autofit.errors import SpecError
from autofit.specs.units import parse_duration, parse_size

MAX_STUDY_FILE_BYTES = 2**20  # the examples in studies/ are under 1 KiB


def _short(value: Any) -> str:
    """A value for a one-line message, whatever its size."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def _names(value: Any) -> Any:
    """``[full, lora]`` or ``full,lora`` -> the comma form the CLI takes."""
    if isinstance(value, list):
        bad = [v for v in value if not isinstance(v, str)]
        if bad:
            quote = " (YAML reads a bare yes/no/on/off as true/false: quote it)" if isinstance(bad[0], bool) else ""
            raise ValueError(f"must be str or a list of str, got {_short(bad[0])} in the list{quote}")
        return ",".join(value)
    if not isinstance(value, str):
        raise ValueError(f"must be str or list, got {_short(value)}")
    return value


def _ranks(value: Any) -> str:
    """``[16, 64]``, ``16`` or ``16,64`` -> ``16,64``."""
    ranks = value if isinstance(value, list) else [value]
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, str)) or (isinstance(r, int) and r < 1)]
    if bad:
        raise ValueError(f"must be positive integers, got {_short(bad[0])}")
    return ",".join(str(r) for r in ranks)


def _size(value: Any) -> Any:
    """``256GiB`` (checked here, so the message names the file) or a number of bytes; kept as written."""
    if isinstance(value, str):
        parse_size(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be str or int, got {_short(value)}")
    return value


def _duration(value: Any) -> Any:
    """``90s``, ``10m``, ``1h30m`` or a number of seconds; kept as written."""
    parse_duration(value)  # a SpecError is a ValueError: pydantic reports it
    return value


Names = Annotated[str, BeforeValidator(_names)]


class StudyFile(BaseModel):
    """A study file's keys: each is the ``autofit search`` option of that name (``lengths``,
    ``db`` and ``backend`` are ``--lengths``, ``--db`` and ``--evaluator``'s earlier name)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    gpus: str | None = None
    nodes: int | None = None
    inter_node_gbps: float | None = None
    host_mem: Annotated[str | int, BeforeValidator(_size)] | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    lengths: str | None = None
    headroom: float | None = None
    methods: Names | None = None
    optimizers: Names | None = None
    precisions: Names | None = None
    lora_ranks: Annotated[str, BeforeValidator(_ranks)] | None = None
    lora_dropout: float | None = None
    evaluator: str | None = None
    backend: str | None = None  # the earlier name of "evaluator", still read
    trials: int | None = None
    timeout: Annotated[str | int | float, BeforeValidator(_duration)] | None = None
    seed: int | None = None
    out: str | None = None
    name: str | None = None
    db: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _has_a_value(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("has no value: give one, or leave the key out")
        return value

    @field_validator("backend")
    @classmethod
    def _not_both_names(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("evaluator") is not None:
            raise ValueError("is the earlier name of 'evaluator': give one of the two")
        return value


# pydantic's error types -> what the key must be (the rest come from the validators above)
_EXPECTED = {"string_type": "str", "int_type": "int", "float_type": "a number", "finite_number": "a finite number"}


def _problem(error: dict[str, Any]) -> str:
    """One of pydantic's errors as a phrase that names the key."""
    key = error["loc"][0] if error["loc"] else ""
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, StudyFile.model_fields, n=1)
        return f"unknown key {_short(key)}" + (f" (did you mean {close[0]!r}?)" if close else "")
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, SpecError):  # a parser's own sentence (units)
        return f"{key!r}: {cause}"
    if isinstance(cause, ValueError):  # a validator's phrase about the key
        return f"{key!r} {cause}"
    if error["type"] in _EXPECTED:
        return f"{key!r} must be {_EXPECTED[error['type']]}, got {_short(error['input'])}"
    return f"{key!r}: {error['msg']}"


def _validation_message(path: str, data: dict, exc: ValidationError) -> str:
    """Every problem, in the file's order, on one line (the first three, then a count)."""
    order = {k: i for i, k in enumerate(data)}
    errors = sorted(exc.errors(), key=lambda e: order.get(e["loc"][0] if e["loc"] else "", len(order)))
    problems = [_problem(e) for e in errors]
    more = f"; and {len(problems) - 3} more problems" if len(problems) > 3 else ""
    known = ""
    if any(p.startswith("unknown key") and "did you mean" not in p for p in problems[:3]):
        known = f" (known keys: {', '.join(StudyFile.model_fields)})"
    return f"study file {path!r}: {'; also '.join(problems[:3])}{more}{known}"


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


def _read_yaml(path: str) -> Any:
    """The file's YAML document, read only if it looks like a study file (small UTF-8 text, no aliases)."""
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
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
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


def load_study_file(path: str) -> dict[str, Any]:
    """Read and check a study file: the keys it sets, lists in the comma form the CLI takes."""
    data = _read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"study file {path!r} must be a mapping of keys to values, got {type(data).__name__}")
    data = {str(k): v for k, v in data.items()}  # a key YAML reads as a number, date or null is an unknown key
    try:
        study = StudyFile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_validation_message(path, data, exc)) from None
    return study.model_dump(exclude_unset=True)
