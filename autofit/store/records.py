"""What the store hands out: frozen dataclasses, never ORM rows.

They mirror the tables but carry library objects where one exists (``Plan``,
``MemoryAnatomy``, ``Throughput``, ``Status``), so callers never parse stored JSON.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from autofit.plan import Plan
from autofit.results import MemoryAnatomy, Status, Throughput, TrialResult
from autofit.specs import Target


class StudyStatus(str, Enum):
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C or a budget; can be resumed
    FAILED = "failed"  # stopped by an error; can be resumed once it is fixed

    def __str__(self) -> str:
        return self.value


def _iso(t: datetime.datetime | None) -> str | None:
    return t.isoformat() if t else None


@dataclass(frozen=True)
class StudyRecord:
    id: int
    name: str
    model_name: str
    model_fingerprint: str
    model_spec: dict[str, Any]
    cluster: dict[str, Any]
    cluster_label: str
    gpu_name: str
    workload: dict[str, Any]
    allowed: dict[str, list[str]]
    evaluator: str
    budget: dict[str, Any]
    headroom: float
    versions: dict[str, str]
    status: StudyStatus
    request_key: str
    optuna_study_name: str | None
    created_at: datetime.datetime
    updated_at: datetime.datetime
    finished_at: datetime.datetime | None

    @property
    def seq_len(self) -> int:
        return int(self.workload["seq_len"])

    @property
    def global_batch(self) -> int:
        return int(self.workload["global_batch"])

    def context(self) -> Target:
        """The request's target rebuilt from what was stored (for resume and export)."""
        from autofit.specs import ClusterSpec, ModelSpec, Workload

        return Target(
            ModelSpec.from_dict(self.model_spec),
            ClusterSpec.from_dict(self.cluster),
            Workload.from_dict(self.workload),
            self.headroom,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "model_name": self.model_name,
            "model_fingerprint": self.model_fingerprint,
            "model_spec": self.model_spec,
            "cluster": self.cluster,
            "cluster_label": self.cluster_label,
            "gpu_name": self.gpu_name,
            "workload": self.workload,
            "allowed": self.allowed,
            "evaluator": self.evaluator,
            "budget": self.budget,
            "headroom": self.headroom,
            "versions": self.versions,
            "status": self.status.value,
            "request_key": self.request_key,
            "optuna_study_name": self.optuna_study_name,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "finished_at": _iso(self.finished_at),
        }


@dataclass(frozen=True)
class TrialRecord:
    id: int
    study_id: int
    number: int
    optuna_trial_id: int | None
    plan: Plan
    plan_id: str
    status: Status
    evaluator: str
    memory: MemoryAnatomy | None
    throughput: Throughput | None
    capacity_bytes: int
    reason: str
    extra: dict[str, Any]
    duration_s: float
    created_at: datetime.datetime

    @property
    def fits(self) -> bool:
        return self.status is Status.FITS

    @property
    def tokens_per_sec(self) -> float | None:
        return self.throughput.tokens_per_sec if self.throughput else None

    @property
    def step_time_s(self) -> float | None:
        return self.throughput.step_time_s if self.throughput else None

    @classmethod
    def of(
        cls,
        result: TrialResult,
        *,
        id: int,
        study_id: int,
        number: int,
        optuna_trial_id: int | None,
        plan_id: str,
        created_at: datetime.datetime,
    ) -> TrialRecord:
        """The record of ``result`` stored in the row with these ids (the inverse of :meth:`result`)."""
        return cls(
            id=id,
            study_id=study_id,
            number=number,
            optuna_trial_id=optuna_trial_id,
            plan=result.plan,
            plan_id=plan_id,
            status=result.status,
            evaluator=result.evaluator,
            memory=result.memory,
            throughput=result.throughput,
            capacity_bytes=result.capacity_bytes,
            reason=result.reason,
            extra=dict(result.extra),
            duration_s=result.duration_s,
            created_at=created_at,
        )

    def result(self) -> TrialResult:
        """The library object this row was recorded from."""
        return TrialResult(
            plan=self.plan,
            status=self.status,
            evaluator=self.evaluator,
            memory=self.memory,
            throughput=self.throughput,
            capacity_bytes=self.capacity_bytes,
            reason=self.reason,
            duration_s=self.duration_s,
            extra=dict(self.extra),
        )

    def as_dict(self) -> dict[str, Any]:
        """``TrialResult.as_dict()`` plus where the row lives."""
        return {
            "id": self.id,
            "study_id": self.study_id,
            "number": self.number,
            "optuna_trial_id": self.optuna_trial_id,
            **self.result().as_dict(),
            "created_at": _iso(self.created_at),
        }


@dataclass(frozen=True)
class StudySummary:
    """A study with its best fitting plan and how many evaluations ended in each status."""

    study: StudyRecord
    best: TrialRecord | None
    counts: dict[str, int] = field(default_factory=dict)  # status value -> rows

    @property
    def n_trials(self) -> int:
        return sum(self.counts.values())

    @property
    def best_plan(self) -> Plan | None:
        return self.best.plan if self.best else None

    @property
    def best_tokens_per_sec(self) -> float | None:
        return self.best.tokens_per_sec if self.best else None

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.study.as_dict(),
            "n_trials": self.n_trials,
            "counts": dict(self.counts),
            "best": self.best.as_dict() if self.best else None,
        }


@dataclass(frozen=True)
class SchemaInfo:
    """Where a database stands against this autofit's migrations (``autofit db current``)."""

    url: str  # masked
    current: str | None  # None: no autofit schema yet
    head: str
    known: bool  # False: written by a newer autofit

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head

    @property
    def needs_upgrade(self) -> bool:
        return self.known and not self.up_to_date

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "current": self.current,
            "head": self.head,
            "up_to_date": self.up_to_date,
            "needs_upgrade": self.needs_upgrade,
            "known": self.known,
        }
