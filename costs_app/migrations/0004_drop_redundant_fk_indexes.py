"""Drop foreign-key indexes that another index on the same table already serves.

cost_events is inserted into by every heartbeat: cost_events_agent_day_idx and
cost_events_company_day_idx lead with agent_id and company_id, and the session key's
index duplicated cost_events_session_idx. The unique budgets_one_per_agent
(company_id, agent_id) serves the budgets' company lookups and cascades.

The state change is the AlterField(db_index=False) makemigrations wrote; the database
change is written by hand because, on PostgreSQL, that AlterField drops every
single-column btree index on the column not listed in Meta.indexes, which takes the
partial unique constraints with it (it would lose budgets_one_per_company), and drops
and re-adds the budgets' foreign key, which rescans the table. On SQLite it rebuilds
each table.
"""

import django.db.models.deletion
from django.db import migrations, models


def drop_index(table: str, column: str, name: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f'DROP INDEX IF EXISTS "{name}"',
        reverse_sql=f'CREATE INDEX "{name}" ON "{table}" ("{column}")',
    )


class Migration(migrations.Migration):
    dependencies = [
        ("costs_app", "0003_budgets"),
        ("sessions_app", "0009_drop_redundant_fk_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="budget",
                    name="company",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="budgets",
                        to="sessions_app.company",
                    ),
                ),
                migrations.AlterField(
                    model_name="costevent",
                    name="agent",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="sessions_app.agent",
                    ),
                ),
                migrations.AlterField(
                    model_name="costevent",
                    name="company",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="sessions_app.company",
                    ),
                ),
                migrations.AlterField(
                    model_name="costevent",
                    name="session",
                    field=models.ForeignKey(
                        blank=True,
                        db_constraint=False,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="sessions_app.agentsession",
                    ),
                ),
            ],
            database_operations=[
                drop_index("budgets", "company_id", "budgets_company_id_306f9bb1"),
                drop_index("cost_events", "agent_id", "cost_events_agent_id_69b36102"),
                drop_index("cost_events", "company_id", "cost_events_company_id_57e3c2b8"),
                drop_index("cost_events", "session_id", "cost_events_session_id_84982b7b"),
            ],
        ),
    ]
