"""Input tokens per heartbeat over 300 heartbeats, and what they cost, per context strategy.

Five runs with the same 300 tasks against the fake Messages API (which simulates prompt
caching and reports usage from the request size):
- persistent, context_strategy none (the whole history replayed every time);
- persistent, summarize (budgeted compaction), no prompt caching;
- persistent, summarize + prompt caching;
- stateless, no prompt caching;
- stateless + prompt caching (its system prompt read from the cache).

The baseline is the best configuration of the alternative: the cheaper of the two stateless
runs (with caching on, a stateless agent pays its long system prompt at the cache-read rate,
not in full every time; comparing against the uncached one flattered persistence).

    .venv/bin/pip install -r bench/requirements.txt
    .venv/bin/python bench/context_growth.py            # SQLite in a temporary folder
    DATABASE_URL=postgres://... .venv/bin/python bench/context_growth.py

    .venv/bin/python bench/context_growth.py defaults [MINUTES ...]   # issue 15 (below)
    .venv/bin/python bench/context_growth.py batch [MINUTES ...]      # issue 28: delivery by batch vs direct
    .venv/bin/python bench/context_growth.py keepwarm [MINUTES ...]   # issue 28: the cache kept warm

The `defaults` variant runs the workload of issue 15 with no context settings: a persistent
agent with an 8,000-character system prompt, ~800-character tasks and ~1,200-character
answers (output tokens counted from the text), claude-opus-4-5 prices, 300 heartbeats
MINUTES apart (2 and 30 by default; the fake's prompt cache expires by a simulated clock). It
prints persistent cost against the cheaper stateless configuration (the engine's default
caching, or none), where the money goes, and how many of 20 facts planted in
heartbeats 1-20 are still in the request at heartbeat 300, with the facts pinned and without,
under a fake summariser that keeps what it is given to keep (at most 10 named facts a
summary) and a ~1,000-character gist. After each heartbeat the summaries its commit queued
for the task cluster are made (`between_heartbeats`), on the simulated clock.

Writes bench/out/context_growth.png and prints the totals. The agents carry a realistic
~1,500-token system prompt and ~100-token answers. The budget is 8,000 tokens so that
compaction happens within 300 short turns (at the default of half the context window it
would not start until about turn 600).
"""

from __future__ import annotations

import os
import sys
import tempfile
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("PAPERCLIP_HOME", tempfile.mkdtemp(prefix="paperclip-bench-"))

HEARTBEATS = int(os.environ.get("BENCH_HEARTBEATS", "300"))
BUDGET = 8000
SYSTEM_PROMPT = "You are the release engineer of a mid-sized software company. " + " ".join(
    f"Rule {i}: keep change {i} reviewed, tested, documented and reversible before it ships." for i in range(80)
)


def main() -> None:
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db.models import Sum
    from django.utils import timezone

    from costs_app.models import CostEvent
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, Company, HeartbeatRun
    from sessions_app.run_queue import heartbeat_enqueue
    from tests.fake_anthropic import FakeAnthropic

    fake = FakeAnthropic().start()
    fake.answer_padding = "Done; the change is merged and the notes are updated. " * 7
    os.environ["ANTHROPIC_BASE_URL"] = fake.base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    company = Company.objects.create(name=f"bench {timezone.now():%H%M%S}")
    tasks = [
        f"Heartbeat {i}: check the release queue, merge change {i} if its checks pass, and report."
        for i in range(HEARTBEATS)
    ]
    configurations = {
        "persistent, none": {"session_mode": "persistent", "context_strategy": "none", "prompt_caching": False},
        "persistent, summarize": {
            "session_mode": "persistent",
            "context_strategy": "summarize",
            "context_budget_tokens": BUDGET,
            "prompt_caching": False,
        },
        "persistent, summarize + caching": {
            "session_mode": "persistent",
            "context_strategy": "summarize",
            "context_budget_tokens": BUDGET,
            "prompt_caching": True,
        },
        "stateless": {"session_mode": "stateless", "prompt_caching": False},
        "stateless + caching": {"session_mode": "stateless", "prompt_caching": True},
    }
    series, totals = {}, {}
    for label, config in configurations.items():
        agent = Agent.objects.create(
            company=company,
            name=label,
            system_prompt=SYSTEM_PROMPT,
            adapter_config={"model": "claude-sonnet-4-5", "max_tokens": 1024, **config},
        )
        for task in tasks:
            run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
            run = heartbeat_execute(run_id=run.id)
            assert run.status == "succeeded", (label, run.error_code, run.error)
        runs = HeartbeatRun.objects.filter(agent=agent).order_by("created_at")
        series[label] = [r.input_tokens + r.cache_creation_input_tokens + r.cache_read_input_tokens for r in runs]
        totals[label] = CostEvent.objects.filter(agent_id=agent.id).aggregate(total=Sum("cost_usd"))[
            "total"
        ] or Decimal(0)
    fake.stop()

    # The baseline is the best the alternative does: the cheaper stateless configuration.
    best = min(("stateless", "stateless + caching"), key=lambda label: totals[label])
    baseline = totals[best]
    print(f"{HEARTBEATS} heartbeats per configuration; budget {BUDGET} tokens; model claude-sonnet-4-5 list prices")
    print(f"baseline: {best} (the cheaper stateless configuration)")
    for label in configurations:
        tokens = series[label]
        print(
            f"{label:34s} input tokens/heartbeat first {tokens[0]:6d} max {max(tokens):6d} last {tokens[-1]:6d}; "
            f"total cost ${totals[label]:.4f} = {totals[label] / baseline:.2f}x best stateless"
        )
    ratio = totals["persistent, summarize + caching"] / baseline
    print(f"summarize + caching vs best stateless ({best}): {ratio:.2f}x (goal <= 1.50x)")
    plot(series)


def plot(series: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -r bench/requirements.txt): no plot written")
        return
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(9, 5))
    for label, tokens in series.items():
        axes.plot(range(1, len(tokens) + 1), tokens, label=label)
    axes.set_xlabel("heartbeat")
    axes.set_ylabel("input tokens (uncached + cache write + cache read)")
    axes.set_title("Input tokens per heartbeat by context strategy")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "context_growth.png", dpi=110)
    print(f"plot: {out / 'context_growth.png'}")


# --- the `defaults` variant (issue 15) ---------------------------------------------------

DEFAULTS_MODEL = "claude-opus-4-5"
DEFAULTS_PROMPT = (
    "You are the operations agent of a mid-sized software company. "
    + " ".join(
        f"Rule {i}: before you change service {i}, read its runbook, check its alerts and its last deploy, "
        "and write down what you did and why."
        for i in range(70)
    )
)[:8000]
FACTS = [
    f"FACT-{k:02d}: the {thing} is {value}"
    for k, (thing, value) in enumerate(
        [
            ("on-call phone for payments", "+1-555-0142"),
            ("staging database host", "db-stg-7.internal:54327"),
            ("billing runbook", "https://wiki.example.com/runbooks/billing-v3"),
            ("deploy freeze window", "Fridays 14:00-23:59 UTC"),
            ("customer escalation id", "ESC-88412"),
            ("TLS certificate expiry", "2027-02-11"),
            ("log bucket", "s3://ops-logs-eu-west-1/prod"),
            ("feature flag for checkout v2", "ff_checkout_v2_rollout"),
            ("max replicas of the API", "48"),
            ("config file of the gateway", "/etc/gateway/routes.yaml"),
            ("owner of the search cluster", "team-lucene (Priya)"),
            ("incident ticket", "INC-2291"),
            ("error budget left this quarter", "37 minutes"),
            ("VPN gateway address", "10.42.0.1"),
            ("migration branch", "release/2026.11-migrate-orders"),
            ("cost alert threshold", "$12,500 per month"),
            ("vendor contract number", "VC-2026-0193"),
            ("backup retention", "35 days"),
            ("SLO for p99 latency", "450 ms"),
            ("status page", "https://status.example.com/incidents/7731"),
        ],
        start=1,
    )
]
OLD_DEFAULTS = {
    "context_budget_tokens": 100_000,
    "keep_recent_turns": 4,
    "cache_ttl": "5m",
    "summary_model": DEFAULTS_MODEL,
}
FILLER = (
    "Check the service dashboards, read the last deploy's notes, look at the open alerts and the error "
    "rates per endpoint, confirm the queue depths are normal, and report anything unusual with its evidence. "
)


def defaults_task(i: int) -> str:
    """About 800 characters; heartbeats 1 to 20 each plant one fact."""
    fact = f" Remember this for later: {FACTS[i - 1]}." if 1 <= i <= len(FACTS) else ""
    head = f"Heartbeat {i}: routine operations pass.{fact} "
    return (head + FILLER * 8)[:800]


def defaults_answer(body: dict) -> str:
    """About 1,200 characters, as an operations report."""
    from tests.fake_anthropic import last_user_text

    task = last_user_text(body.get("messages", []))
    head = f"Report for '{task[:40]}': all services nominal. "
    body_text = "Dashboards green; no alerts open; deploys healthy; queue depths normal; error rates flat. " * 16
    return (head + body_text)[:1200]


def keeping_summariser(body: dict) -> str:
    """A summariser that keeps what it is given to keep and little else: a short gist of the
    turns, and the facts the request names (at most 10 a summary, the ones named as missing
    first), as a model with limited attention might."""
    from tests.fake_anthropic import last_user_text

    text = last_user_text(body.get("messages", []))
    named: list[str] = []
    if "[Missing from your previous summary]" in text:
        named += [
            line[2:]
            for line in text.split("[Missing from your previous summary]")[1].splitlines()
            if line.startswith("- ")
        ]
    if "[Pinned facts]" in text:
        pinned = text.split("[Pinned facts]")[1].split("[Missing from your previous summary]")[0]
        named += [line[2:] for line in pinned.splitlines() if line.startswith("- ") and line[2:] not in named]
    turns = text.count("[user]")
    # About 1,000 characters, as a real summary of a few routine heartbeats would be.
    gist = f"Summary of {turns} earlier heartbeats: routine operations passes. " + (
        "Dashboards were green, no alerts were open, deploys were healthy, queue depths and error rates normal. " * 9
    )
    return "\n".join([gist, *named[:10]])


def steady_parts(events, heartbeats: int) -> dict:
    """Where the money goes, per heartbeat: answers' output, plain input, cache writes and
    reads, and the summary calls."""
    from costs_app.pricing import price_table

    parts = dict.fromkeys(["output", "input", "cache write", "cache read", "summaries"], Decimal(0))
    for event in events:
        if event.kind == "compaction":
            parts["summaries"] += event.cost_usd
            continue
        rates = price_table(model=event.model, at=event.created_at).rates(
            prompt_tokens=event.input_tokens + event.cache_creation_input_tokens + event.cache_read_input_tokens
        )
        parts["output"] += event.output_tokens * rates.output / 1_000_000
        parts["input"] += event.input_tokens * rates.input / 1_000_000
        parts["cache write"] += (
            event.cache_creation_5m_input_tokens * rates.cache_write_5m
            + event.cache_creation_1h_input_tokens * rates.cache_write_1h
        ) / 1_000_000
        parts["cache read"] += event.cache_read_input_tokens * rates.cache_read / 1_000_000
    return {name: value / heartbeats for name, value in parts.items()}


def between_heartbeats(*, now) -> None:
    """What the task cluster does after a commit: the summaries the commits queued
    (`sessions_app.compaction_ahead`) and the cache refreshes the maintenance pass queued
    (`sessions_app.cache_refresh`), on the simulated clock."""
    from django_q.models import OrmQ

    from sessions_app.cache_refresh import TASK as REFRESH
    from sessions_app.cache_refresh import session_cache_refresh
    from sessions_app.compact_now import session_compact_ahead
    from sessions_app.compaction_ahead import TASK

    for queued in OrmQ.objects.order_by("id"):
        if queued.func() == TASK:
            session_id, *seen = queued.args()
            session_compact_ahead(session_id=session_id, seen=tuple(seen), now=now)
        elif queued.func() == REFRESH:
            session_cache_refresh(session_id=queued.args()[0], now=now)
        queued.delete()


def summarising_fake_on_a_clock():
    """The fake at defaults (summaries keep the planted facts) on a simulated clock, which
    the caller moves by setting clock[0]; the SDK pointed at it."""
    from sessions_app.context import SUMMARY_SYSTEM
    from tests.fake_anthropic import FakeAnthropic, plain_system

    fake = FakeAnthropic().start()
    fake.count_output = True
    fake.writer = lambda body: (
        keeping_summariser(body) if plain_system(body) == SUMMARY_SYSTEM else defaults_answer(body)
    )
    clock = [0.0]
    fake.clock = lambda: clock[0]
    os.environ["ANTHROPIC_BASE_URL"] = fake.base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    return fake, clock


def defaults_main(interval_minutes: float) -> None:
    import json
    from datetime import timedelta

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db.models import Sum
    from django.utils import timezone

    from costs_app.models import CostEvent, CostKind
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun, RunTrigger, SessionCompaction
    from sessions_app.pins import pin_create
    from sessions_app.run_queue import heartbeat_enqueue

    fake, clock = summarising_fake_on_a_clock()
    company = Company.objects.create(name=f"bench defaults {timezone.now():%H%M%S}")
    start = timezone.now()
    kinds = [CostKind.MESSAGE, CostKind.COMPACTION]
    results = {}
    for label, mode, pinned, extra in [
        ("stateless", "stateless", False, {}),
        # The alternative at its best is whichever stateless configuration is cheaper.
        ("stateless, no caching", "stateless", False, {"prompt_caching": False}),
        ("persistent", "persistent", False, {}),
        ("persistent + 20 pins", "persistent", True, {}),
        # The defaults before issue 15: half the window, four turns kept, the 5-minute cache,
        # summaries by the agent's model (its last replayed turn was marked, not the request's end).
        ("persistent, old defaults", "persistent", False, OLD_DEFAULTS),
    ]:
        agent = Agent.objects.create(
            company=company,
            name=label,
            system_prompt=DEFAULTS_PROMPT,
            adapter_config={"model": DEFAULTS_MODEL, "session_mode": mode, **extra},
        )
        fake.cache.clear()  # the agents share their prompt and tasks: each starts with a cold cache
        if pinned:
            for fact in FACTS:
                pin_create(agent=agent, text=fact)
        for i in range(1, HEARTBEATS + 1):
            now = start + timedelta(minutes=interval_minutes * i)
            clock[0] = (now - start).total_seconds()
            run, _ = heartbeat_enqueue(agent=agent, task=defaults_task(i), now=now)
            run = heartbeat_execute(run_id=run.id, now=now)
            assert run.status == "succeeded", (label, i, run.error_code, run.error)
            between_heartbeats(now=now + timedelta(seconds=10))
        last = fake.message_requests[-1]
        heartbeats = HeartbeatRun.objects.filter(agent=agent).exclude(trigger=RunTrigger.COMPACTION)
        events = CostEvent.objects.filter(agent_id=agent.id, kind__in=kinds)
        total = events.aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)
        # From heartbeat 101 on, with the summaries made between heartbeats (their own runs).
        steady_from = heartbeats.order_by("started_at")[100].started_at
        steady_events = events.filter(run__started_at__gte=steady_from)
        steady = steady_events.aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)
        inputs = [
            r.input_tokens + r.cache_creation_input_tokens + r.cache_read_input_tokens
            for r in heartbeats.order_by("created_at")
        ]
        compactions = SessionCompaction.objects.filter(session__agent=agent)
        parts = steady_parts(steady_events, HEARTBEATS - 100)
        results[label] = {
            "total": total,
            "steady": steady,
            "facts": sum(1 for fact in FACTS if fact in json.dumps(last["messages"], ensure_ascii=False)),
            "max_input": max(inputs),
            "last_input": inputs[-1],
            "compactions": compactions.count(),
            "retries": compactions.filter(summary_attempts=2).count(),
            "sessions": AgentSession.objects.filter(agent=agent).count(),
            "parts": parts,
            "ttl": "1h" if "'ttl': '1h'" in str(last) else ("5m" if "cache_control" in str(last) else "none"),
        }
    fake.stop()
    best = min(("stateless", "stateless, no caching"), key=lambda label: results[label]["steady"])
    base = results[best]
    print(
        f"defaults: {HEARTBEATS} heartbeats {interval_minutes:g} min apart, {DEFAULTS_MODEL} list prices, "
        f"{len(DEFAULTS_PROMPT)}-char system prompt, ~800-char tasks, ~1,200-char answers, no context settings; "
        f"baseline: {best} (the cheaper stateless configuration)"
    )
    for label, r in results.items():
        print(
            f"{label:24s} total ${r['total']:.4f} = {r['total'] / base['total']:.2f}x; heartbeats 101-{HEARTBEATS} "
            f"${r['steady']:.4f} = {r['steady'] / base['steady']:.2f}x best stateless; input/heartbeat max "
            f"{r['max_input']} last {r['last_input']}; {r['compactions']} compactions ({r['retries']} retried); "
            f"cache {r['ttl']}; facts in request {HEARTBEATS}: {r['facts']}/{len(FACTS)}"
        )
    print("per heartbeat in the steady state (heartbeats 101-300), in dollars:")
    for label, r in results.items():
        print(f"  {label:24s} " + ", ".join(f"{name} {value:.5f}" for name, value in r["parts"].items()))
    ratio = results["persistent"]["steady"] / base["steady"]
    print(f"steady-state persistent/best stateless: {ratio:.2f}x (goal <= 1.50)")
    print(
        f"facts planted in heartbeats 1-20 still in the request at {HEARTBEATS}: "
        f"{results['persistent + 20 pins']['facts']}/20 with pins (goal 20/20), "
        f"{results['persistent']['facts']}/20 without"
    )


def batch_main(interval_minutes: float) -> None:
    """The same persistent agent at defaults, its scheduled heartbeats delivered direct and
    by batch (`delivery: "batch"`, each answered by the fake's batch within the poll that
    follows the tick), on a simulated clock: what the ledger holds for each."""
    from datetime import timedelta

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db.models import Sum
    from django.utils import timezone

    from costs_app.models import CostEvent
    from sessions_app.batches import batches_poll
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, Company, HeartbeatRun, RunTrigger
    from sessions_app.run_queue import heartbeat_enqueue

    fake, clock = summarising_fake_on_a_clock()
    company = Company.objects.create(name=f"bench batch {timezone.now():%H%M%S}")
    start = timezone.now()
    totals = {}
    for delivery in ("direct", "batch"):
        agent = Agent.objects.create(
            company=company,
            name=delivery,
            system_prompt=DEFAULTS_PROMPT,
            adapter_config={"model": DEFAULTS_MODEL, "session_mode": "persistent", "delivery": delivery},
        )
        fake.cache.clear()
        for i in range(1, HEARTBEATS + 1):
            now = start + timedelta(minutes=interval_minutes * i)
            clock[0] = (now - start).total_seconds()
            run, _ = heartbeat_enqueue(agent=agent, task=defaults_task(i), now=now, trigger=RunTrigger.SCHEDULE)
            run = heartbeat_execute(run_id=run.id, now=now)
            if run.status == "submitted":
                batches_poll(now=now)
                run.refresh_from_db()
            assert run.status == "succeeded", (delivery, i, run.status, run.error_code, run.error)
            between_heartbeats(now=now + timedelta(seconds=10))
        events = CostEvent.objects.filter(agent_id=agent.id)
        totals[delivery] = (
            events.aggregate(total=Sum("cost_usd"))["total"],
            dict(events.values_list("delivery").annotate(n=Sum("cost_usd")).values_list("delivery", "n")),
            HeartbeatRun.objects.filter(agent=agent, batch_id__gt="").count(),
        )
    fake.stop()
    print(
        f"batch: {HEARTBEATS} scheduled heartbeats {interval_minutes:g} min apart, one persistent agent at "
        f"defaults, {DEFAULTS_MODEL} list prices"
    )
    for delivery, (total, by_delivery, batched) in totals.items():
        parts = ", ".join(f"{name} ${value:.4f}" for name, value in sorted(by_delivery.items()))
        print(f"  delivery {delivery:6s} ledger ${total:.4f} ({parts}); runs answered by a batch: {batched}")
    ratio = totals["batch"][0] / totals["direct"][0]
    print(f"batch/direct: {ratio:.3f}x (goal <= 0.55)")


def keepwarm_main(interval_minutes: float) -> None:
    """Scheduled agents at defaults MINUTES apart on a simulated clock, with a maintenance
    pass every simulated minute between wakes (which queues the cache refreshes due, sent
    at once): stateless, persistent with keep-warm off, and persistent with keep-warm (the
    default). What each costs in the steady state, against stateless."""
    from datetime import timedelta

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db.models import Count, Sum
    from django.utils import timezone
    from django_q.models import Schedule

    from costs_app.models import CostEvent, CostKind
    from sessions_app.cache_refresh import cache_refreshes_queue
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, Company, HeartbeatRun, RunTrigger
    from sessions_app.run_queue import heartbeat_enqueue
    from sessions_app.schedules import agent_schedule_sync, schedule_name

    fake, clock = summarising_fake_on_a_clock()
    company = Company.objects.create(name=f"bench keep-warm {timezone.now():%H%M%S}")
    start = timezone.now()
    step = timedelta(minutes=interval_minutes)
    results = {}
    for label, mode, extra in [
        ("stateless", "stateless", {}),
        ("persistent, keep-warm off", "persistent", {"cache_keep_warm": "off"}),
        ("persistent, keep-warm", "persistent", {}),
    ]:
        config = {"model": DEFAULTS_MODEL, "session_mode": mode, "heartbeat_interval_minutes": int(interval_minutes)}
        agent = Agent.objects.create(
            company=company, name=label, system_prompt=DEFAULTS_PROMPT, adapter_config={**config, **extra}
        )
        agent_schedule_sync(agent=agent, now=start)
        fake.cache.clear()
        for i in range(1, HEARTBEATS + 1):
            now = start + step * i
            # As the scheduler leaves it when it fires: armed for the wake after this one.
            Schedule.objects.filter(name=schedule_name(agent.pk)).update(next_run=now + step)
            clock[0] = (now - start).total_seconds()
            run, _ = heartbeat_enqueue(agent=agent, task=defaults_task(i), now=now, trigger=RunTrigger.SCHEDULE)
            run = heartbeat_execute(run_id=run.id, now=now)
            assert run.status == "succeeded", (label, i, run.error_code, run.error)
            between_heartbeats(now=now + timedelta(seconds=10))
            for minute in range(1, int(interval_minutes)):
                at = now + timedelta(minutes=minute)
                if cache_refreshes_queue(now=at):
                    clock[0] = (at - start).total_seconds()
                    between_heartbeats(now=at)
        wakes = HeartbeatRun.objects.filter(agent=agent, trigger=RunTrigger.SCHEDULE).order_by("started_at")
        steady_from = wakes[100].started_at
        events = CostEvent.objects.filter(agent_id=agent.id)
        steady = events.filter(created_at__gte=steady_from)
        refreshes = steady.filter(kind=CostKind.CACHE_REFRESH).aggregate(n=Count("id"), usd=Sum("cost_usd"))
        last = fake.message_requests[-1]
        results[label] = {
            "total": events.aggregate(total=Sum("cost_usd"))["total"],
            "steady": steady.aggregate(total=Sum("cost_usd"))["total"],
            "refreshes": refreshes["n"],
            "refreshes_usd": refreshes["usd"] or Decimal(0),
            "ttl": "1h" if "'ttl': '1h'" in str(last) else ("5m" if "cache_control" in str(last) else "none"),
        }
    fake.stop()
    base = results["stateless"]["steady"]
    print(
        f"keep-warm: {HEARTBEATS} scheduled heartbeats {interval_minutes:g} min apart, {DEFAULTS_MODEL} list prices, "
        f"workload of `defaults`; a maintenance pass every simulated minute"
    )
    for label, r in results.items():
        print(
            f"  {label:26s} total ${r['total']:.4f}; heartbeats 101-{HEARTBEATS} ${r['steady']:.4f} = "
            f"{r['steady'] / base:.2f}x stateless; cache {r['ttl']}; refreshes {r['refreshes']} "
            f"(${r['refreshes_usd']:.4f})"
        )
    warm, cold = results["persistent, keep-warm"]["steady"], results["persistent, keep-warm off"]["steady"]
    print(f"persistent with keep-warm / stateless: {warm / base:.2f}x; keep-warm on / off: {warm / cold:.3f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["keepwarm"]:
        for minutes in sys.argv[2:] or ["30", "120"]:
            keepwarm_main(float(minutes))
    elif sys.argv[1:2] == ["batch"]:
        for minutes in sys.argv[2:] or ["30"]:
            batch_main(float(minutes))
    elif sys.argv[1:2] == ["defaults"]:
        for minutes in sys.argv[2:] or ["2", "30"]:
            defaults_main(float(minutes))
    else:
        main()
