"""The tables answer the SQL of docs/data-model.md verbatim (PostgreSQL)."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connection

from costs_app.models import CostEvent, ModelPrice
from costs_app.pricing import price_table
from sessions_app.models import AgentSession

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("postgres_only")]

SEED_DAILY_COST_QUERY = """
SELECT
  date_trunc('day', ce.created_at) AS day,
  SUM(ce.input_tokens)  AS total_input,
  SUM(ce.output_tokens) AS total_output,
  SUM(ce.cost_usd)      AS daily_cost
FROM cost_events ce
WHERE ce.agent_id = 'your-agent-id'
GROUP BY day
ORDER BY day DESC;
"""


def test_seed_daily_cost_query_runs_verbatim(persistent_agent, stateless_agent):
    def event(agent, when, tokens_in, tokens_out, cost):
        CostEvent.objects.create(
            company=agent.company,
            agent=agent,
            model="claude-opus-4-5",
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            cost_usd=Decimal(cost),
            created_at=when,
        )

    event(persistent_agent, datetime(2026, 11, 1, 9, tzinfo=UTC), 100, 10, "0.0010")
    event(persistent_agent, datetime(2026, 11, 1, 23, tzinfo=UTC), 200, 20, "0.0020")
    event(persistent_agent, datetime(2026, 11, 2, 1, tzinfo=UTC), 400, 40, "0.0040")
    event(stateless_agent, datetime(2026, 11, 2, 1, tzinfo=UTC), 9999, 999, "9.9")

    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'UTC'")
        cursor.execute(SEED_DAILY_COST_QUERY.replace("your-agent-id", str(persistent_agent.id)))
        rows = cursor.fetchall()

    assert [(day.date().isoformat(), i, o, c) for day, i, o, c in rows] == [
        ("2026-11-02", 400, 40, Decimal("0.0040")),
        ("2026-11-01", 300, 30, Decimal("0.0030")),
    ]


def test_raw_insert_into_agent_sessions_uses_database_defaults(persistent_agent):
    session_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO agent_sessions (id, agent_id, company_id) VALUES (%s, %s, %s)",
            [session_id, persistent_agent.id, persistent_agent.company_id],
        )
    session = AgentSession.objects.get(id=session_id)
    assert session.history == []
    assert session.created_at is not None and session.last_used is not None
    assert session.status == "active"
    assert session.message_count == 0
    assert session.store == "database"


def test_tutorial_create_table_columns_exist_with_their_types():
    expected = {
        "id": ("uuid", "NO"),
        "agent_id": ("uuid", "NO"),
        "company_id": ("uuid", "NO"),
        "history": ("jsonb", "NO"),
        "created_at": ("timestamp with time zone", None),
        "last_used": ("timestamp with time zone", None),
        "expires_at": ("timestamp with time zone", "YES"),
    }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name, data_type, is_nullable, column_default FROM information_schema.columns "
            "WHERE table_name = 'agent_sessions'"
        )
        columns = {name: (kind, nullable, default) for name, kind, nullable, default in cursor.fetchall()}
        cursor.execute(
            "SELECT ccu.table_name FROM information_schema.table_constraints tc "
            "JOIN information_schema.key_column_usage kcu ON tc.constraint_name = kcu.constraint_name "
            "JOIN information_schema.constraint_column_usage ccu ON tc.constraint_name = ccu.constraint_name "
            "WHERE tc.table_name = 'agent_sessions' AND tc.constraint_type = 'FOREIGN KEY' "
            "AND kcu.column_name = 'agent_id'"
        )
        agent_fk_targets = {row[0] for row in cursor.fetchall()}
    for name, (kind, nullable) in expected.items():
        assert columns[name][0] == kind, name
        if nullable:
            assert columns[name][1] == nullable, name
    assert columns["history"][2].startswith("'[]'")
    assert "agents" in agent_fk_targets


def test_no_prices_are_seeded_the_library_prices_the_models():
    """The hand-seeded list prices are gone after migrate (docs/data-model.md, `model_prices`):
    the model_prices table holds only an operator's overrides."""
    assert not ModelPrice.objects.exists()
    opus = price_table(model="claude-opus-4-5", at=datetime(2026, 12, 1, tzinfo=UTC)).rates()
    assert (opus.input, opus.output, opus.cache_write_5m, opus.cache_write_1h, opus.cache_read) == (
        Decimal(5),
        Decimal(25),
        Decimal("6.25"),
        Decimal(10),
        Decimal("0.5"),
    )


def test_histories_are_compressed_with_lz4(persistent_agent):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)")
        if cursor.fetchone() is None:
            pytest.skip("this PostgreSQL server was built without lz4")
    # Large and repetitive enough that PostgreSQL compresses it inline.
    history = [{"role": "user", "content": "the same words again " * 40, "seq": i} for i in range(50)]
    session = AgentSession.objects.create(agent=persistent_agent, company=persistent_agent.company, history=history)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_column_compression(history) FROM agent_sessions WHERE id = %s", [session.id])
        assert cursor.fetchone()[0] == "lz4"


# Each btree index on the given tables, with what decides the lookups and orders it can
# serve: per key column, its definition, operator class, collation and sort options.
INDEXES_QUERY = """
SELECT t.relname, i.relname, x.indisunique, x.indnatts > x.indnkeyatts, pg_get_expr(x.indpred, x.indrelid),
       ARRAY(SELECT pg_get_indexdef(x.indexrelid, k, false) FROM generate_series(1, x.indnkeyatts) AS k),
       x.indclass::oid[], x.indcollation::oid[], x.indoption::int2[]
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_am am ON am.oid = i.relam
WHERE t.relname = ANY(%s) AND am.amname = 'btree' AND x.indisvalid
"""


def project_models() -> list:
    return [model for name in ("sessions_app", "costs_app") for model in apps.get_app_config(name).get_models()]


def btree_indexes() -> list[dict]:
    tables = [model._meta.db_table for model in project_models()]
    with connection.cursor() as cursor:
        cursor.execute(INDEXES_QUERY, [tables])
        return [
            {"table": t, "name": n, "unique": u, "includes": inc, "predicate": p, "keys": list(zip(*cols, strict=True))}
            for t, n, u, inc, p, *cols in cursor.fetchall()
        ]


def _leads(keys: list[tuple], other_keys: list[tuple]) -> bool:
    """True when an index on `keys` serves no lookup that one on `other_keys` cannot."""
    prefix = other_keys[: len(keys)]
    if len(keys) > len(other_keys) or [key[:3] for key in keys] != [key[:3] for key in prefix]:
        return False
    # Sort options (DESC, NULLS FIRST) must match, or be all reversed: btrees scan both ways.
    options, other_options = [key[3] for key in keys], [key[3] for key in prefix]
    return options == other_options or options == [option ^ 3 for option in other_options]


def test_no_index_is_made_redundant_by_another_on_the_same_table():
    """Every index is paid for on each write (each heartbeat writes runs and cost events),
    so an index whose key columns equal or lead another's on the same table is pure cost.

    Unique indexes enforce a constraint and are never the redundant one. The other index
    must cover every row the first one does: a partial index (WHERE ...) cannot serve a
    foreign key's cascade lookups, so it only counts against one with the same predicate;
    and a partial index is only ever compared with those, since being small is its point.
    """
    indexes = btree_indexes()
    assert {index["table"] for index in indexes} == {model._meta.db_table for model in project_models()}
    redundant = {
        f"{index['table']}.{index['name']} (served by {other['name']})"
        for index in indexes
        # INCLUDE columns serve index-only scans that a longer key may not.
        if not index["unique"] and not index["includes"]
        for other in indexes
        if other["name"] != index["name"]
        and other["table"] == index["table"]
        and other["predicate"] == index["predicate"]
        and _leads(index["keys"], other["keys"])
        # Of two identical indexes, name one.
        and not (_leads(other["keys"], index["keys"]) and not other["unique"] and other["name"] > index["name"])
    }
    assert not redundant, "redundant indexes:\n" + "\n".join(sorted(redundant))


def test_every_foreign_key_leads_an_index_over_all_rows():
    """Reverse lookups and cascade deletes (and, with a constraint, every delete of the
    referenced row) find the referencing rows through an index leading with the column."""
    leading = {(index["table"], index["keys"][0][0]) for index in btree_indexes() if index["predicate"] is None}
    unindexed = [
        f"{model._meta.db_table}.{field.column}"
        for model in project_models()
        for field in model._meta.local_fields
        if field.is_relation and (model._meta.db_table, field.column) not in leading
    ]
    assert unindexed == []


def test_every_declared_index_and_constraint_exists():
    """On PostgreSQL, an AlterField that turns off a foreign key's db_index also drops the
    partial unique constraints on its column, while the migration state still has them."""
    missing = []
    with connection.cursor() as cursor:
        for model in project_models():
            existing = connection.introspection.get_constraints(cursor, model._meta.db_table)
            declared = [*model._meta.indexes, *model._meta.constraints]
            missing += [f"{model._meta.db_table}.{item.name}" for item in declared if item.name not in existing]
    assert missing == []


def test_the_sql_in_docs_data_model_runs_verbatim(persistent_agent):
    text = (settings.BASE_DIR / "docs" / "data-model.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3
    names = {
        "the-agent-id": persistent_agent.id,
        "your-agent-id": persistent_agent.id,
        "the-company-id": persistent_agent.company_id,
    }
    with connection.cursor() as cursor:
        for block in blocks:
            for placeholder, value in names.items():
                block = block.replace(placeholder, str(value))
            cursor.execute(block)
    session = AgentSession.objects.get(agent=persistent_agent)
    assert (session.status, session.store, session.history, session.message_count) == ("active", "database", [], 0)
