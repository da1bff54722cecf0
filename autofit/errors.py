"""autofit's error types.

Library code raises these; only the CLI edge turns them into ``click.ClickException``.
Every message is meant to be shown to a user as one line that names the problem and
the fix.
"""

from __future__ import annotations


class AutofitError(Exception):
    """Base class of every error autofit reports to a user."""


class SpecError(AutofitError, ValueError):
    """A model, GPU, cluster or workload description is unknown or malformed."""


class PlanError(AutofitError, ValueError):
    """A plan is invalid. Carries every problem found, not only the first."""

    def __init__(self, problems: list[str] | tuple[str, ...]):
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


class CensusError(AutofitError):
    """One block of a model cannot be built or traced under a plan (the analytic evaluator's
    census, ``evaluators/traced.py``): that plan fails, the search goes on."""


class StoreError(AutofitError):
    """The database cannot be reached, is of the wrong schema, or lacks a row."""


class ExportError(AutofitError):
    """An exported file cannot be written."""


class ReportError(AutofitError):
    """A report or its figures cannot be written."""
