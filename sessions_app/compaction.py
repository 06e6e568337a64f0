"""Compaction inside a heartbeat: fitting the request into the session's budget,
handoff notes for rotated sessions, and the server-side compaction block.

Each compaction commits on its own (archive, new history and record in one transaction)
before the heartbeat's own call, so a failure leaves the session as it was. Every summary
and handoff note is billed the moment its call returns (`sessions_app.run_calls`), kept or
not.
The policy (budgets, splitting, prompts, caching markers) lives in `sessions_app.context`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal

from django.db import transaction

from costs_app.models import CostKind
from sessions_app.adapters import AdapterError, AdapterReply, AdapterRequest
from sessions_app.adapters.base import QuotaRefused
from sessions_app.context import (
    HANDOFF_SYSTEM,
    SUMMARY_KINDS,
    SUMMARY_SYSTEM,
    ContextSettings,
    build_request,
    choose_split,
    estimate_tokens,
    history_problem,
    model_window,
    request_size,
    summary_input_text,
    summary_pair,
    summary_request,
)
from sessions_app.context_defaults import effective_settings
from sessions_app.errors import HistoryUnavailable, StepFailed, SummaryFailed
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    CompactionKind,
    HeartbeatRun,
    RunStatus,
    RunTrigger,
    SessionCompaction,
)
from sessions_app.pins import (
    checked_summary,
    fact_candidates,
    facts_missing,
    keep_instruction,
    pinned_texts,
    retry_instruction,
)
from sessions_app.plan import Handoff, Plan
from sessions_app.stores import NOTHING_STAGED, store_for

# Called with each summary request before it is sent: the heartbeat reserves its cost
# against the budgets there, and refuses (BudgetExceeded) before any request is made.
BeforeCall = Callable[[AdapterRequest], None]
NOT_SHRINKING = "compaction_not_shrinking"


class SummaryAwaited(StepFailed):
    """Not a failure: the session's summary is being written beside its heartbeats
    (`sessions_app.compaction_ahead`) and this heartbeat's request would not fit the
    model's window without it, so the run goes back to the queue until the summary ends."""

    def __init__(self, size: int, window: int) -> None:
        super().__init__(
            "summary_awaited",
            f"The session's summary is being written and the request ({size:,} tokens) would not fit "
            f"the model's window ({window:,}) without it; the run waits for it in the queue.",
        )


def summary_beside(session: AgentSession) -> bool:
    """Whether a summary of the session is being written beside its heartbeats."""
    return HeartbeatRun.objects.filter(
        session_id=session.pk, trigger=RunTrigger.COMPACTION, status=RunStatus.RUNNING, beside__isnull=False
    ).exists()


def write_handoff(
    *, agent: Agent, adapter, plan: Plan, settings_: ContextSettings, now: datetime, before_call: BeforeCall
) -> Plan:
    """Rotation: summarise the ending session into the note that opens the next one; the
    returned plan starts the new session with it."""
    predecessor = plan.retire
    old_history = store_for(predecessor).read(predecessor)
    if problem := history_problem(old_history):
        # Refused before the note is paid for: reading it back takes the turns one by one.
        raise HistoryUnavailable(
            "history_malformed", f"The session's history cannot be summarised into a handoff note: {problem}."
        )
    pins = pinned_texts(agent)
    request = summary_request(
        agent=agent,
        settings=settings_,
        messages=old_history,
        system=HANDOFF_SYSTEM,
        instructions=keep_instruction(pins),
    )
    before_call(request)
    try:
        reply = adapter.call(request, kind=CostKind.COMPACTION)
    except QuotaRefused:
        raise  # not a failure of the step: the run waits for the quota (`sessions_app.quota`)
    except AdapterError as exc:
        raise StepFailed(f"handoff_{exc.code}", f"Writing the handoff note failed: {exc.message}") from None
    # No second call here: a pin the note left out is carried verbatim all the same.
    note = checked_summary(
        written=reply.text, attempts=1, pins=pins, candidates=fact_candidates(summary_input_text(old_history))
    )
    return replace(
        plan,
        handoff=Handoff(summary=note.text, reply=reply, predecessor=predecessor, facts=note.facts),
        history=summary_pair(note.text, kind="handoff", at=now),
        manifest=list(predecessor.manifest),
    )


def fit_budget(
    *,
    agent: Agent,
    adapter,
    run: HeartbeatRun,
    plan: Plan,
    user_content,
    settings_: ContextSettings,
    now: datetime,
    before_call: BeforeCall,
) -> tuple[Plan, AdapterRequest]:
    """The request for this heartbeat, compacting the session first if it would not fit.
    Returns it with the plan it was built from (a new one after a compaction).

    At most one summary per heartbeat: a second one would pay again for what the first
    could not do, and a session that no summary shrinks would pay on every heartbeat.

    The budget and cache lifetime the agent leaves unset are chosen here, from the history
    already read and how often the agent wakes (`sessions_app.context_defaults`)."""
    settings_ = effective_settings(
        agent=agent,
        settings_=settings_,
        history=plan.history,
        user_content=user_content,
        now=now,
        recent_wakes=run.recent_wakes,
    )
    request = build_request(agent=agent, history=plan.history, user_content=user_content, settings=settings_)
    plan = replace(plan, cache_ttl=settings_.cache_ttl if settings_.caching else None)
    if not agent.is_persistent or settings_.strategy != "summarize":
        return plan, request
    size = request_size(adapter, request, settings_.budget_tokens)
    if size <= settings_.budget_tokens:
        return replace(plan, budget_tokens=settings_.budget_tokens, request_tokens=size), request
    if plan.session is None or over_budget(agent, adapter, [], user_content, settings_):
        raise budget_exceeded(size, settings_)  # no summary can help: only the task's own size matters
    if summary_beside(plan.session):
        # Its summary is on its way: a second one would pay again for the same turns, so
        # the turn goes over the budget, within the model's window, or waits for it.
        if size > (window := model_window(agent.model_name)):
            raise SummaryAwaited(size, window)
        return replace(plan, budget_tokens=settings_.budget_tokens, request_tokens=size), request
    split = summary_split(agent, adapter, plan.history, user_content, settings_)
    if split is None:
        raise budget_exceeded(size, settings_)
    if summary_refused_before(plan.session, replaced=split):
        raise summary_not_asked_again(plan.session)
    summary = summary_call(
        agent=agent,
        adapter=adapter,
        settings_=settings_,
        turns=plan.history[:split],
        before_call=before_call,
    )
    new_history = summary_pair(summary.text, kind="summary", at=now) + plan.history[split:]
    if summary_not_shrinking(new_history[:2], plan.history[:split]):
        compaction_refused(session=plan.session, replaced=split, at=now)
    after = build_request(agent=agent, history=new_history, user_content=user_content, settings=settings_)
    session = compaction_commit(
        session=plan.session,
        run=run,
        old_history=plan.history,
        new_history=new_history,
        archived=plan.history[:split],
        summary=summary,
        tokens_before=size,
        tokens_after=estimate_tokens({"system": after.system_blocks or after.system, "messages": after.messages}),
        at=now,
    )
    size = request_size(adapter, after, settings_.budget_tokens)
    if size > settings_.budget_tokens:
        raise budget_exceeded(size, settings_)
    plan = replace(
        plan, session=session, history=new_history, budget_tokens=settings_.budget_tokens, request_tokens=size
    )
    return plan, after


def summary_split(agent: Agent, adapter, history: list, user_content, settings_: ContextSettings) -> int | None:
    """Where the verbatim tail starts: the most recent turns kept (halving the setting) whose
    tail still fits beside the task; all of it summarised when none does (one huge answer,
    say: keeping it verbatim would fail this heartbeat and every later one)."""
    keep = settings_.keep_recent_turns
    while keep:
        split = choose_split(history, keep)
        if split is not None and not over_budget(agent, adapter, history[split:], user_content, settings_):
            return split
        keep //= 2
    return choose_split(history, 0)


@dataclass(frozen=True)
class Summary:
    """A summary as it goes into the session, checked for the agent's pinned facts."""

    reply: AdapterReply  # the call whose text was kept
    text: str  # the model's text, with any pin it left out appended verbatim
    facts: list[dict]
    attempts: int
    earlier_cost: Decimal  # what a first attempt that was retried cost


def summary_call(
    *,
    agent: Agent,
    adapter,
    settings_: ContextSettings,
    turns: list,
    before_call: BeforeCall,
) -> Summary:
    """The summary of `turns`, each call reserved against the budgets before it is made.
    A summary without every pinned fact is asked for once more, naming the missing ones
    (`sessions_app.pins`); the first was billed when it returned, so the retry's
    reservation counts it."""
    pins = pinned_texts(agent)

    def ask(instructions: str) -> AdapterReply:
        request = summary_request(
            agent=agent, settings=settings_, messages=turns, system=SUMMARY_SYSTEM, instructions=instructions
        )
        before_call(request)
        try:
            return adapter.call(request, kind=CostKind.COMPACTION)
        except QuotaRefused:
            raise  # not a failure of the step: the run waits for the quota
        except AdapterError as exc:
            raise SummaryFailed(f"compaction_{exc.code}", f"Summarising the session failed: {exc.message}") from None

    reply = ask(keep_instruction(pins))
    earlier_cost = Decimal(0)
    missing = facts_missing(reply.text, pins)
    if missing:
        earlier_cost = reply.cost_usd or Decimal(0)
        reply = ask(keep_instruction(pins) + retry_instruction(missing))
    checked = checked_summary(
        written=reply.text,
        attempts=2 if missing else 1,
        pins=pins,
        candidates=fact_candidates(summary_input_text(turns)),
    )
    return Summary(
        reply=reply, text=checked.text, facts=checked.facts, attempts=checked.attempts, earlier_cost=earlier_cost
    )


def summary_not_shrinking(summary: list, replaced: list) -> bool:
    return estimate_tokens(summary) >= estimate_tokens(replaced)


def budget_exceeded(size: int, settings_: ContextSettings) -> StepFailed:
    return StepFailed(
        "context_budget_exceeded",
        f"The request needs about {size} tokens, over the session's budget of {settings_.budget_tokens}, "
        "and compaction cannot reduce it further. Shorten the task or raise context_budget_tokens.",
    )


def summary_refused_before(session: AgentSession, *, replaced: int) -> bool:
    """Whether summarising the first `replaced` messages of the session was refused as not
    shrinking and no turn was added since: the same request would be paid for again."""
    return (
        session.compaction_error == NOT_SHRINKING
        and session.compaction_error_next_seq == session.next_seq
        and session.compaction_error_replaced == replaced
    )


def summary_not_asked_again(session: AgentSession) -> StepFailed:
    return StepFailed(
        NOT_SHRINKING,
        f"The summary of these turns was no shorter than they are ({session.compaction_error_at:%Y-%m-%d %H:%M} "
        "UTC), and nothing changed since, so it was not asked for again. Compact the session now "
        "(POST .../compact, or the admin action), lower keep_recent_turns, or end the session.",
    )


def compaction_refused(*, session: AgentSession, replaced: int, at: datetime):
    """A summary no smaller than the `replaced` messages it would replace: kept out of the
    session (it would only grow; it was billed when it returned), and the session marked
    so that an operator sees why and no later heartbeat pays for the same summary
    (`summary_refused_before`)."""
    AgentSession.objects.filter(pk=session.pk).update(
        compaction_error=NOT_SHRINKING,
        compaction_error_at=at,
        compaction_error_next_seq=session.next_seq,
        compaction_error_replaced=replaced,
    )
    raise StepFailed(
        NOT_SHRINKING,
        "The summary was no shorter than the turns it would replace, so it was not kept and no other "
        "was asked for. Shorten the turns (keep_recent_turns, the task) or end the session.",
    )


def over_budget(agent: Agent, adapter, history: list, user_content, settings_: ContextSettings) -> bool:
    """Whether a request carrying only `history` and the task would still be over the budget."""
    request = build_request(agent=agent, history=history, user_content=user_content, settings=settings_)
    return request_size(adapter, request, settings_.budget_tokens) > settings_.budget_tokens


def compaction_record(
    *,
    session: AgentSession,
    run: HeartbeatRun,
    kind: str,
    reply: AdapterReply,
    summary: str,
    archived: list,
    messages: tuple[int, int],
    tokens: tuple[int, int],
    at: datetime,
    facts: list | None = None,
    attempts: int = 1,
    earlier_cost: Decimal = Decimal(0),
) -> None:
    """The record of one compaction or handoff (inside the caller's transaction): what it
    cost is its call's ledger row, with a retried first attempt's (`earlier_cost`)."""
    SessionCompaction.objects.create(
        session=session,
        run=run,
        kind=kind,
        created_at=at,
        archived_messages=archived,
        messages_before=messages[0],
        messages_after=messages[1],
        tokens_before=tokens[0],
        tokens_after=tokens[1],
        summary=summary,
        model=reply.model,
        cost_usd=(reply.cost_usd or Decimal(0)) + earlier_cost,
        cost_event_id=reply.cost_event_id,
        facts=facts or [],
        summary_attempts=attempts,
    )


def compaction_commit(
    *,
    session: AgentSession,
    run: HeartbeatRun,
    old_history: list,
    new_history: list,
    archived: list,
    summary: Summary,
    tokens_before: int,
    tokens_after: int,
    at: datetime,
    rebase: bool = False,
) -> AgentSession:
    """Swap in the compacted history, archive the replaced turns, record the compaction:
    all in one transaction, so a failure leaves the session as it was (its summary stays
    billed). The new history is published only after the COMMIT (see `sessions_app.stores`).

    `rebase`: turns heartbeats appended while the summary was written (it was written
    beside them) are kept after it; any other change to the session refuses the summary."""
    staged = NOTHING_STAGED
    try:
        with transaction.atomic(durable=True):
            locked = AgentSession.objects.select_for_update().defer("history").filter(pk=session.pk).first()
            if locked is None:
                raise StepFailed("session_deleted", "The session was deleted while it was being summarised.")
            appended = turns_appended(locked, old_history) if rebase else []
            if locked.message_count != len(old_history) + len(appended) or locked.status not in LIVE_SESSION_STATUSES:
                raise StepFailed("session_conflict", "The session changed while it was being compacted.")
            if appended:
                added = estimate_tokens(appended)
                old_history, new_history = old_history + appended, new_history + appended
                tokens_before, tokens_after = tokens_before + added, tokens_after + added
            # A run reaped while its summary was written is no longer the session's one
            # writer. Locked, so the reaper cannot fail it between this check and COMMIT.
            if not HeartbeatRun.objects.select_for_update().filter(id=run.id, status=RunStatus.RUNNING).exists():
                raise StepFailed("run_timeout", "The run was reaped as timed out while the session was summarised.")
            compaction_record(
                session=locked,
                run=run,
                kind=CompactionKind.SUMMARIZE,
                reply=summary.reply,
                summary=summary.text,
                archived=archived,
                messages=(len(old_history), len(new_history)),
                tokens=(tokens_before, tokens_after),
                at=at,
                facts=summary.facts,
                attempts=summary.attempts,
                earlier_cost=summary.earlier_cost,
            )
            staged = store_for(locked).stage(locked, new_history)
            locked.message_count = len(new_history)
            locked.archived_message_count += sum(1 for m in archived if m.get("kind") not in SUMMARY_KINDS)
            locked.compaction_count += 1
            locked.compaction_error, locked.compaction_error_at = "", None
            locked.compaction_error_next_seq = locked.compaction_error_replaced = None
            locked.save()
    except BaseException:
        staged.discard()
        raise
    staged.publish()
    return locked


def turns_appended(locked: AgentSession, history: list) -> list:
    """The turns the locked session holds after `history` when it starts with exactly that
    history (heartbeats appended them); none when it holds no more, or holds another."""
    if locked.message_count <= len(history):
        return []
    current = store_for(locked).read(locked)
    return current[len(history) :] if current[: len(history)] == history else []


def starts_with_compaction(content) -> bool:
    return isinstance(content, list) and bool(content) and content[0].get("type") == "compaction"


def server_compaction_archive(
    session: AgentSession, *, run: HeartbeatRun, archived: list, reply: AdapterReply, at
) -> None:
    block = reply.content[0]
    iterations = (reply.usage or {}).get("iterations") or []
    before = sum(i.get("input_tokens", 0) for i in iterations if isinstance(i, dict) and i.get("type") == "compaction")
    SessionCompaction.objects.create(
        session=session,
        run=run,
        kind=CompactionKind.SERVER,
        created_at=at,
        archived_messages=archived,
        messages_before=len(archived) + 2,
        messages_after=2,
        tokens_before=before,
        tokens_after=(reply.usage or {}).get("input_tokens", 0),
        summary=block.get("content") or "",
        model=reply.model,
    )
    session.archived_message_count += sum(1 for m in archived if m.get("kind") not in SUMMARY_KINDS)
    session.compaction_count += 1


def handoff_record(session: AgentSession, *, run: HeartbeatRun, handoff: Handoff, at: datetime) -> None:
    compaction_record(
        session=session,
        run=run,
        kind=CompactionKind.HANDOFF,
        reply=handoff.reply,
        summary=handoff.summary,
        archived=[],
        messages=(handoff.predecessor.message_count, 2),
        tokens=(handoff.predecessor.last_input_tokens or 0, estimate_tokens(handoff.summary)),
        at=at,
        facts=handoff.facts,
    )
