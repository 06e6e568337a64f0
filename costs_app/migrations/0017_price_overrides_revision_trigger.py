"""The price overrides' revision moved by the database itself, in the statement that changes
`model_prices`: a queryset update(), a bulk_create() or hand-written SQL sends no signal, and
every process would go on pricing calls from the overrides it had read."""

from django.db import migrations

SQLITE_EVENTS = ("INSERT", "UPDATE", "DELETE")
SQLITE_BUMP = """
    UPDATE price_overrides_revision SET revision = revision + 1 WHERE id = 1;
    INSERT INTO price_overrides_revision (id, revision)
        SELECT 1, 1 WHERE NOT EXISTS (SELECT 1 FROM price_overrides_revision WHERE id = 1);
"""

POSTGRES_FORWARD = """
CREATE FUNCTION price_overrides_revision_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO price_overrides_revision (id, revision) VALUES (1, 1)
        ON CONFLICT (id) DO UPDATE SET revision = price_overrides_revision.revision + 1;
    RETURN NULL;
END $$;
CREATE TRIGGER model_prices_revision AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON model_prices
    FOR EACH STATEMENT EXECUTE FUNCTION price_overrides_revision_bump();
"""
POSTGRES_BACKWARD = """
DROP TRIGGER IF EXISTS model_prices_revision ON model_prices;
DROP FUNCTION IF EXISTS price_overrides_revision_bump();
"""


def sqlite_triggers(create: bool) -> list[str]:
    if create:
        return [
            f"CREATE TRIGGER model_prices_revision_{event.lower()} AFTER {event} ON model_prices BEGIN {SQLITE_BUMP} END"
            for event in SQLITE_EVENTS
        ]
    return [f"DROP TRIGGER IF EXISTS model_prices_revision_{event.lower()}" for event in SQLITE_EVENTS]


def run(schema_editor, *, create: bool) -> None:
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        statements = [POSTGRES_FORWARD if create else POSTGRES_BACKWARD]
    else:
        statements = sqlite_triggers(create)
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


def forward(apps, schema_editor):
    run(schema_editor, create=True)


def backward(apps, schema_editor):
    run(schema_editor, create=False)


class Migration(migrations.Migration):
    dependencies = [("costs_app", "0016_cost_day_cache_refresh_kind")]

    operations = [migrations.RunPython(forward, backward)]
