"""The commit's statements, compiled once per connection and shape (`hot_sql.CompiledStatement`).

A heartbeat's commit writes the run's outcome and, for a persistent agent, the turn on its
session. The ORM compiled both on every heartbeat (about 0.5 ms each, bench/RESULTS.md);
here each is written once from the same querysets, for each shape it takes (which fields a
turn sets, which of its values are None), and then run with each heartbeat's values.

Their values are one flat namespace, each name saying what the value is for:
- `session_id`, `agent_id`, `message_count_was`, `next_seq_was`: the session's condition
  (still live, its agent not deleted, and still holding what the plan read);
- `set__<field>`: a value the turn assigns on the session; `add__<field>`: an amount added
  to a counter of the row as it is; `append__history`: the turns appended to the
  `database` store's history in the statement (`history || new`);
- `run_id` and `run__<field>`: the run's condition (still running) and its outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

from django.db.models import F, Field, JSONField, QuerySet, Value

from sessions_app.hot_sql import (
    CompiledStatement,
    CompiledUpdate,
    agent_not_deleted_locked,
    turn_and_outcome_statement,
)
from sessions_app.models import LIVE_SESSION_STATUSES, Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import JSONAppend, StagedHistory


def turn_values(
    *, agent_id, session: AgentSession, message_count_was: int, staged: StagedHistory, assigned: dict, added: dict
) -> dict:
    """The values of a turn's UPDATE of `session` (`session_turn_update`)."""
    values = {
        "session_id": session.pk,
        "agent_id": agent_id,
        "message_count_was": message_count_was,
        "next_seq_was": session.next_seq,
    }
    for name in staged.fields:
        if name == "history" and staged.appended is not None:
            values["append__history"] = staged.appended
        else:
            values[f"set__{name}"] = getattr(session, name)
    values |= {f"set__{name}": value for name, value in assigned.items()}
    values |= {f"add__{name}": amount for name, amount in added.items()}
    return values


def outcome_values(*, run_id, outcome: dict) -> dict:
    """The values of a run's outcome UPDATE (a session named by its key)."""
    values = {f"run__{name}": value for name, value in outcome.items()}
    if (session := outcome.get("session")) is not None:
        values["run__session"] = session.pk
    return {"run_id": run_id, **values}


def session_turn_update(values: SimpleNamespace) -> tuple[QuerySet, dict]:
    """The UPDATE that records a turn on the resumed session, as a queryset and its values.
    Its condition locks the agent's row first (`hot_sql.agent_not_deleted_locked`), then the
    session's; it matches nothing unless the session is live and holds what the plan read."""
    given = vars(values)
    fields = {name: given[key] for key, name in _prefixed(given, "set__")}
    fields |= {name: F(name) + given[key] for key, name in _prefixed(given, "add__")}
    if "append__history" in given:
        fields["history"] = JSONAppend(F("history"), Value(given["append__history"], output_field=JSONField()))
    queryset = AgentSession.objects.filter(
        pk=values.session_id,
        status__in=LIVE_SESSION_STATUSES,
        message_count=values.message_count_was,
        next_seq=values.next_seq_was,
    ).filter(agent_not_deleted_locked(values.agent_id))
    return queryset, fields


def run_outcome_update(values: SimpleNamespace) -> tuple[QuerySet, dict]:
    """The UPDATE of a run's outcome, matching only while it is running."""
    given = vars(values)
    queryset = HeartbeatRun.objects.filter(id=values.run_id, status=RunStatus.RUNNING)
    return queryset, {name: given[key] for key, name in _prefixed(given, "run__")}


def stateless_outcome_update(values: SimpleNamespace) -> tuple[QuerySet, dict]:
    """A stateless run's success: its outcome, its agent's row locked as a persistent
    commit locks it (a deletion commits first and this matches nothing, or waits)."""
    queryset, fields = run_outcome_update(values)
    return queryset.filter(agent_not_deleted_locked(values.agent_id)), fields


def _turn_and_outcome(values: SimpleNamespace) -> tuple[str, list]:
    return turn_and_outcome_statement(session_turn_update(values), run_outcome_update(values))


def field_of(name: str) -> Field:
    """The model field that prepares the value `name` names (see the module's docstring)."""
    if name in _KEYS:
        return _KEYS[name]
    prefix, _, field = name.partition("__")
    model = HeartbeatRun if prefix == "run" else AgentSession
    return model._meta.get_field(field)


_KEYS = {
    "session_id": AgentSession._meta.pk,
    "agent_id": Agent._meta.pk,
    "run_id": HeartbeatRun._meta.pk,
    "message_count_was": AgentSession._meta.get_field("message_count"),
    "next_seq_was": AgentSession._meta.get_field("next_seq"),
}


def _prefixed(values: dict, prefix: str) -> Iterator[tuple[str, str]]:
    return ((key, key[len(prefix) :]) for key in values if key.startswith(prefix))


# PostgreSQL: the turn and the run's outcome in one statement (`hot_sql.turn_and_outcome_run`).
TURN_AND_OUTCOME = CompiledStatement(_turn_and_outcome, field_of)
STATELESS_OUTCOME = CompiledUpdate(stateless_outcome_update, field_of)
