"""`GET /api/health`: is the database reachable, and is a task cluster alive."""

from __future__ import annotations

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import JsonResponse


def queue_state() -> dict:
    from django_q.conf import Conf
    from django_q.status import Stat

    broker = "redis" if settings.REDIS_URL else "orm"
    try:
        clusters = len(Stat.get_all())
    except Exception as exc:  # the broker is a dependency; report it, never fail the probe on it
        return {"broker": broker, "ok": False, "error": exc.__class__.__name__}
    return {"broker": broker, "ok": True, "clusters": clusters, "cluster_name": Conf.PREFIX}


def health(request):
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return JsonResponse(
            {"status": "unavailable", "database": {"ok": False, "error": exc.__class__.__name__}},
            status=503,
        )
    return JsonResponse(
        {
            "status": "ok",
            "database": {"ok": True, "vendor": connection.vendor},
            "queue": queue_state(),
            "session_store": settings.PAPERCLIP_SESSION_STORE,
            "deployment_mode": settings.PAPERCLIP_DEPLOYMENT_MODE,
        }
    )
