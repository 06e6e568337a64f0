"""Input tokens per heartbeat over 300 heartbeats, and what they cost, per context strategy.

Four runs with the same 300 tasks against the fake Messages API (which simulates prompt
caching and reports usage from the request size):
- persistent, context_strategy none (the whole history replayed every time);
- persistent, summarize (budgeted compaction), no prompt caching;
- persistent, summarize + prompt caching;
- stateless (no history, no caching): the baseline.

    .venv/bin/pip install -r bench/requirements.txt
    .venv/bin/python bench/context_growth.py            # SQLite in a temporary folder
    DATABASE_URL=postgres://... .venv/bin/python bench/context_growth.py

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
    from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_execute
    from sessions_app.models import Agent, Company, HeartbeatRun
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

    baseline = totals["stateless"]
    print(f"{HEARTBEATS} heartbeats per configuration; budget {BUDGET} tokens; model claude-sonnet-4-5 list prices")
    for label in configurations:
        tokens = series[label]
        print(
            f"{label:34s} input tokens/heartbeat first {tokens[0]:6d} max {max(tokens):6d} last {tokens[-1]:6d}; "
            f"total cost ${totals[label]:.4f} = {totals[label] / baseline:.2f}x stateless"
        )
    ratio = totals["persistent, summarize + caching"] / baseline
    print(f"summarize + caching vs stateless: {ratio:.2f}x (goal <= 1.50x)")
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


if __name__ == "__main__":
    main()
