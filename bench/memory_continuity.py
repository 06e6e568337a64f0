"""Continuity and cost over 300 heartbeats: memory against sessions.

The economics workload of bench/context_growth.py (a ~1,500-token system prompt, short
release-queue tasks, ~100-token answers, claude-sonnet-4-5 list prices, prompt caching as
configured by default) with 20 facts planted in the first 20 tasks ("Remember: ...") and
asked for in the last one ("Recall ..."). The fake Messages API scripts the memory tool:
a task saying "remember" is answered with a `create` of a memory file, "recall" with a
`view` of the folder and then of each file (tests/fake_anthropic.py), so the engine's tool
loop runs for real through the SDK.

Set-ups, each with the same 300 tasks:
- stateless (the baseline: no history, no memory);
- stateless + memory (`memory: true`);
- stateless + memory, viewed always: the same, the model viewing its memory at the start of
  every task (as the memory tool's own instructions ask a real model to), the worst case;
- persistent with the defaults (summarize at half the context window, prompt caching);
- persistent, no compaction (`context_strategy: none`).

A fact is retained when it is in a request the agent sent while answering the recall task.

    .venv/bin/python bench/memory_continuity.py          # SQLite in a temporary folder
    BENCH_HEARTBEATS=60 .venv/bin/python bench/memory_continuity.py
"""

from __future__ import annotations

import hashlib
import json
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
FACTS = 20
SYSTEM_PROMPT = "You are the release engineer of a mid-sized software company. " + " ".join(
    f"Rule {i}: keep change {i} reviewed, tested, documented and reversible before it ships." for i in range(80)
)
SETUPS = {
    "stateless": {"session_mode": "stateless"},
    "stateless + memory": {"session_mode": "stateless", "memory": True},
    "stateless + memory, viewed always": {"session_mode": "stateless", "memory": True},
    "persistent, defaults": {"session_mode": "persistent"},
    "persistent, no compaction": {"session_mode": "persistent", "context_strategy": "none"},
}


def fact_code(k: int) -> str:
    return f"VAULT-{k:02d}-{hashlib.sha256(str(k).encode()).hexdigest()[:6].upper()}"


def tasks() -> list[str]:
    planted = [
        f"Heartbeat {i}: check the release queue and report. Remember: the access code of vault {i} is {fact_code(i)}."
        for i in range(FACTS)
    ]
    routine = [
        f"Heartbeat {i}: check the release queue, merge change {i} if its checks pass, and report."
        for i in range(FACTS, HEARTBEATS - 1)
    ]
    return [*planted, *routine, f"Heartbeat {HEARTBEATS - 1}: recall the access codes of every vault."]


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
    results = {}
    for label, config in SETUPS.items():
        agent = Agent.objects.create(
            company=company,
            name=label,
            system_prompt=SYSTEM_PROMPT,
            adapter_config={"model": "claude-sonnet-4-5", "max_tokens": 1024, **config},
        )
        fake.memory_view_always = label.endswith("viewed always")
        retained = 0
        for index, task in enumerate(tasks()):
            before = len(fake.message_requests)
            run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
            run = heartbeat_execute(run_id=run.id)
            assert run.status == "succeeded", (label, index, run.error_code, run.error)
            if index == HEARTBEATS - 1:
                sent = json.dumps(fake.message_requests[before:])
                retained = sum(fact_code(k) in sent for k in range(FACTS))
        runs = HeartbeatRun.objects.filter(agent=agent)
        cost = CostEvent.objects.filter(agent_id=agent.id).aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)
        calls = CostEvent.objects.filter(agent_id=agent.id).count()
        results[label] = (cost, calls, runs.count(), retained)
    fake.stop()

    baseline = results["stateless"][0]
    print(f"{HEARTBEATS} heartbeats per set-up, {FACTS} facts planted in the first {FACTS}, asked in the last")
    print(f"{'set-up':34s} {'cost/heartbeat':>15s} {'x stateless':>11s} {'calls':>6s} {'facts retained':>15s}")
    for label, (cost, calls, runs, retained) in results.items():
        print(f"{label:34s} ${cost / runs:>14.6f} {cost / baseline:>10.2f}x {calls:>6d} {retained:>8d} of {FACTS}")
    ratio = results["stateless + memory"][0] / baseline
    kept = results["stateless + memory"][3]
    print(f"stateless + memory: {kept}/{FACTS} facts at {ratio:.2f}x stateless (goal: {FACTS}/{FACTS} at <= 1.30x)")


if __name__ == "__main__":
    main()
