"""A study's evaluator is stored under the name it has everywhere else.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

``autofit_studies.backend`` becomes ``autofit_studies.evaluator``: the CLI option, the
results' field, the JSON keys and the records already say "evaluator" (``--backend`` is
still read as the option's earlier name). On SQLite the batch mode of ``env.py`` copies
the table; the values are unchanged.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autofit_studies") as batch:
        batch.alter_column("backend", new_column_name="evaluator")


def downgrade() -> None:
    with op.batch_alter_table("autofit_studies") as batch:
        batch.alter_column("evaluator", new_column_name="backend")
