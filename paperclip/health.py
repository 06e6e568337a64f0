"""`GET /api/health`: is the database reachable, is a task cluster alive, is work stuck.

503 when the database is unreachable or no task cluster has been seen: without a cluster,
queued heartbeats would wait for ever. The stuck-work figures are for the operator's eye
and alerts; they never fail the probe themselves.
"""

from __future__ import annotations

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Min
from django.http import JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from sessions_app.api.exceptions import error_body
from sessions_app.managed_sessions import managed_state
from sessions_app.models import HeartbeatRun, RunStatus
from sessions_app.quota import hold_json, holds_now


def queue_state() -> dict:
    """The clusters seen: each qcluster's sentinel saves its statistics every half second with
    a three-second expiry, in the cache (ORM broker) or in Redis, so a cluster is listed only
    while it is alive. The web process reads the same store (settings.CACHES)."""
    from django_q.conf import Conf
    from django_q.status import Stat

    broker = "redis" if settings.REDIS_URL else "orm"
    try:
        clusters = len(Stat.get_all())
    except Exception as exc:  # the broker is a dependency; report it, never fail the probe on it
        return {"broker": broker, "ok": False, "clusters": 0, "error": exc.__class__.__name__}
    return {"broker": broker, "ok": clusters > 0, "clusters": clusters, "cluster_name": Conf.PREFIX}


def run_state(*, now) -> dict:
    """The age of the oldest queued run, and the runs still `running` past their deadline
    (their worker died; the maintenance pass reaps them). Both read partial indexes that hold
    only unfinished runs (runs_unfinished_idx, runs_one_running_per_agent)."""
    oldest = HeartbeatRun.objects.filter(status=RunStatus.QUEUED).aggregate(oldest=Min("created_at"))["oldest"]
    past_deadline = HeartbeatRun.objects.filter(status=RunStatus.RUNNING, deadline_at__lt=now).count()
    return {
        "oldest_queued_seconds": round((now - oldest).total_seconds(), 1) if oldest else None,
        "past_deadline": past_deadline,
    }


# Exempt so that a method other than GET meets the JSON 405 below: Django's CSRF check would
# answer it first, with its HTML 403 page. The probe reads nothing from the request.
@csrf_exempt
def health(request):
    if request.method not in ("GET", "HEAD"):
        response = JsonResponse(
            error_body("method_not_allowed", f'Method "{request.method}" not allowed; use GET.'), status=405
        )
        response["Allow"] = "GET, HEAD"
        return response
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        runs = run_state(now=timezone.now())
        held = [hold_json(hold) for hold in holds_now()]
        managed = managed_state()
    except DatabaseError as exc:
        return JsonResponse(
            {"status": "unavailable", "database": {"ok": False, "error": exc.__class__.__name__}},
            status=503,
        )
    queue = queue_state()
    return JsonResponse(
        {
            "status": "ok" if queue["ok"] else "unavailable",
            "database": {"ok": True, "vendor": connection.vendor},
            "queue": queue,
            "runs": runs,
            # Provider credentials held by a quota: their runs wait queued until the reset.
            "credentials_held": held,
            # Managed Agents sessions: ends the provider has not confirmed yet (retried by
            # the maintenance pass), and those it refused at least once.
            "managed_sessions": managed,
            "session_store": settings.PAPERCLIP_SESSION_STORE,
            "deployment_mode": settings.PAPERCLIP_DEPLOYMENT_MODE,
        },
        status=200 if queue["ok"] else 503,
    )
