"""Compaction after the commit: a session is summarised between heartbeats, not inside one.

A heartbeat whose commit leaves its session near its budget (`compaction_due`: the next
request, with a turn like this one, would pass it) hands the summary to the task cluster
(`compaction_ahead_enqueue`, task `sessions_app.tasks.compact_ahead`). The task is compact
now's (`sessions_app.compact_now.session_compact_ahead`): a run of the agent, reserved
against the budgets, billed under its run, checked for pinned facts, refused when it does
not shrink. It summarises only the session as the commit left it, checked again when its
run reads the history: a heartbeat committing between the task's first check and its run's
insert leaves the run `skipped`, unpaid.

Its run is written beside the agent's heartbeats (`HeartbeatRun.beside`): it does not hold
the agent's place during its model call, so a heartbeat arriving then is claimed and goes
ahead on the whole history when the request fits the model's window, or goes back to the
queue until the summary ends (`compaction.SummaryAwaited`). The summary commits only from
the agent's place (`compact_now.agent_place_take`), keeping the turns committed since it
read the history (`compaction.compaction_commit`, `rebase`). A heartbeat that still would not
fit (the task was lost or refused) is compacted in band, as before
(`sessions_app.compaction.fit_budget`).
"""

from __future__ import annotations

import logging

from sessions_app.adapters import AdapterReply
from sessions_app.context import estimate_tokens
from sessions_app.models import AgentSession
from sessions_app.plan import Plan

logger = logging.getLogger(__name__)

TASK = "sessions_app.tasks.compact_ahead"


def compaction_due(plan: Plan, reply: AdapterReply, user_content) -> bool:
    """Whether the next request, carrying this turn and a task the size of this one, would
    pass the budget this run's request was held to (a plan the fit step did not measure, a
    stateless or runtime-kept session, is never due)."""
    if plan.budget_tokens is None or plan.request_tokens is None:
        return False
    answer = estimate_tokens([reply.content, reply.exchanges])
    return plan.request_tokens + answer + estimate_tokens(user_content) > plan.budget_tokens


def compaction_ahead_enqueue(*, session: AgentSession) -> bool:
    """Queue the session's summary for the cluster, naming the session as this commit left
    it (`session` is the row the commit saved, so no read is needed): the task does nothing
    if a turn or a compaction came first, or the session was deleted since. Called after
    the COMMIT; a refused enqueue is logged, never the run's failure (the next heartbeat
    compacts in band when it must)."""
    from django_q.tasks import async_task

    seen = (session.message_count, session.compaction_count)
    try:
        async_task(TASK, str(session.pk), *seen, task_name=f"compact {session.pk}")
    except Exception:  # the broker is down: the summary is made in band when needed
        logger.exception("Could not queue the compaction of session %s", session.pk)
        return False
    return True
