"""The store: studies and trials in SQL (SQLAlchemy 2.0 ORM; the Alembic scripts are in the
top-level ``migrations/``, shipped as ``autofit.migrations``).

Callers get frozen records (:mod:`autofit.store.records`); ORM rows stay inside this
package, and every call goes through one session scope that retries transient errors
with one backoff. May import results, plan and specs (never the evaluators, the search,
the report or the CLI); imports without torch.
"""

from autofit.store.records import SchemaInfo, StudyRecord, StudyStatus, StudySummary, TrialRecord
from autofit.store.store import ENV_VAR, Store, default_path, request_key, resolve_url, software_versions

__all__ = [
    "ENV_VAR",
    "SchemaInfo",
    "Store",
    "StudyRecord",
    "StudyStatus",
    "StudySummary",
    "TrialRecord",
    "default_path",
    "request_key",
    "resolve_url",
    "software_versions",
]
