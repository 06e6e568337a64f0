"""django-q2 task entry points of costs_app: thin, they take ids and call the domain functions."""

from __future__ import annotations

from django.utils import timezone

from costs_app.alerts import alert_deliver as deliver


def alert_deliver(delivery_id: int) -> str:
    return deliver(delivery_id=delivery_id, now=timezone.now())
