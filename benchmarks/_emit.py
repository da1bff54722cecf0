"""The tail every results benchmark shares: its table to stdout, and to ``--out`` where given."""

from __future__ import annotations

import sys
from pathlib import Path


def emit(lines: list[str], out: str | None) -> int:
    """Print ``lines`` as one text ending in a newline, write it to ``out`` (when set); 0 for ``sys.exit``."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    sys.stdout.write(text)
    if out:
        Path(out).write_text(text, encoding="utf-8")
    return 0
