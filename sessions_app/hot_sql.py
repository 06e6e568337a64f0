"""Statements of the heartbeat's hot path that the ORM cannot write, each with the guarantee
it keeps. Every one runs on SQLite and PostgreSQL; where PostgreSQL needs a row lock that
SQLite's one-writer-at-a-time transactions make unnecessary, only PostgreSQL takes it.
"""

from __future__ import annotations

from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from sessions_app.models import Agent, AgentStatus


def agent_not_deleted_locked(agent_id) -> RawSQL:
    """A condition for a single-statement UPDATE: the agent exists and is not deleted, its
    row locked (FOR NO KEY UPDATE) until the statement's implicit COMMIT.

    Guarantee: as in the heartbeat's commit transaction, a deletion (`agent_delete` updates
    the agent's row first) either commits before the statement, which then sees the deleted
    status once the lock is granted (PostgreSQL re-reads a locked row) and updates nothing,
    or waits for the statement's COMMIT. Without the lock, a statement that read the row
    while the deletion's transaction was open would succeed beside it."""
    table, pk = Agent._meta.db_table, Agent._meta.pk
    lock = " FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    return RawSQL(  # noqa: S611 (names from the model, values as parameters)
        f'EXISTS (SELECT 1 FROM "{table}" WHERE "{pk.column}" = %s AND "status" <> %s{lock})',  # noqa: S608
        [pk.get_db_prep_value(agent_id, connection), AgentStatus.DELETED],
        output_field=BooleanField(),
    )
