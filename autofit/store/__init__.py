"""The store: studies and trials in SQL (SQLAlchemy 2.0 ORM, Alembic migrations).

Callers get frozen records (:mod:`autofit.store.records`); ORM rows stay inside this
package. Imports without torch.
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
