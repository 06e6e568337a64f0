"""The context settings an agent leaves unset, chosen from what it sends and how often it wakes.

- Budget (`context_budget_tokens` unset): room for the system prompt, the task, the summary
  in the session, the turns kept verbatim (`keep_recent_turns`) and GROWTH_TURNS turns
  more, each the typical size of the agent's own turns. So a session is summarised every
  GROWTH_TURNS heartbeats whatever its model, instead of carrying up to half a 200k window
  into every call. The turns are measured in the history the heartbeat has already read
  (the median of its last turns: no query); the model's window less the answer's
  `max_tokens` stays the ceiling.
- Cache lifetime (`cache_ttl` unset): from the gaps between the agent's last wakes (read
  on runs_agent_created_idx by the heartbeat's claim, in its own query). At most 5 minutes apart: the 5-minute cache (each
  wake reads what the last one wrote). Between 5 minutes and an hour: the 1-hour cache
  when the ledger shows it pays (what its cache reads saved is at least what its 1-hour
  writes cost over plain input, over the agent's last calls; tried when they show none),
  otherwise none. An hour or more apart: the 1-hour cache when the prefix is kept warm
  until each wake (`sessions_app.keep_warm`: a persistent agent on a schedule) and that
  costs less than sending it uncached; otherwise none (every write would expire unread),
  unless `prompt_caching` is set to true, which keeps the 5-minute cache. The wakes are
  the agent's runs less its compactions and cache refreshes.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import datetime, timedelta

from django.db.models import OuterRef, Subquery

from costs_app.models import CostEvent
from costs_app.pricing import price_table
from costs_app.reports import Growth
from sessions_app.context import (
    DEFAULT_KEEP_RECENT_TURNS,
    SUMMARY_KINDS,
    ContextSettings,
    estimate_tokens,
    model_window,
)
from sessions_app.keep_warm import keep_warm_applies, keep_warm_beats_uncached
from sessions_app.models import Agent, HeartbeatRun, RunTrigger

# Heartbeats between two summaries under the derived budget. Fewer means more summary
# calls (each rewrites the cached prefix); more means longer replayed history.
GROWTH_TURNS = 8
# Room for the summary before the session has one.
SUMMARY_ALLOWANCE_TOKENS = 500
# Turns measured for the typical size, and wakes sampled for the interval.
TURNS_MEASURED = 8
WAKES_SAMPLED = 6
CALLS_SAMPLED = 20
TRIAL_CALLS = 3
FIVE_MINUTES = timedelta(minutes=5)
ONE_HOUR = timedelta(hours=1)
DEFAULT_MAX_OUTPUT_TOKENS = 4096
NOT_WAKES = (RunTrigger.COMPACTION, RunTrigger.CACHE_REFRESH)


def effective_settings(
    *,
    agent: Agent,
    settings_: ContextSettings,
    history: list,
    user_content,
    now: datetime,
    recent_wakes: tuple[datetime, ...] | None = None,
) -> ContextSettings:
    """`settings_` with the budget and cache lifetime the agent's configuration leaves unset."""
    config = agent.adapter_config
    changes: dict = {}
    if agent.is_persistent and settings_.strategy == "summarize" and not config.get("context_budget_tokens"):
        changes["budget_tokens"] = derived_budget(agent, settings_, history=history, user_content=user_content)
    if settings_.caching and not config.get("cache_ttl"):
        ttl = chosen_cache_ttl(agent, now=now, recent_wakes=recent_wakes, history=history, user_content=user_content)
        if ttl == "none" and config.get("prompt_caching") is not True:
            changes["caching"] = False
        else:
            changes["cache_ttl"] = "5m" if ttl == "none" else ttl
    return replace(settings_, **changes) if changes else settings_


# --- the budget -------------------------------------------------------------------------


def derived_budget(agent: Agent, settings_: ContextSettings, *, history: list, user_content) -> int:
    system = estimate_tokens(agent.system_prompt) if agent.system_prompt else 0
    task = estimate_tokens(user_content)
    turn = typical_turn_tokens(history) or 2 * task
    summary = sum(estimate_tokens(m) for m in history if m.get("kind") in SUMMARY_KINDS) or SUMMARY_ALLOWANCE_TOKENS
    wanted = system + task + summary + (settings_.keep_recent_turns + GROWTH_TURNS) * turn
    return min(wanted, budget_ceiling(agent))


def budget_ceiling(agent: Agent) -> int:
    window = model_window(agent.model_name)
    return window - int(agent.adapter_config.get("max_tokens") or DEFAULT_MAX_OUTPUT_TOKENS)


def typical_turn_tokens(history: list) -> int:
    """The median size of the last TURNS_MEASURED turns (a task and its answer), 0 without any."""
    messages = [m for m in history if m.get("kind") not in SUMMARY_KINDS][-2 * TURNS_MEASURED :]
    sizes = [
        estimate_tokens(messages[i]["content"]) + estimate_tokens(messages[i + 1]["content"])
        for i in range(len(messages) - 1)
        if messages[i]["role"] == "user" and messages[i + 1]["role"] == "assistant"
    ]
    return int(statistics.median(sizes)) if sizes else 0


# --- the cache lifetime -----------------------------------------------------------------


def chosen_cache_ttl(
    agent: Agent,
    *,
    now: datetime,
    recent_wakes: tuple[datetime, ...] | None = None,
    history: list | None = None,
    user_content=None,
) -> str:
    """ "5m", "1h" or "none", from how often the agent wakes (see the module's docstring)."""
    gap = typical_wake_gap(agent, recent_wakes=recent_wakes)
    if gap is None or gap <= FIVE_MINUTES:
        return "5m"
    if gap >= ONE_HOUR:
        return (
            "1h"
            if kept_warm_pays(agent, gap=gap, now=now, history=history or [], user_content=user_content)
            else "none"
        )
    return "1h" if one_hour_cache_pays(agent, now=now) else "none"


def kept_warm_pays(agent: Agent, *, gap: timedelta, now: datetime, history: list, user_content) -> bool:
    """Whether an agent waking `gap` apart (an hour or more) that keep-warm applies to pays
    less with its prefix in the 1-hour cache, refreshed until each wake, than uncached: the
    prefix measured as this request's (its system prompt and history), the turn as its task
    and a typical answer (`sessions_app.keep_warm`)."""
    if not keep_warm_applies(agent.adapter_config, persistent=agent.is_persistent) or not history:
        return False
    table = price_table(model=agent.model_name, at=now)
    if table is None:
        return False
    prefix = estimate_tokens({"system": agent.system_prompt, "messages": history})
    turn = estimate_tokens(user_content) + typical_turn_tokens(history) // 2
    return keep_warm_beats_uncached(prefix_tokens=prefix, turn_tokens=turn, gap=gap, rates=table.rates())


def wakes_of(runs):
    """The runs that are wakes of their agent: not its compactions or cache refreshes,
    which follow a wake within minutes and would halve the gap measured."""
    return runs.exclude(trigger__in=NOT_WAKES)


def recent_wakes_columns(*, agent_id_ref: str) -> dict[str, Subquery]:
    """The agent's last WAKES_SAMPLED runs' creation, newest first, as columns of a query
    the caller makes anyway (the heartbeat's claim): one indexed subquery each."""
    created = wakes_of(HeartbeatRun.objects.filter(agent_id=OuterRef(agent_id_ref))).order_by("-created_at")
    return {f"wake_{k}": Subquery(created.values("created_at")[k : k + 1]) for k in range(WAKES_SAMPLED)}


def recent_wakes_of(row) -> tuple[datetime, ...]:
    """What `recent_wakes_columns` read on `row`, newest first."""
    wakes = (row.__dict__.pop(f"wake_{k}") for k in range(WAKES_SAMPLED))
    return tuple(wake for wake in wakes if wake is not None)


def typical_wake_gap(agent: Agent, *, recent_wakes: tuple[datetime, ...] | None = None) -> timedelta | None:
    """The median time between the agent's last wakes (its runs' creation), None with fewer
    than three; from `recent_wakes` when the caller read them (`recent_wakes_columns`)."""
    created = recent_wakes
    if created is None:
        created = tuple(
            wakes_of(HeartbeatRun.objects.filter(agent=agent))
            .order_by("-created_at")
            .values_list("created_at", flat=True)[:WAKES_SAMPLED]
        )
    if len(created) < 3:
        return None
    return statistics.median(earlier - later for later, earlier in zip(created[1:], created, strict=False))


def one_hour_cache_pays(agent: Agent, *, now: datetime) -> bool:
    """Whether the 1-hour cache paid over the agent's calls since it was last used (among its
    last CALLS_SAMPLED): what their cache reads saved against plain input is at least what
    their 1-hour writes cost over it. The first such call writes the whole prefix and reads
    nothing, so it is judged from the third call on; until then, and when none of the calls
    sampled used it, it is tried."""
    calls = list(
        CostEvent.objects.filter(agent_id=agent.id, kind="message")
        .order_by("-created_at")
        .values_list("cache_read_input_tokens", "cache_creation_1h_input_tokens")[:CALLS_SAMPLED]
    )
    used = [index for index, (_, written) in enumerate(calls) if written]
    if not used or used[-1] < TRIAL_CALLS - 1:
        return True
    trial = calls[: used[-1] + 1]
    read = sum(row[0] for row in trial)
    written = sum(row[1] for row in trial)
    table = price_table(model=agent.model_name, at=now)
    if table is None:
        return read >= written  # at Anthropic's multipliers (0.1x read, 2x write) about even
    rates = table.rates()
    saved = read * (rates.input - rates.cache_read)
    extra = written * (rates.cache_write_1h - rates.input)
    return saved >= extra


# --- the growth signal ------------------------------------------------------------------

# What server-side compaction's trigger is when the agent sets none (the API's default).
SERVER_COMPACTION_DEFAULT_TRIGGER = 150_000
SERVER_COMPACTION_MIN_TRIGGER = 50_000


def growth_ceiling(agent: Agent) -> int:
    """What the agent's input per call can grow to: its `context_budget_tokens`, or else its
    model's window less the answer's `max_tokens`. Growth matters against it."""
    return int(agent.adapter_config.get("context_budget_tokens") or budget_ceiling(agent))


def growth_flag(agent: Agent, growth: Growth) -> bool:
    """Whether `growth` (costs_app.reports.input_growth) is worth the operator's time."""
    return growth.is_growing(ceiling_tokens=growth_ceiling(agent))


def growth_advice(agent: Agent, growth: Growth | None = None) -> str:
    """Which setting to change, and to what, when the agent's input (and so its cost) per run
    keeps rising; `growth` sizes a rotation to the slope it shows."""
    config = agent.adapter_config
    if not agent.is_persistent:
        return (
            "A stateless agent carries no history: its tasks or its system prompt are growing. "
            "Shorten them, or make the task refer to stored work instead of repeating it."
        )
    # A fresh session every this many turns keeps the input under a quarter of the ceiling.
    runs = growth.runs_to_add(growth_ceiling(agent) // 4) if growth is not None else None
    rotate = max(2, min(runs, 1000)) if runs else 20
    strategy = config.get("context_strategy") or "summarize"
    if strategy == "none":
        return (
            "context_strategy is none, so the whole history is replayed every run. Remove it (summarize is "
            f"the default) to summarise older turns, or set rotate_after_turns to {rotate}."
        )
    if strategy == "server":
        trigger = int(config.get("compaction_trigger_tokens") or SERVER_COMPACTION_DEFAULT_TRIGGER)
        lower = max(trigger // 2, SERVER_COMPACTION_MIN_TRIGGER)
        if lower < trigger:
            return (
                f"Server-side compaction starts only past its trigger ({trigger} tokens): set "
                f"compaction_trigger_tokens to {lower}."
            )
        return f"Server-side compaction's trigger is at its lowest: set rotate_after_turns to {rotate}."
    if budget := config.get("context_budget_tokens"):
        return (
            f"context_budget_tokens is {budget}: each run carries up to that much history before a summary. "
            f"Lower it to {max(int(budget) // 2, 1000)}, or remove it to use the budget derived from the agent's turns."
        )
    if int(config.get("keep_recent_turns") or DEFAULT_KEEP_RECENT_TURNS) > DEFAULT_KEEP_RECENT_TURNS:
        return (
            f"keep_recent_turns is {config['keep_recent_turns']}: that many turns stay verbatim after each "
            f"summary. Set it to {DEFAULT_KEEP_RECENT_TURNS} (the default)."
        )
    if config.get("cache_ttl"):
        return f"cache_ttl is fixed at {config['cache_ttl']}: remove it, so the cache lifetime follows how often the agent wakes."
    return (
        "The turns themselves are growing (the derived budget follows them): shorten the tasks or the "
        f"answers (max_tokens), or set rotate_after_turns to {rotate} to start fresh sessions with a handoff note."
    )
