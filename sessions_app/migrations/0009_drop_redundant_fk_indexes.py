"""Drop foreign-key indexes whose column leads a composite index on the same table.

That composite index serves the key's lookups and cascades, so the single-column one
was only cost, paid on every insert (each heartbeat inserts a run) and most updates.

The state change is the AlterField(db_index=False) makemigrations wrote; the database
change is written by hand because, on PostgreSQL, that AlterField drops every
single-column btree index on the column not listed in Meta.indexes, which takes the
partial unique constraints with it (it would lose sessions_one_live_per_agent and
runs_one_running_per_agent), and drops and re-adds the foreign key, which rescans the
table. On SQLite it rebuilds each table.
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
        ("sessions_app", "0008_history_lz4_compression"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="agent",
                    name="company",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="agents",
                        to="sessions_app.company",
                    ),
                ),
                migrations.AlterField(
                    model_name="agentsession",
                    name="agent",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="sessions",
                        to="sessions_app.agent",
                    ),
                ),
                migrations.AlterField(
                    model_name="heartbeatrun",
                    name="agent",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="runs",
                        to="sessions_app.agent",
                    ),
                ),
                migrations.AlterField(
                    model_name="sessioncompaction",
                    name="session",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="compactions",
                        to="sessions_app.agentsession",
                    ),
                ),
            ],
            database_operations=[
                drop_index("agents", "company_id", "agents_company_id_b4854bbb"),
                drop_index("agent_sessions", "agent_id", "agent_sessions_agent_id_ab14fc22"),
                drop_index("heartbeat_runs", "agent_id", "heartbeat_runs_agent_id_4e0837b7"),
                drop_index("session_compactions", "session_id", "session_compactions_session_id_5a79de2d"),
            ],
        ),
    ]
