"""`manage.py heartbeat AGENT_ID --task "..."`: one run, inline; prints output and usage."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from costs_app.money import usd
from sessions_app.errors import HeartbeatRefused
from sessions_app.heartbeat import heartbeat_start, heartbeat_wait
from sessions_app.models import Agent, AgentStatus, RunStatus, RunTrigger, parse_uuid


class Command(BaseCommand):
    help = "Run one heartbeat of an agent now and print the answer and its usage."

    def add_arguments(self, parser):
        parser.add_argument("agent_id")
        parser.add_argument("--task", required=True)
        parser.add_argument("--idempotency-key", default=None)
        parser.add_argument("--force-fresh", action="store_true", help="Start a new session.")
        parser.add_argument("--json", action="store_true", help="Print the run as JSON.")

    def handle(self, *args, agent_id: str, task: str, idempotency_key, force_fresh: bool, **options):
        agent_uuid = parse_uuid(agent_id)
        agent = Agent.objects.filter(id=agent_uuid).exclude(status=AgentStatus.DELETED).first() if agent_uuid else None
        if agent is None:
            raise CommandError(f"No agent with id {agent_id!r}.")
        try:
            run, created = heartbeat_start(
                agent=agent,
                task=task,
                trigger=RunTrigger.COMMAND,
                now=timezone.now(),
                wait=True,
                idempotency_key=idempotency_key,
                force_fresh=force_fresh,
            )
            if not created:
                # A repeated key names an earlier run: the command sees that run through.
                run = heartbeat_wait(run_id=run.id, timeout_seconds=settings.PAPERCLIP_RUN_TIMEOUT_SECONDS)
        except HeartbeatRefused as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        usage = {
            "input_tokens": run.input_tokens,
            "output_tokens": run.output_tokens,
            "cache_creation_input_tokens": run.cache_creation_input_tokens,
            "cache_read_input_tokens": run.cache_read_input_tokens,
        }
        if options["json"]:
            self.stdout.write(self._as_json(run, usage))
        elif run.status == RunStatus.SUCCEEDED:
            self.stdout.write(run.output)
            self.stdout.write("")
            self.stdout.write(
                f"run {run.id} succeeded; session {run.session.public_id if run.session else '-'}; "
                f"input {run.input_tokens}, output {run.output_tokens}, cache write "
                f"{run.cache_creation_input_tokens}, cache read {run.cache_read_input_tokens} tokens; "
                f"cost ${usd(run.cost_usd if run.cost_usd is not None else 0)}"
            )
        elif run.status == RunStatus.SKIPPED:
            self.stdout.write(f"run {run.id} skipped: the work check found no work (no model call).")
        if run.status not in (RunStatus.SUCCEEDED, RunStatus.SKIPPED):
            raise CommandError(f"run {run.id} {run.status}: {run.error_code or 'not finished'}: {run.error}")

    def _as_json(self, run, usage) -> str:
        return json.dumps(
            {
                "id": str(run.id),
                "status": run.status,
                "session_id": run.session.public_id if run.session else None,
                "output": run.output,
                "usage": usage,
                "cost_usd": usd(run.cost_usd) if run.cost_usd is not None else None,
                "error": run.error or None,
                "error_code": run.error_code or None,
            }
        )
