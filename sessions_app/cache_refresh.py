"""Keep-warm: refreshing a persistent agent's cached prefix before it expires, when that
costs less than writing it again at the next wake (`sessions_app.keep_warm`).

- After a heartbeat's commit, `keep_warm_arm` (`sessions_app.keep_warm`) decides for the wake that comes next (from
  the agent's schedule), with the prefix the call just cached (its usage) and the lifetime
  it was cached at, and writes the decision and the first refresh's time on the session.
- The maintenance pass (`cache_refreshes_queue`) hands each refresh that falls due to the
  task cluster, once: the row's time is cleared by the update that claims it.
- The task (`session_cache_refresh`) sends the refresh as a run of the agent, trigger
  `cache_refresh`: the database refuses it while a heartbeat runs (which reads the cache
  itself), it is reserved against the budgets and billed when it returns (ledger kind
  `cache_refresh`, naming the session), and its answer is never stored: the history, its
  turn count, its last use and its expiry are untouched. A refresh that fails or is
  refused is its run's failure alone; the next wake writes the prefix again, as it would
  have without keep-warm. After a refresh, the next one is decided the same way.

The refresh is the history the next wake replays, the last answer marked as a cache
breakpoint, and a short user turn asking for one token: it reads the prefix the last call
wrote and writes the last answer, which the next wake would write anyway, so that wake
reads everything before its own task.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import datetime

from django.utils import timezone

from costs_app.budgets import BudgetExceeded
from costs_app.models import CostKind
from paperclip.errors import RunFailure
from sessions_app.adapters import AdapterRequest
from sessions_app.compact_now import CompactRefused, agent_run_open
from sessions_app.context import as_blocks, build_request, cache_marker
from sessions_app.heartbeat import ClaimedRun, Reservation, RunClock
from sessions_app.keep_warm import keep_warm_applies, keep_warm_record
from sessions_app.models import LIVE_SESSION_STATUSES, AgentSession, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.run_queue import REFRESH_TASK, dispatch_after_run, run_fail
from sessions_app.services import budgets_enforce
from sessions_app.stores import store_for
from sessions_app.tool_loop import memory_tool_for

logger = logging.getLogger(__name__)

TASK = "sessions_app.tasks.cache_refresh"
REFRESH_PROMPT = "Cache refresh: no task now. Reply with one word."
# Refreshes handed to the cluster per maintenance pass; the rest wait a minute.
REFRESHES_PER_PASS = 500


def cache_refreshes_queue(*, now: datetime) -> int:
    """Maintenance: hand each refresh due by `now` to the cluster, once (the update that
    clears its time claims it, so two passes never send one twice). A refresh whose
    enqueue fails is dropped and logged: its prefix is written again at the next wake."""
    from django_q.tasks import async_task

    due = list(
        AgentSession.objects.filter(cache_refresh_at__lte=now, status__in=LIVE_SESSION_STATUSES)
        .order_by("cache_refresh_at")
        .values_list("pk", "cache_refresh_at")[:REFRESHES_PER_PASS]
    )
    queued = 0
    for session_id, due_at in due:
        if not AgentSession.objects.filter(pk=session_id, cache_refresh_at=due_at).update(cache_refresh_at=None):
            continue  # another pass claimed it, or a commit decided again
        try:
            async_task(TASK, str(session_id), task_name=f"cache refresh {session_id}")
        except Exception:
            logger.exception("Could not queue the cache refresh of session %s", session_id)
            continue
        queued += 1
    return queued


def session_cache_refresh(*, session_id, now: datetime | None = None) -> str:
    """The refresh of the session's cached prefix, as its run; returns what happened, for
    the task's result. `now` is the clock's time unless given (a simulated clock)."""
    now = now or timezone.now()
    session = AgentSession.objects.select_related("agent").filter(pk=session_id).first()
    if session is None or session.status not in LIVE_SESSION_STATUSES or not session.keep_warm:
        return "skipped: the session ended"
    agent = session.agent
    if not session.is_live_at(now, ttl=agent.session_ttl) or not keep_warm_applies(
        agent.adapter_config, persistent=agent.is_persistent
    ):
        return "skipped: keep-warm no longer applies"
    if refusal := agent.refusal():
        return f"skipped: {refusal[0]}"
    try:
        # The run names no session: its end must not count as the session's use.
        run = agent_run_open(agent, session=None, now=now, trigger=RunTrigger.CACHE_REFRESH, task=REFRESH_TASK)
    except CompactRefused as refusal:  # a heartbeat is running: it reads the cache itself
        return f"skipped: {refusal.code}"
    try:
        reply, finished = refresh_send(run, session, now=now)
    finally:
        dispatch_after_run(agent_id=agent.pk)
    if reply is None:
        return f"failed: {finished}"
    keep_warm_record(
        agent=agent,
        session_id=session.pk,
        ttl=session.keep_warm["ttl"],
        prefix_tokens=int(session.keep_warm["prefix_tokens"]),
        at=finished,
    )
    return f"refreshed: {reply.usage.get('cache_read_input_tokens', 0) if reply.usage else 0} tokens read"


def refresh_send(run: HeartbeatRun, session: AgentSession, *, now: datetime):
    """Send the refresh under `run` and end the run: (reply, finished at), or (None, the
    failure's code) when it failed (recorded on the run, with what it cost)."""
    beat = ClaimedRun.of(run, now=now, clock=RunClock(now=now, started=time.monotonic()))
    beat.calls.names_session(session.pk)
    try:
        request = refresh_request(beat, session)
        Reservation(beat)(request)
        reply = beat.calls.call(request, kind=CostKind.CACHE_REFRESH)
    except RunFailure as failure:
        run_fail(run, code=failure.code, message=failure.message, now=beat.clock(), cost_usd=beat.calls.cost_usd)
        if isinstance(failure, BudgetExceeded):
            budgets_enforce(agent=beat.agent, now=now)
        return None, failure.code
    except BaseException:
        run_fail(
            run,
            code="internal_error",
            message="The cache refresh failed unexpectedly.",
            now=beat.clock(),
            cost_usd=beat.calls.cost_usd,
        )
        raise
    finished = beat.clock()
    HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(
        status=RunStatus.SUCCEEDED,
        finished_at=finished,
        reserved_usd=0,
        model=reply.model,
        cost_usd=beat.calls.cost_usd,
        output="Refreshed the cached prompt.",
    )
    if beat.budgeted:
        budgets_enforce(agent=beat.agent, now=now)
    return reply, finished


def refresh_request(beat: ClaimedRun, session: AgentSession) -> AdapterRequest:
    """The history the next wake replays, its last answer marked, and a one-token ask: the
    same system prompt and tools, so the prefix is the one the last call cached."""
    history = store_for(session).read(session)
    settings_ = replace(beat.settings_, caching=True, cache_ttl=session.keep_warm["ttl"])
    request = build_request(agent=beat.agent, history=history, user_content=REFRESH_PROMPT, settings=settings_)
    messages = list(request.messages)
    if len(messages) >= 2:
        last = messages[-2]
        blocks = as_blocks(last["content"])
        blocks[-1] = {**blocks[-1], "cache_control": cache_marker(settings_)}
        messages[-2] = {"role": last["role"], "content": blocks}
        messages[-1] = {"role": "user", "content": REFRESH_PROMPT}
    tools = [tool.to_dict()] if (tool := memory_tool_for(beat)) is not None else None
    return replace(
        request,
        messages=messages,
        tools=tools,
        max_tokens=1,
        metadata={"run_id": str(beat.run.id), "agent_id": str(beat.agent.id)},
    )
