"""`manage.py expire_sessions`: the maintenance pass by hand (sessions past their TTL ended, stuck
runs reaped, old histories purged, files no row names removed, ...)."""

from __future__ import annotations

from django.core.management.base import BaseCommand
from django.utils import timezone

from sessions_app.maintenance import maintenance_pass


class Command(BaseCommand):
    help = "Expire sessions past expires_at, fail runs stuck past their deadline, purge old histories."

    def handle(self, *args, **options):
        result = maintenance_pass(now=timezone.now())
        self.stdout.write(
            f"expired {result['expired']} session(s); reaped runs of {result['reaped_agents']} agent(s); "
            f"purged {result['purged']} history(ies); removed {result['orphan_files']} file(s) no row named; "
            f"re-dispatched {result['unstuck']} queue(s)"
        )
        failed = [name for name, value in result.items() if value is None]
        if failed:
            self.stderr.write(f"failed steps (see the log): {', '.join(failed)}")
