"""Screened plans get their own status; CPU studies keep their memory budget.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03

Data only, no schema change:

- ``autofit_trials.status``: ``pruned`` meant two things. A plan screened out before it
  was evaluated (predicted not to fit; ``extra.pruned_by`` absent) is now ``screened``; a
  measured run the pruner stopped early (``extra.pruned_by == "pruner"``) stays ``pruned``.
- ``autofit_studies.cluster``: a ``--gpus Nxcpu`` study now stores the memory budget of a
  rank (``cpu_memory_bytes``, from ``--cpu-mem-budget``); before, only the name ``CPU`` was
  stored and reading the study back judged it by this machine's RAM. Where a CPU study has
  evaluations, every one of them recorded the budget as its ``capacity_bytes``: that is
  written into the cluster. A CPU study without evaluations stays as it was (its budget is lost).

Tables are spelled out here (only the columns this revision reads and writes) rather than
imported from ``autofit.store.models``: a revision is a frozen record of the schema at that
point, whatever the models become.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_trials = sa.table(
    "autofit_trials",
    sa.column("id", sa.Integer()),
    sa.column("study_id", sa.Integer()),
    sa.column("status", sa.String(16)),
    sa.column("capacity_bytes", sa.BigInteger()),
    sa.column("extra", sa.JSON()),
)
_studies = sa.table(
    "autofit_studies",
    sa.column("id", sa.Integer()),
    sa.column("cluster", sa.JSON()),
)

_CHUNK = 500  # ids per UPDATE ... WHERE id IN (...)


def _set_status(ids: list[int], status: str) -> None:
    bind = op.get_bind()
    for i in range(0, len(ids), _CHUNK):
        bind.execute(_trials.update().where(_trials.c.id.in_(ids[i : i + _CHUNK])).values(status=status))


def upgrade() -> None:
    bind = op.get_bind()
    # the JSON is read in Python: no dialect's JSON operators needed
    pruned = bind.execute(sa.select(_trials.c.id, _trials.c.extra).where(_trials.c.status == "pruned")).all()
    _set_status([row.id for row in pruned if (row.extra or {}).get("pruned_by") != "pruner"], "screened")

    for study in bind.execute(sa.select(_studies.c.id, _studies.c.cluster)).all():
        cluster = dict(study.cluster or {})
        if str(cluster.get("gpu", "")).lower() != "cpu" or cluster.get("cpu_memory_bytes") is not None:
            continue
        capacity = bind.execute(
            sa.select(sa.func.max(_trials.c.capacity_bytes)).where(
                _trials.c.study_id == study.id, _trials.c.capacity_bytes > 0
            )
        ).scalar()
        if capacity:
            cluster["cpu_memory_bytes"] = int(capacity)
            bind.execute(_studies.update().where(_studies.c.id == study.id).values(cluster=cluster))


def downgrade() -> None:
    # ``extra.pruned_by`` still tells the two apart, so upgrading again gives the same rows;
    # ``cpu_memory_bytes`` stays in the cluster: revision 0001's readers ignore the key.
    op.execute(_trials.update().where(_trials.c.status == "screened").values(status="pruned"))
