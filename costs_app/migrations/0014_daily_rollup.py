"""The daily rollup of the ledger (cost_days), kept by the database in the ledger write's
statement.

Triggers on cost_events add each inserted row to its (UTC day, company, agent, model, kind)
total, move an updated row from its old total to its new one, and take back a deleted row
(a total left with no rows is deleted, so a day without spend has none). They run in the
statement that wrote the ledger, so the rollup commits or rolls back with it and every
transaction sees the two agree; `costs_app/ledger.py` stays the one module that writes the
ledger, and a ledger insert stays one round trip. Concurrent writers of one total are
serialised by the upsert's row lock for the rest of their statement's transaction (a
ledger insert is usually its own). The day is the UTC one whatever the connection's time
zone: `AT TIME ZONE 'UTC'` on PostgreSQL, and SQLite's stored text is UTC already.

On PostgreSQL the triggers are per statement, over transition tables: a statement
writing many rows (a bulk insert, a company's rows deleted) upserts each total once,
in key order, so two such statements cannot deadlock on each other's totals. The
existing ledger is summed once, under a lock that holds writers off until the triggers
exist.
"""

from decimal import Decimal

import django.db.models.deletion
from django.db import migrations, models

# The SQL below is spliced from these constant column names only (hence its S608 waivers).
KEY = ("agent_id", "day", "model", "kind", "company_id")  # cost_days_one_per_key, in its order
SUMMED = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_creation_5m_input_tokens",
    "cache_creation_1h_input_tokens",
    "cache_read_input_tokens",
    "session_seconds",
    "cost_usd",
)
COLUMNS = ", ".join((*KEY, *SUMMED, "events"))
ADD_EXCLUDED = ", ".join(f"{c} = cost_days.{c} + excluded.{c}" for c in (*SUMMED, "events"))
# SQLite keeps decimals as floats: each running total is rounded back to the ledger's ten
# places, so it stays the exact sum of its rows (to some $100,000, where a float's digits end)
# where a float SUM drifts.
SQLITE_ADD_EXCLUDED = ADD_EXCLUDED.replace(
    "cost_usd = cost_days.cost_usd + excluded.cost_usd", "cost_usd = round(cost_days.cost_usd + excluded.cost_usd, 10)"
)
PG_DAY = "(created_at AT TIME ZONE 'UTC')::date"


def pg_rows(table: str, sign: int) -> str:
    """The rows of a transition table as signed contributions to their totals."""
    key = ", ".join(PG_DAY if c == "day" else c for c in KEY)
    return f"SELECT {key}, {', '.join(f'{sign} * {c}' for c in SUMMED)}, {sign} FROM {table}"  # noqa: S608


def pg_upsert(*sources: str) -> str:
    """Add the contributions to their totals, one upsert per total, in key order; a total
    that nets to nothing (an update that moved no money, tokens or rows) is not touched."""
    rows = " UNION ALL ".join(sources)
    sums = ", ".join(f"SUM({c})" for c in (*SUMMED, "events"))
    moved = " OR ".join(f"SUM({c}) <> 0" for c in (*SUMMED, "events"))
    key = ", ".join(KEY)
    return (
        f"INSERT INTO cost_days ({COLUMNS}) SELECT {key}, {sums} FROM ({rows}) AS c ({COLUMNS}) "  # noqa: S608
        f"GROUP BY {key} HAVING {moved} ORDER BY {key} "
        f"ON CONFLICT ({key}) DO UPDATE SET {ADD_EXCLUDED}"
    )


PG_EMPTIED = (
    f"DELETE FROM cost_days WHERE events = 0 AND ({', '.join(KEY)}) IN "  # noqa: S608
    f"(SELECT {', '.join(PG_DAY if c == 'day' else c for c in KEY)} FROM old_rows)"
)

POSTGRESQL = [
    f"""
    CREATE FUNCTION cost_days_add() RETURNS trigger AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            {pg_upsert(pg_rows("new_rows", 1))};
        ELSIF TG_OP = 'UPDATE' THEN
            {pg_upsert(pg_rows("old_rows", -1), pg_rows("new_rows", 1))};
            {PG_EMPTIED};
        ELSE
            {pg_upsert(pg_rows("old_rows", -1))};
            {PG_EMPTIED};
        END IF;
        RETURN NULL;
    END
    $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER cost_days_insert AFTER INSERT ON cost_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION cost_days_add()
    """,
    """
    CREATE TRIGGER cost_days_update AFTER UPDATE ON cost_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION cost_days_add()
    """,
    """
    CREATE TRIGGER cost_days_delete AFTER DELETE ON cost_events
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION cost_days_add()
    """,
    """
    CREATE FUNCTION cost_days_clear() RETURNS trigger AS $$
    BEGIN
        DELETE FROM cost_days;
        RETURN NULL;
    END
    $$ LANGUAGE plpgsql
    """,
    "CREATE TRIGGER cost_days_truncate AFTER TRUNCATE ON cost_events FOR EACH STATEMENT EXECUTE FUNCTION cost_days_clear()",
]
POSTGRESQL_REVERSE = [
    *(f"DROP TRIGGER IF EXISTS cost_days_{op} ON cost_events" for op in ("insert", "update", "delete", "truncate")),
    "DROP FUNCTION IF EXISTS cost_days_add()",
    "DROP FUNCTION IF EXISTS cost_days_clear()",
]
# Writers wait (SHARE conflicts with every row write) until the triggers exist and the
# existing ledger is summed, in the migration's transaction: no row is missed or added twice.
POSTGRESQL_LOCK = "LOCK TABLE cost_events IN SHARE MODE"


def sqlite_values(row: str, sign: int) -> str:
    key = ", ".join(f"date({row}.created_at)" if c == "day" else f"{row}.{c}" for c in KEY)
    return f"{key}, {', '.join(f'{sign} * {row}.{c}' for c in SUMMED)}, {sign}"


def sqlite_add(row: str, sign: int) -> str:
    return (
        f"INSERT INTO cost_days ({COLUMNS}) VALUES ({sqlite_values(row, sign)}) "  # noqa: S608
        f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {SQLITE_ADD_EXCLUDED};"
    )


def sqlite_take(row: str) -> str:
    """Take a row back from its total: an update, so a total already gone (cost_days emptied
    first, as a flush of every table may) is not remade with negative sums."""
    where = " AND ".join(f"{c} = date({row}.created_at)" if c == "day" else f"{c} = {row}.{c}" for c in KEY)
    taken = ", ".join(
        f"{c} = round({c} - {row}.{c}, 10)" if c == "cost_usd" else f"{c} = {c} - {row}.{c}" for c in SUMMED
    )
    return f"UPDATE cost_days SET {taken}, events = events - 1 WHERE {where};"  # noqa: S608


SQLITE_EMPTIED = (
    "DELETE FROM cost_days WHERE events = 0 AND "  # noqa: S608
    + " AND ".join(f"{c} = date(OLD.created_at)" if c == "day" else f"{c} = OLD.{c}" for c in KEY)
    + ";"
)
SQLITE = [
    f"CREATE TRIGGER cost_days_insert AFTER INSERT ON cost_events BEGIN {sqlite_add('NEW', 1)} END",
    f"""
    CREATE TRIGGER cost_days_update AFTER UPDATE OF created_at, {", ".join(c for c in (*KEY, *SUMMED) if c != "day")}
    ON cost_events BEGIN {sqlite_take("OLD")} {sqlite_add("NEW", 1)} {SQLITE_EMPTIED} END
    """,
    f"CREATE TRIGGER cost_days_delete AFTER DELETE ON cost_events BEGIN {sqlite_take('OLD')} {SQLITE_EMPTIED} END",
]
SQLITE_REVERSE = [f"DROP TRIGGER IF EXISTS cost_days_{op}" for op in ("insert", "update", "delete")]

SUM_LEDGER = {
    vendor: (
        f"INSERT INTO cost_days ({COLUMNS}) SELECT "  # noqa: S608
        + ", ".join(day if c == "day" else c for c in KEY)
        + f", {', '.join(money if c == 'cost_usd' else f'SUM({c})' for c in SUMMED)}, COUNT(*) FROM cost_events "
        + "GROUP BY "
        + ", ".join(day if c == "day" else c for c in KEY)
    )
    for vendor, day, money in (
        ("postgresql", PG_DAY, "SUM(cost_usd)"),
        ("sqlite", "date(created_at)", "round(SUM(cost_usd), 10)"),
    )
}


def run(statements):
    def apply(apps, schema_editor):
        for sql in statements.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("costs_app", "0013_cache_refresh_kind"),
        ("sessions_app", "0022_quota_holds_and_agent_health"),
    ]

    operations = [
        migrations.CreateModel(
            name="CostDay",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("day", models.DateField(help_text="The UTC day of the ledger rows' created_at.")),
                ("model", models.TextField(blank=True, default="")),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("message", "Message"),
                            ("compaction", "Compaction"),
                            ("count_tokens", "Count Tokens"),
                            ("session_hours", "Session Hours"),
                        ],
                        max_length=16,
                    ),
                ),
                ("input_tokens", models.BigIntegerField(default=0)),
                ("output_tokens", models.BigIntegerField(default=0)),
                ("cache_creation_input_tokens", models.BigIntegerField(default=0)),
                ("cache_creation_5m_input_tokens", models.BigIntegerField(default=0)),
                ("cache_creation_1h_input_tokens", models.BigIntegerField(default=0)),
                ("cache_read_input_tokens", models.BigIntegerField(default=0)),
                ("session_seconds", models.BigIntegerField(default=0)),
                ("cost_usd", models.DecimalField(decimal_places=10, default=Decimal("0"), max_digits=28)),
                (
                    "events",
                    models.BigIntegerField(
                        default=0, help_text="Ledger rows summed here (never 0: such a row is deleted)."
                    ),
                ),
                (
                    "agent",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="sessions_app.agent",
                    ),
                ),
                (
                    "company",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="sessions_app.company",
                    ),
                ),
            ],
            options={
                "db_table": "cost_days",
                "indexes": [models.Index(fields=["company", "day"], name="cost_days_company_day_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("agent", "day", "model", "kind", "company"), name="cost_days_one_per_key"
                    )
                ],
            },
        ),
        migrations.RunPython(
            run(
                {
                    "postgresql": [POSTGRESQL_LOCK, *POSTGRESQL, SUM_LEDGER["postgresql"]],
                    "sqlite": [*SQLITE, SUM_LEDGER["sqlite"]],
                }
            ),
            run({"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}),
        ),
    ]
