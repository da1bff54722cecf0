"""ORM tables of autofit's store.

Every table is prefixed ``autofit_`` because Optuna keeps its own tables (``studies``,
``trials``, ...) in the same database. The schema changes only through the Alembic
revisions in ``migrations/versions``; a test checks that these classes and the migrated
schema do not differ. Rows never leave ``autofit.store``: :mod:`autofit.store.records`
holds what callers get.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Double, ForeignKey, Index, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from autofit.results import MemoryAnatomy

TABLE_PREFIX = "autofit_"
VERSION_TABLE = "autofit_alembic_version"  # Optuna's Alembic owns the default "alembic_version"

# Deterministic constraint names on every backend, so later (batch) migrations can name them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# The anatomy columns of a trial carry exactly the names of MemoryAnatomy's fields.
ANATOMY_COLUMNS = tuple(f.name for f in dataclasses.fields(MemoryAnatomy))


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic filter: only autofit's tables are ours to compare or autogenerate."""
    if type_ == "table":
        return bool(name) and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE
    return True


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class StudyModel(Base):
    """One search request and its outcome; ``request_key`` groups identical requests."""

    __tablename__ = "autofit_studies"
    __table_args__ = (Index("ix_autofit_studies_model_cluster", "model_fingerprint", "cluster_label"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), nullable=False, unique=True)
    model_name: Mapped[str] = mapped_column(String(255), nullable=False, index=True)
    model_fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    model_spec: Mapped[dict] = mapped_column(JSON, nullable=False)
    cluster: Mapped[dict] = mapped_column(JSON, nullable=False)
    cluster_label: Mapped[str] = mapped_column(String(64), nullable=False)
    gpu_name: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    workload: Mapped[dict] = mapped_column(JSON, nullable=False)
    seq_len: Mapped[int] = mapped_column(Integer, nullable=False)  # copied out of workload to query on
    global_batch: Mapped[int] = mapped_column(Integer, nullable=False)
    allowed: Mapped[dict] = mapped_column(JSON, nullable=False)
    evaluator: Mapped[str] = mapped_column(String(32), nullable=False)
    budget: Mapped[dict] = mapped_column(JSON, nullable=False)
    headroom: Mapped[float] = mapped_column(Double, nullable=False)
    versions: Mapped[dict] = mapped_column(JSON, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    request_key: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    optuna_study_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    finished_at: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @classmethod
    def find(cls, session: Session, study_id: int) -> StudyModel | None:
        return session.get(cls, study_id)

    @classmethod
    def find_by_name(cls, session: Session, name: str) -> StudyModel | None:
        return session.query(cls).filter(cls.name == name).one_or_none()


class TrialModel(Base):
    """One evaluation of one plan. A prediction and a measurement of the same plan are two rows."""

    __tablename__ = "autofit_trials"
    __table_args__ = (Index("ix_autofit_trials_study_number", "study_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("autofit_studies.id", ondelete="CASCADE"), nullable=False, index=True
    )
    number: Mapped[int] = mapped_column(Integer, nullable=False)  # Optuna's trial number
    optuna_trial_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    plan: Mapped[dict] = mapped_column(JSON, nullable=False)
    plan_id: Mapped[str] = mapped_column(String(32), nullable=False, index=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    evaluator: Mapped[str] = mapped_column(String(32), nullable=False)
    # the memory anatomy (DESIGN.md), bytes per rank; NULL when the evaluation produced none
    weights: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    gradients: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    optimizer: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    activations: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    temporary: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    logits: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    overhead: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_allocated: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_reserved: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    device_total: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    host_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_sec: Mapped[float | None] = mapped_column(Double, nullable=True)
    step_time_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    throughput: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # Throughput.as_dict()
    capacity_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
    extra: Mapped[dict] = mapped_column(JSON, nullable=False)
    duration_s: Mapped[float] = mapped_column(Double, nullable=False, default=0.0)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


_missing = set(ANATOMY_COLUMNS) - set(TrialModel.__table__.columns.keys())
if _missing:  # a new anatomy field needs a column and a migration
    raise ImportError(f"autofit_trials lacks anatomy columns {sorted(_missing)}; add them with a migration")
