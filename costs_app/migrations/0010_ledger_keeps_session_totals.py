"""A session's total cost is the sum of the ledger rows that name it, kept by the database.

Every row of `cost_events` that names a session adds its cost to that session's
`total_cost_usd` when it is inserted, moves it when its session changes (a new session's
earlier calls, given the session by the commit that creates it), and takes it back when
it is deleted. No code path keeps the figure itself, so none can forget a row; and an
insert stays one statement (`sessions_app.run_calls` bills each call as it returns).
The existing totals are recomputed from the ledger once.
"""

from django.db import migrations

POSTGRESQL = [
    """
    CREATE FUNCTION cost_events_session_total() RETURNS trigger AS $$
    BEGIN
        IF TG_OP <> 'INSERT' AND OLD.session_id IS NOT NULL THEN
            UPDATE agent_sessions SET total_cost_usd = total_cost_usd - OLD.cost_usd WHERE id = OLD.session_id;
        END IF;
        IF TG_OP <> 'DELETE' AND NEW.session_id IS NOT NULL THEN
            UPDATE agent_sessions SET total_cost_usd = total_cost_usd + NEW.cost_usd WHERE id = NEW.session_id;
        END IF;
        RETURN NULL;
    END
    $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER cost_events_session_total
    AFTER INSERT OR DELETE OR UPDATE OF session_id, cost_usd ON cost_events
    FOR EACH ROW EXECUTE FUNCTION cost_events_session_total()
    """,
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS cost_events_session_total ON cost_events",
    "DROP FUNCTION IF EXISTS cost_events_session_total()",
]

SQLITE = [
    """
    CREATE TRIGGER cost_events_session_total_insert AFTER INSERT ON cost_events
    WHEN NEW.session_id IS NOT NULL
    BEGIN
        UPDATE agent_sessions SET total_cost_usd = total_cost_usd + NEW.cost_usd WHERE id = NEW.session_id;
    END
    """,
    """
    CREATE TRIGGER cost_events_session_total_update AFTER UPDATE OF session_id, cost_usd ON cost_events
    BEGIN
        UPDATE agent_sessions SET total_cost_usd = total_cost_usd - OLD.cost_usd WHERE id = OLD.session_id;
        UPDATE agent_sessions SET total_cost_usd = total_cost_usd + NEW.cost_usd WHERE id = NEW.session_id;
    END
    """,
    """
    CREATE TRIGGER cost_events_session_total_delete AFTER DELETE ON cost_events
    WHEN OLD.session_id IS NOT NULL
    BEGIN
        UPDATE agent_sessions SET total_cost_usd = total_cost_usd - OLD.cost_usd WHERE id = OLD.session_id;
    END
    """,
]
SQLITE_REVERSE = [
    "DROP TRIGGER IF EXISTS cost_events_session_total_insert",
    "DROP TRIGGER IF EXISTS cost_events_session_total_update",
    "DROP TRIGGER IF EXISTS cost_events_session_total_delete",
]

RECOMPUTE = """
    UPDATE agent_sessions SET total_cost_usd = COALESCE(
        (SELECT SUM(cost_usd) FROM cost_events WHERE cost_events.session_id = agent_sessions.id), 0
    )
"""


def run(statements):
    def apply(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        for sql in statements.get(vendor, []):
            schema_editor.execute(sql)

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("costs_app", "0009_drop_hand_seeded_prices"),
        ("sessions_app", "0018_session_total_kept_by_ledger"),
    ]

    operations = [
        migrations.RunPython(
            run({"postgresql": [*POSTGRESQL, RECOMPUTE], "sqlite": [*SQLITE, RECOMPUTE]}),
            run({"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}),
        ),
    ]
