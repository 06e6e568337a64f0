"""Budget alerts: webhooks told once per period when a limit crosses a threshold.

1. `budget_alerts_fire` runs after each budgeted heartbeat (with the uses it read) and when
   a call is refused by a limit (`refused`). Each threshold a limit has reached (soft:
   the budget's warn_percent; second: its alert_percent; hard: the limit spent, or a call
   refused by it) without an alert row in this period gets one. The unique constraint on
   (budget, period, period key, threshold) decides between two workers crossing at once:
   one insert wins, and only the winner creates a delivery per active target and hands
   them to the task queue when its transaction commits.
2. `alert_deliver` (the django-q2 task) claims a delivery's next attempt with a
   conditional update, POSTs the signed JSON outside any transaction, records the attempt
   and either finishes the delivery or sets its next attempt with back-off; after
   PAPERCLIP_ALERT_MAX_ATTEMPTS it is recorded failed.
3. `alert_deliveries_retry` (a maintenance step, every minute) hands due deliveries back
   to the queue: retries after their back-off, and any whose task was lost.

Nothing here raises into a heartbeat: an alert that cannot be recorded or queued is
logged (and, queued late, sent by the sweep); a target that fails only fails its delivery.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import time
import urllib.request
from collections import defaultdict
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q

from costs_app.models import (
    AlertAttempt,
    AlertDelivery,
    AlertEvent,
    AlertEventKind,
    AlertTarget,
    AlertThreshold,
    BudgetAlert,
    DeliveryStatus,
)
from costs_app.money import amount_text
from paperclip.hosts import bounded_request, unlisted_host_problem
from sessions_app.text import storable

if TYPE_CHECKING:
    from costs_app.budgets import BudgetUse

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Paperclip-Signature"
TIMESTAMP_HEADER = "X-Paperclip-Timestamp"
DELIVERY_HEADER = "X-Paperclip-Delivery"
MAX_ERROR_CHARS = 1000


def period_key(period: str, now: datetime) -> str:
    """Which period an alert fires in: the UTC day, the UTC month, or all time."""
    utc = now.astimezone(UTC)
    if period in ("day", "day_runs"):
        return utc.strftime("%Y-%m-%d")
    if period == "month":
        return utc.strftime("%Y-%m")
    return "lifetime"


def thresholds_reached(use: BudgetUse, *, refused: bool = False) -> dict[str, int]:
    """The thresholds a limit's spend has reached, with their percentages."""
    reached = {}
    if refused or use.exceeded:
        reached[AlertThreshold.HARD] = 100
    if use.spent_percent >= use.alert_percent:
        reached[AlertThreshold.SECOND] = use.alert_percent
    if use.spent_percent >= use.warn_percent:
        reached[AlertThreshold.SOFT] = use.warn_percent
    return reached


def budget_alerts_fire(*, uses: list[BudgetUse], now: datetime, refused: bool = False) -> int:
    """Record the alerts `uses` call for and queue their deliveries; how many were new.

    Never raises: the heartbeat that calls this has already spent its money, and an alert
    is worth less than the run. One query when nothing new is reached."""
    try:
        # Inside a caller's transaction a failure needs a savepoint to leave it usable.
        with transaction.atomic() if connection.in_atomic_block else nullcontext():
            return _fire(uses=[use for use in uses if use.budget_id is not None], now=now, refused=refused)
    except Exception:
        logger.exception("Could not record budget alerts")
        return 0


def _fire(*, uses: list[BudgetUse], now: datetime, refused: bool) -> int:
    # An alert is once per period for the limit and percent it was set at: an operator who
    # raises a limit (or moves a threshold) is told again when the new one is approached.
    due = {
        (use.budget_id, use.period, period_key(use.period, now), threshold, use.limit, percent): (use, percent)
        for use in uses
        for threshold, percent in thresholds_reached(use, refused=refused).items()
    }
    if not due:
        return 0
    # Read once: after the first crossing every later heartbeat of the period stops here.
    fired = BudgetAlert.objects.filter(
        budget_id__in={key[0] for key in due}, period_key__in={key[2] for key in due}
    ).values_list("budget_id", "period", "period_key", "threshold", "limit", "percent")
    for key in fired:
        due.pop(key, None)
    if not due:
        return 0
    targets = defaultdict(list)
    for target in AlertTarget.objects.filter(budget_id__in={key[0] for key in due}, active=True).only(
        "id", "budget_id"
    ):
        targets[target.budget_id].append(target.id)
    created = 0
    for (budget_id, _, key, threshold, _, _), (use, percent) in due.items():
        created += _alert_insert(
            use=use, period_key=key, threshold=threshold, percent=percent, target_ids=targets[budget_id], now=now
        )
    return created


def _alert_insert(
    *, use: BudgetUse, period_key: str, threshold: str, percent: int, target_ids: list, now: datetime
) -> int:
    """Insert one alert and its deliveries; 0 when another worker's insert won."""
    try:
        with transaction.atomic():
            alert = BudgetAlert.objects.create(
                budget_id=use.budget_id,
                period=use.period,
                period_key=period_key,
                threshold=threshold,
                percent=percent,
                limit=use.limit,
                spent=use.spent,
                created_at=now,
            )
            deliveries = AlertDelivery.objects.bulk_create(
                [
                    AlertDelivery(alert=alert, target_id=target_id, created_at=now, next_attempt_at=now)
                    for target_id in target_ids
                ]
            )
            ids = [delivery.id for delivery in deliveries]
            transaction.on_commit(lambda: alert_deliveries_enqueue(ids))
    except IntegrityError:
        return 0  # fired already, by a worker that crossed it at the same moment
    return 1


def alert_event_fire(*, kind: str, key: str, payload: dict, now: datetime, company_id=None, agent_id=None) -> int:
    """Record an operations event (`AlertEvent`) and queue its deliveries to the active
    targets that asked for its kind: those of the company's budget and the agent's for an
    agent's health, every one for a quota. `key` names the transition: of two workers
    recording it, the unique key lets one in, and only that one queues deliveries.
    Returns 1 when this call recorded it. Never raises, as `budget_alerts_fire`."""
    try:
        with transaction.atomic():
            event = AlertEvent.objects.create(
                kind=kind, key=key[:200], company_id=company_id, agent_id=agent_id, payload=payload, created_at=now
            )
            targets = AlertTarget.objects.filter(active=True)
            if kind in (AlertEventKind.QUOTA_HELD, AlertEventKind.QUOTA_RELEASED):
                targets = targets.filter(quota_events=True)
            else:
                targets = targets.filter(health_events=True, budget__company_id=company_id).filter(
                    Q(budget__agent__isnull=True) | Q(budget__agent_id=agent_id)
                )
            deliveries = AlertDelivery.objects.bulk_create(
                [
                    AlertDelivery(event=event, target_id=target_id, created_at=now, next_attempt_at=now)
                    for target_id in targets.values_list("id", flat=True)
                ]
            )
            ids = [delivery.id for delivery in deliveries]
            transaction.on_commit(lambda: alert_deliveries_enqueue(ids))
    except IntegrityError:
        return 0  # recorded already, by the worker that saw the same transition
    except Exception:
        logger.exception("Could not record the %s event", kind)
        return 0
    return 1


def alert_deliveries_enqueue(delivery_ids: list) -> None:
    """Hand deliveries to the task queue. A broker that refuses is logged: the deliveries
    stay pending and the maintenance sweep queues them again."""
    from django_q.tasks import async_task

    for delivery_id in delivery_ids:
        try:
            async_task("costs_app.tasks.alert_deliver", delivery_id, task_name=f"alert delivery {delivery_id}")
        except Exception:
            logger.exception("Could not queue alert delivery %s; the maintenance sweep will", delivery_id)


def alert_deliveries_retry(*, now: datetime) -> int:
    """Queue every pending delivery whose next attempt is due (reads alert_deliveries_due_idx)."""
    due = list(
        AlertDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")
        .values_list("id", flat=True)[:500]
    )
    alert_deliveries_enqueue(due)
    return len(due)


def retry_delay(attempt: int) -> timedelta:
    """The wait after failed attempt `attempt` (1, 2, ...): x4 each time."""
    return timedelta(seconds=settings.PAPERCLIP_ALERT_RETRY_SECONDS * 4 ** (attempt - 1))


def alert_payload(delivery: AlertDelivery) -> dict:
    if delivery.event is not None:
        event = delivery.event
        return {
            "type": event.kind,
            "delivery_id": delivery.id,
            "event_id": event.id,
            "company_id": str(event.company_id) if event.company_id else None,
            "agent_id": str(event.agent_id) if event.agent_id else None,
            **event.payload,
            "fired_at": event.created_at.isoformat(),
        }
    alert, budget = delivery.alert, delivery.alert.budget
    return {
        "type": "budget.threshold",
        "delivery_id": delivery.id,
        "alert_id": alert.id,
        "company_id": str(budget.company_id),
        "agent_id": str(budget.agent_id) if budget.agent_id else None,
        "scope": "agent" if budget.agent_id else "company",
        "period": alert.period,
        "period_key": alert.period_key,
        "threshold": alert.threshold,
        "percent": alert.percent,
        # Money by the one rule; the daily run cap's figures are whole runs.
        "limit": amount_text(alert.limit, count=alert.period == "day_runs"),
        "spent": amount_text(alert.spent, count=alert.period == "day_runs"),
        "fired_at": alert.created_at.isoformat(),
    }


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """HMAC-SHA256 of "<timestamp>.<body>" with the target's secret, as `sha256=<hex>`:
    the timestamp is signed too, so a captured delivery cannot be replayed later."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def alert_deliver(*, delivery_id, now: datetime) -> str:
    """One attempt of a delivery, if it is pending and due; returns its status after it."""
    delivery = (
        AlertDelivery.objects.select_related("alert__budget", "event", "target")
        .filter(pk=delivery_id, status=DeliveryStatus.PENDING)
        .first()
    )
    if delivery is None:
        return "not pending"
    if delivery.next_attempt_at is not None and delivery.next_attempt_at > now:
        return "not due"
    number = delivery.attempts + 1
    # The claim: of two tasks for one delivery (a sweep and a late first task), one sends.
    lease = now + timedelta(seconds=settings.PAPERCLIP_ALERT_TIMEOUT_SECONDS + 60)
    claimed = AlertDelivery.objects.filter(
        pk=delivery.pk, status=DeliveryStatus.PENDING, attempts=delivery.attempts
    ).update(attempts=number, next_attempt_at=lease)
    if not claimed:
        return "taken"
    status_code, error, duration_ms = _post(delivery, now=now)
    return _attempt_record(
        delivery, number=number, status_code=status_code, error=error, duration_ms=duration_ms, now=now
    )


def _post(delivery: AlertDelivery, *, now: datetime) -> tuple[int | None, str, int]:
    """POST the alert; (status code, error, milliseconds). Outside any transaction."""
    body = json.dumps(alert_payload(delivery), separators=(",", ":")).encode()
    timestamp = int(now.timestamp())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "paperclip-alerts/1",
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(delivery.target.secret, timestamp, body),
        DELIVERY_HEADER: str(delivery.id),
    }
    started = time.monotonic()
    if problem := target_url_problem(delivery.target.url):
        # Validated on the way in; a row written past validation (or before the host list
        # changed) must not open file: URLs or hosts the operator did not list.
        return None, problem, 0
    request = urllib.request.Request(delivery.target.url, data=body, headers=headers, method="POST")  # noqa: S310 (checked above)
    try:
        # The timeout bounds the whole request (a target trickling its answer included);
        # a redirect is an answer, never followed: it would send the signed alert wherever
        # the target points (an internal address, say).
        code, _ = bounded_request(request, timeout=settings.PAPERCLIP_ALERT_TIMEOUT_SECONDS, proxies=True)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # Connection refused, timeouts, TLS errors, a malformed answer. The URL may carry
        # a token in its query: the error names the failure, never the URL.
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            exc = reason
        return None, f"{type(exc).__name__}: {reason}", _elapsed_ms(started)
    error = "" if 200 <= code < 300 else f"HTTP {code}"
    return code, error, _elapsed_ms(started)


def target_url_problem(url: str) -> str | None:
    """Why an alert target's URL may not be delivered to here, or None: an http(s) URL
    whose host, in authenticated mode, is one of PAPERCLIP_ALERT_HOSTS."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return "The URL is not valid."
    if parts.scheme.lower() not in ("http", "https"):
        return "Only http and https URLs are delivered."
    if parts.username is not None or parts.password is not None:
        # The URL is shown with the targets and their deliveries, the secret never is.
        return "The URL must not carry credentials (user:password@); the target's secret signs each delivery."
    return unlisted_host_problem(parts, setting="PAPERCLIP_ALERT_HOSTS", mode=settings.PAPERCLIP_DEPLOYMENT_MODE)


def _elapsed_ms(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


def _attempt_record(
    delivery: AlertDelivery, *, number: int, status_code: int | None, error: str, duration_ms: int, now: datetime
) -> str:
    error = storable(error[:MAX_ERROR_CHARS])
    fields = {"last_status_code": status_code, "last_error": error}
    if not error:
        fields |= {"status": DeliveryStatus.DELIVERED, "next_attempt_at": None, "finished_at": now}
    elif number >= settings.PAPERCLIP_ALERT_MAX_ATTEMPTS:
        fields |= {"status": DeliveryStatus.FAILED, "next_attempt_at": None, "finished_at": now}
    else:
        fields |= {"next_attempt_at": now + retry_delay(number)}
    with transaction.atomic():
        AlertAttempt.objects.create(
            delivery_id=delivery.id,
            number=number,
            at=now,
            status_code=status_code,
            error=error,
            duration_ms=duration_ms,
        )
        AlertDelivery.objects.filter(pk=delivery.pk, status=DeliveryStatus.PENDING, attempts=number).update(**fields)
    return fields.get("status", DeliveryStatus.PENDING)
