"""Sizes and durations as people write them (``256GiB``, ``1h30m``), for the CLI and study files.

Part of the specs: the library reads them too (``--host-mem``, ``--cpu-mem-budget``, a study
file's ``timeout``), and must not import the CLI to do so.
"""

from __future__ import annotations

import math
import re

from autofit.errors import SpecError

MiB = 2**20
GiB = 2**30

# Why not pydantic's ByteSize and timedelta (checked against pydantic 2.14): ByteSize reads the same
# units (kB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, any case), but it ignores trailing text
# ("24GiB!" -> 24 GiB), takes bits ("24bit" -> 3 bytes) and refuses our "24Gi"; and its error
# ("could not parse value and unit from byte string") neither repeats the input nor shows a form
# that works. timedelta reads none of 15m, 2h, 90s, 1h30m (only ISO 8601 PT15M or 00:15:00) and
# takes 0 and -5. These few lines read what people write and refuse the rest in one clear line.

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``256GiB``, ``64gb``, ``1.5TiB`` -> bytes."""
    m = _SIZE_RE.match(text or "")
    if not m:
        raise SpecError(f"cannot read size {text!r}; write it like 256GiB or 64GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([hms]?)", re.I)


def parse_duration(text: str | float | int | None) -> float | None:
    """``90``, ``90s``, ``10m``, ``1h30m`` -> seconds."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)  # a number of seconds (study files)
    else:
        s = str(text).strip().lower()
        parts = _DURATION_RE.findall(s)
        if not parts or _DURATION_RE.sub("", s).strip():
            raise SpecError(f"cannot read duration {text!r}; write it like 90s, 10m or 1h30m")
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)
    if not seconds > 0 or not math.isfinite(seconds):
        raise SpecError(f"duration {text!r} must be a positive, finite time, e.g. 90s, 10m or 1h30m")
    return seconds
