"""A session's history revision, moved by PostgreSQL itself in every UPDATE that sets
`history`, whoever sends it (a queryset update(), a save(), hand-written SQL), so that a
session's id and revision always name one history (`sessions_app.history_cache`). SQLite
keeps no cache of histories and leaves it at 0."""

from django.db import migrations, models

POSTGRES_FORWARD = """
CREATE FUNCTION agent_sessions_history_rev_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.history_rev := OLD.history_rev + 1;
    RETURN NEW;
END $$;
CREATE TRIGGER agent_sessions_history_rev BEFORE UPDATE OF history ON agent_sessions
    FOR EACH ROW EXECUTE FUNCTION agent_sessions_history_rev_bump();
"""
POSTGRES_BACKWARD = """
DROP TRIGGER IF EXISTS agent_sessions_history_rev ON agent_sessions;
DROP FUNCTION IF EXISTS agent_sessions_history_rev_bump();
"""


def run(schema_editor, *, create: bool) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(POSTGRES_FORWARD if create else POSTGRES_BACKWARD)


def forward(apps, schema_editor):
    run(schema_editor, create=True)


def backward(apps, schema_editor):
    run(schema_editor, create=False)


class Migration(migrations.Migration):
    dependencies = [("sessions_app", "0036_batch_submitted_at")]

    operations = [
        # Django's AddField of a NOT NULL column remakes SQLite's table, and the ledger's
        # SQLite triggers that name `agent_sessions` fail its rename; both databases add
        # such a column in place.
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    "ALTER TABLE agent_sessions ADD COLUMN history_rev bigint NOT NULL DEFAULT 0",
                    "ALTER TABLE agent_sessions DROP COLUMN history_rev",
                )
            ],
            state_operations=[
                migrations.AddField(
                    model_name="agentsession",
                    name="history_rev",
                    field=models.BigIntegerField(db_default=0, default=0, editable=False),
                )
            ],
        ),
        migrations.RunPython(forward, backward),
    ]
