"""``python -m autofit``: the same command as ``autofit``."""

from autofit.cli import main

main()
