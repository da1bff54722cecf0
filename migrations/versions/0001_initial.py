"""Initial schema: studies and their trials (one row per evaluation).

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Tables are spelled out here rather than imported from ``autofit.store.models``: a
revision is a frozen record of the schema at that point, whatever the models become.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ANATOMY = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "temporary",
    "logits",
    "overhead",
    "peak_allocated",
    "peak_reserved",
    "device_total",
    "host_bytes",
)


def upgrade() -> None:
    op.create_table(
        "autofit_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("model_fingerprint", sa.String(64), nullable=False),
        sa.Column("model_spec", sa.JSON(), nullable=False),
        sa.Column("cluster", sa.JSON(), nullable=False),
        sa.Column("cluster_label", sa.String(64), nullable=False),
        sa.Column("gpu_name", sa.String(64), nullable=False),
        sa.Column("workload", sa.JSON(), nullable=False),
        sa.Column("seq_len", sa.Integer(), nullable=False),
        sa.Column("global_batch", sa.Integer(), nullable=False),
        sa.Column("allowed", sa.JSON(), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("budget", sa.JSON(), nullable=False),
        sa.Column("headroom", sa.Double(), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request_key", sa.String(64), nullable=False),
        sa.Column("optuna_study_name", sa.String(255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_autofit_studies"),
        sa.UniqueConstraint("name", name="uq_autofit_studies_name"),
    )
    op.create_index("ix_autofit_studies_model_name", "autofit_studies", ["model_name"])
    op.create_index("ix_autofit_studies_gpu_name", "autofit_studies", ["gpu_name"])
    op.create_index("ix_autofit_studies_request_key", "autofit_studies", ["request_key"])
    op.create_index("ix_autofit_studies_model_cluster", "autofit_studies", ["model_fingerprint", "cluster_label"])

    op.create_table(
        "autofit_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_id", sa.Integer(), nullable=True),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("plan_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("evaluator", sa.String(32), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=True) for name in _ANATOMY],
        sa.Column("tokens_per_sec", sa.Double(), nullable=True),
        sa.Column("step_time_s", sa.Double(), nullable=True),
        sa.Column("throughput", sa.JSON(), nullable=True),
        sa.Column("capacity_bytes", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["study_id"], ["autofit_studies.id"], name="fk_autofit_trials_study_id_autofit_studies", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_autofit_trials"),
    )
    op.create_index("ix_autofit_trials_study_id", "autofit_trials", ["study_id"])
    op.create_index("ix_autofit_trials_plan_id", "autofit_trials", ["plan_id"])
    op.create_index("ix_autofit_trials_study_number", "autofit_trials", ["study_id", "number"])


def downgrade() -> None:
    op.drop_table("autofit_trials")
    op.drop_table("autofit_studies")
