"""`manage.py cost_report [--agent ID] [--days N]`: tokens and cost per UTC day."""

from __future__ import annotations

from uuid import UUID

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from costs_app.money import usd
from costs_app.reports import daily_costs, input_growth
from sessions_app.context_defaults import growth_advice, growth_flag
from sessions_app.models import Agent, Company

ROW = "{day:<12}{input:>14}{output:>14}{cache_write:>14}{cache_read:>14}{cost:>18}"


class Command(BaseCommand):
    help = "Print tokens and cost per UTC day, for one agent or for every company."

    def add_arguments(self, parser):
        parser.add_argument("--agent", help="Only this agent (UUID); also prints its input growth.")
        parser.add_argument("--days", type=int, default=30, help="Days back, today included (1..366).")

    def handle(self, *args, agent: str | None, days: int, **options):
        if not 1 <= days <= 366:
            raise CommandError(f"--days must be from 1 to 366, got {days}.")
        now = timezone.now()
        if agent is not None:
            try:
                agent_id = UUID(agent)
            except ValueError:
                raise CommandError(f"--agent must be an agent id (UUID), got {agent!r}.") from None
            found = Agent.objects.filter(pk=agent_id).select_related("company").first()
            if found is None:
                raise CommandError(f"No agent with id {agent_id}.")
            self.report(title=f"{found.company.name} / {found.name} ({found.id})", rows=self.rows(found, now, days))
            self.growth(found)
            return
        for company in Company.objects.all():
            self.report(
                title=f"{company.name} ({company.id})",
                rows=daily_costs(company_id=company.id, now=now, days=days),
            )

    def rows(self, agent: Agent, now, days: int) -> list[dict]:
        return daily_costs(company_id=agent.company_id, agent_id=agent.id, now=now, days=days)

    def report(self, *, title: str, rows: list[dict]) -> None:
        self.stdout.write(title)
        self.stdout.write(
            ROW.format(
                day="day (UTC)",
                input="input",
                output="output",
                cache_write="cache write",
                cache_read="cache read",
                cost="cost (USD)",
            )
        )
        for row in rows:
            self.stdout.write(
                ROW.format(
                    day=row["day"].isoformat(),
                    input=row["input_tokens"],
                    output=row["output_tokens"],
                    cache_write=row["cache_creation_input_tokens"],
                    cache_read=row["cache_read_input_tokens"],
                    cost=usd(row["cost_usd"]),
                )
            )
        if not rows:
            self.stdout.write("  no spend in this window")
        self.stdout.write("")

    def growth(self, agent: Agent) -> None:
        growth = input_growth(agent_id=agent.id)
        self.stdout.write(
            f"Input growth over the last {growth.runs} runs: {growth.slope_tokens_per_run:+.1f} tokens/run "
            f"({growth.first_input_tokens} -> {growth.last_input_tokens})"
        )
        if growth_flag(agent, growth):
            self.stdout.write(self.style.WARNING(f"Input grows run after run. {growth_advice(agent, growth)}"))
