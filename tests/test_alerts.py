"""Budget alerts (costs_app.alerts): signed webhooks on a real local HTTP server, once per
threshold per period (two workers crossing at once included), retried with back-off and
recorded failed, never failing the heartbeat that crossed the threshold."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from datetime import timedelta
from decimal import Decimal
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.utils import timezone

from costs_app import alerts, tasks
from costs_app.alerts import alert_deliver, alert_deliveries_retry, budget_alerts_fire
from costs_app.budgets import budget_uses
from costs_app.models import AlertDelivery, AlertTarget, Budget, BudgetAlert, CostEvent, DeliveryStatus
from sessions_app.models import HeartbeatRun, RunStatus
from tests.conftest import beat
from tests.webhook_receiver import TricklingServer, WebhookReceiver, refused_url

SECRET = "whsec-test-0123456789abcdef"


@pytest.fixture
def receiver():
    server = WebhookReceiver().start()
    yield server
    server.stop()


def queued_deliveries() -> list[int]:
    """Delivery ids handed to the task queue (the ORM broker), taken off it."""
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    ids = []
    for row in OrmQ.objects.order_by("id"):
        task = SignedPackage.loads(row.payload)
        if task["func"] == "costs_app.tasks.alert_deliver":
            ids.append(task["args"][0])
            row.delete()
    return ids


def run_queued() -> list[str]:
    """Run the queued delivery tasks, as a cluster worker would."""
    return [tasks.alert_deliver(delivery_id) for delivery_id in queued_deliveries()]


def spend(agent, usd: str) -> None:
    CostEvent.objects.create(company=agent.company, agent=agent, model="claude-opus-4-5", cost_usd=Decimal(usd))


def verified(received, secret: str = SECRET) -> dict:
    """The body of a delivery whose signature checks out, as the README tells receivers to check it."""
    timestamp = received.headers["x-paperclip-timestamp"]
    expected = hmac.new(secret.encode(), f"{timestamp}.".encode() + received.body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(received.headers["x-paperclip-signature"], f"sha256={expected}")
    assert abs(time.time() - int(timestamp)) < 300
    return received.json


def company_budget(company, url: str, **limits) -> Budget:
    budget = Budget.objects.create(company=company, **(limits or {"monthly_limit_usd": Decimal("10")}))
    AlertTarget.objects.create(budget=budget, url=url, secret=SECRET)
    return budget


@pytest.mark.django_db(transaction=True)
def test_a_webhook_receives_signed_deliveries_at_each_threshold_once_per_period(
    company, stateless_agent, fake_anthropic, receiver
):
    company_budget(company, receiver.url)  # $10 a month: soft at 80%, second at 95%
    spend(stateless_agent, "7.00")
    assert beat(stateless_agent).status == RunStatus.SUCCEEDED
    assert run_queued() == []  # 70%: nothing yet

    spend(stateless_agent, "1.00")
    beat(stateless_agent)
    assert run_queued() == ["delivered"]
    beat(stateless_agent)
    assert run_queued() == []  # the soft threshold fired already this month

    spend(stateless_agent, "1.50")
    beat(stateless_agent)
    assert run_queued() == ["delivered"]

    # Too little is left for the next call: it is refused, and spending stops there.
    spend(stateless_agent, "0.45")
    refused = beat(stateless_agent)
    assert (refused.status, refused.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert run_queued() == ["delivered"]
    beat(stateless_agent)
    assert run_queued() == []

    bodies = [verified(received) for received in receiver.requests]
    assert [(b["threshold"], b["percent"]) for b in bodies] == [("soft", 80), ("second", 95), ("hard", 100)]
    assert {(b["scope"], b["period"], b["period_key"], b["limit"]) for b in bodies} == {
        ("company", "month", f"{timezone.now():%Y-%m}", "10.00")
    }
    assert Decimal(bodies[0]["spent"]) >= Decimal("8")
    assert len({received.headers["x-paperclip-delivery"] for received in receiver.requests}) == 3
    assert BudgetAlert.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_two_workers_crossing_a_threshold_at_once_send_one_delivery(company, stateless_agent, receiver, monkeypatch):
    budget = company_budget(company, receiver.url)
    spend(stateless_agent, "8.50")
    now = timezone.now()
    uses = budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now)
    real_insert = alerts._alert_insert
    other = []

    def other_worker_first(**kwargs):
        # The worst moment: this worker has read that the alert has not fired; the other
        # one fires it and commits before this one inserts.
        if not other:
            other.append("started")

            def fire():
                try:
                    other.append(budget_alerts_fire(uses=uses, now=now))
                finally:
                    connection.close()

            thread = threading.Thread(target=fire)
            thread.start()
            thread.join(timeout=30)
        return real_insert(**kwargs)

    monkeypatch.setattr(alerts, "_alert_insert", other_worker_first)

    assert budget_alerts_fire(uses=uses, now=now) == 0
    assert other == ["started", 1]
    assert BudgetAlert.objects.filter(budget=budget).count() == 1
    assert AlertDelivery.objects.count() == 1
    assert len(queued_deliveries()) == 1


@pytest.mark.django_db(transaction=True)
def test_failing_targets_are_retried_with_back_off_then_recorded_failed_and_the_heartbeat_succeeds(
    settings, company, stateless_agent, fake_anthropic, receiver
):
    settings.PAPERCLIP_ALERT_MAX_ATTEMPTS = 3
    settings.PAPERCLIP_ALERT_RETRY_SECONDS = 60
    receiver.answer(500, 500, 500)
    budget = company_budget(company, receiver.url)
    unreachable = AlertTarget.objects.create(budget=budget, url=refused_url(), secret=SECRET)
    spend(stateless_agent, "8.50")

    run = beat(stateless_agent)

    assert run.status == RunStatus.SUCCEEDED, run.error
    ids = queued_deliveries()
    assert len(ids) == 2
    now = timezone.now()
    assert [alert_deliver(delivery_id=i, now=now) for i in ids] == ["pending", "pending"]
    assert [alert_deliver(delivery_id=i, now=now + timedelta(seconds=30)) for i in ids] == ["not due", "not due"]
    # Back-off: the second attempt is due 60 s after the first, the third 240 s after that.
    assert alert_deliveries_retry(now=now + timedelta(seconds=59)) == 0
    assert alert_deliveries_retry(now=now + timedelta(seconds=60)) == 2
    assert sorted(queued_deliveries()) == sorted(ids)
    later = now + timedelta(seconds=60)
    assert [alert_deliver(delivery_id=i, now=later) for i in ids] == ["pending", "pending"]
    assert alert_deliveries_retry(now=later + timedelta(seconds=239)) == 0
    last = later + timedelta(seconds=240)
    assert [alert_deliver(delivery_id=i, now=last) for i in ids] == ["failed", "failed"]
    assert alert_deliveries_retry(now=last + timedelta(days=1)) == 0

    served = AlertDelivery.objects.get(target__url=receiver.url)
    refused = AlertDelivery.objects.get(target=unreachable)
    assert (served.status, served.attempts, served.last_status_code) == (DeliveryStatus.FAILED, 3, 500)
    assert [(a.number, a.status_code, a.error) for a in served.attempt_rows.all()] == [
        (1, 500, "HTTP 500"),
        (2, 500, "HTTP 500"),
        (3, 500, "HTTP 500"),
    ]
    assert [a.at for a in served.attempt_rows.all()] == [now, later, last]
    assert (refused.status, refused.attempts, refused.last_status_code) == (DeliveryStatus.FAILED, 3, None)
    assert all("refused" in a.error.lower() for a in refused.attempt_rows.all())
    assert len(receiver.requests) == 3
    assert {r.headers["x-paperclip-delivery"] for r in receiver.requests} == {str(served.id)}


@pytest.mark.django_db(transaction=True)
def test_a_delivery_that_fails_once_is_delivered_by_its_retry(settings, company, stateless_agent, receiver):
    receiver.answer(503)
    company_budget(company, receiver.url)
    spend(stateless_agent, "8.50")
    now = timezone.now()
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
    (delivery_id,) = queued_deliveries()

    assert alert_deliver(delivery_id=delivery_id, now=now) == "pending"
    assert alert_deliver(delivery_id=delivery_id, now=now + timedelta(seconds=61)) == "delivered"
    assert alert_deliver(delivery_id=delivery_id, now=now + timedelta(days=1)) == "not pending"

    delivery = AlertDelivery.objects.get()
    assert (delivery.attempts, delivery.last_status_code, delivery.last_error) == (2, 200, "")
    assert [a.status_code for a in delivery.attempt_rows.all()] == [503, 200]
    assert [verified(r)["threshold"] for r in receiver.requests] == ["soft", "soft"]


@pytest.mark.django_db(transaction=True)
def test_a_queue_that_refuses_the_delivery_fails_nothing_and_the_sweep_sends_it_later(
    company, stateless_agent, fake_anthropic, receiver, monkeypatch
):
    company_budget(company, receiver.url)
    spend(stateless_agent, "8.50")

    def broker_down(*args, **kwargs):
        raise ConnectionError("the broker is down")

    monkeypatch.setattr("django_q.tasks.async_task", broker_down)
    run = beat(stateless_agent)
    monkeypatch.undo()

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert AlertDelivery.objects.get().status == DeliveryStatus.PENDING
    assert queued_deliveries() == []
    assert alert_deliveries_retry(now=timezone.now()) == 1
    assert run_queued() == ["delivered"]
    assert verified(receiver.requests[0])["threshold"] == "soft"


@pytest.mark.django_db(transaction=True)
def test_a_daily_limit_fires_again_the_next_day(company, stateless_agent, receiver):
    company_budget(company, receiver.url, daily_limit_usd=Decimal("1"))
    now = timezone.now().replace(hour=12)
    CostEvent.objects.create(company=company, agent=stateless_agent, model="m", cost_usd=Decimal("0.9"), created_at=now)
    for when in (now, now + timedelta(hours=1)):
        budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=when), now=when)
    tomorrow = now + timedelta(days=1)
    CostEvent.objects.create(
        company=company, agent=stateless_agent, model="m", cost_usd=Decimal("0.85"), created_at=tomorrow
    )
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=tomorrow), now=tomorrow)

    assert sorted(BudgetAlert.objects.values_list("period_key", "threshold")) == [
        (f"{now:%Y-%m-%d}", "soft"),
        (f"{tomorrow:%Y-%m-%d}", "soft"),
    ]


def test_a_run_cap_alert_counts_runs_and_a_money_alert_keeps_its_cent_fractions(company, stateless_agent, receiver):
    company_budget(company, receiver.url, daily_run_limit=5, daily_limit_usd=Decimal("0.005"))
    now = timezone.now()
    spend(stateless_agent, "0.0045")
    for _ in range(4):
        HeartbeatRun.objects.create(
            company=company, agent=stateless_agent, task="go", status=RunStatus.SUCCEEDED, started_at=now
        )
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
    for delivery in AlertDelivery.objects.all():
        alert_deliver(delivery_id=delivery.id, now=now)

    bodies = {(body["period"], body["threshold"]): body for body in map(verified, receiver.requests)}
    runs = bodies[("day_runs", "soft")]
    assert (runs["limit"], runs["spent"]) == (5, 4)
    money = bodies[("day", "soft")]
    assert money["limit"] == "0.005"
    assert Decimal(money["spent"]) >= Decimal("0.0045") and not money["spent"].endswith("0"), money["spent"]


def test_a_raised_limit_or_a_moved_threshold_is_alerted_again(company, stateless_agent, receiver):
    budget = company_budget(company, receiver.url)  # $10 a month
    spend(stateless_agent, "8.50")
    now = timezone.now()

    def fire() -> list[tuple]:
        budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
        return sorted(BudgetAlert.objects.values_list("threshold", "limit", "percent"))

    assert fire() == [("soft", Decimal("10"), 80)]
    budget.monthly_limit_usd = Decimal("20")  # the operator raises it: 42%, nothing to say yet
    budget.save()
    assert fire() == [("soft", Decimal("10"), 80)]
    spend(stateless_agent, "8.00")  # $16.50 of $20
    assert fire() == [("soft", Decimal("10"), 80), ("soft", Decimal("20"), 80)]
    budget.warn_percent = 70  # the threshold moved below the spend: told at once
    budget.save()
    assert fire() == [("soft", Decimal("10"), 80), ("soft", Decimal("20"), 70), ("soft", Decimal("20"), 80)]
    assert fire() == [("soft", Decimal("10"), 80), ("soft", Decimal("20"), 70), ("soft", Decimal("20"), 80)]


@pytest.mark.django_db(transaction=True)
def test_alerts_already_fired_cost_one_query(company, stateless_agent, django_assert_num_queries):
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    AlertTarget.objects.create(budget=budget, url="https://alerts.example/hook", secret=SECRET)
    spend(stateless_agent, "9.60")
    now = timezone.now()
    uses = budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now)
    assert budget_alerts_fire(uses=uses, now=now) == 2  # soft and second

    with django_assert_num_queries(1):
        assert budget_alerts_fire(uses=uses, now=now) == 0


def test_a_url_written_past_validation_is_never_opened(company, stateless_agent):
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    AlertTarget.objects.create(budget=budget, url="file:///etc/passwd", secret=SECRET)
    spend(stateless_agent, "8.5")
    now = timezone.now()
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)

    assert alert_deliver(delivery_id=AlertDelivery.objects.get().id, now=now) == "pending"
    assert AlertDelivery.objects.get().last_error == "Only http and https URLs are delivered."


def test_a_target_whose_host_is_no_longer_listed_is_never_opened(company, stateless_agent, receiver, settings):
    budget = company_budget(company, receiver.url)  # written in local_trusted mode
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({"alerts.example"})
    spend(stateless_agent, "8.5")
    now = timezone.now()
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)

    assert alert_deliver(delivery_id=AlertDelivery.objects.get(alert__budget=budget).id, now=now) == "pending"
    assert receiver.requests == []
    assert "PAPERCLIP_ALERT_HOSTS" in AlertDelivery.objects.get().last_error


def test_a_target_trickling_its_headers_is_cut_off_at_the_delivery_timeout(company, stateless_agent, settings):
    """PAPERCLIP_ALERT_TIMEOUT_SECONDS bounds the whole request: a target sending a header
    line every 0.5 s is recorded as a timed-out attempt after 1 s (before, it held the
    worker for as long as it trickled)."""
    settings.PAPERCLIP_ALERT_TIMEOUT_SECONDS = 1
    server = TricklingServer(every=0.5, lines=120)
    try:
        company_budget(company, server.url)
        spend(stateless_agent, "8.5")
        now = timezone.now()
        budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
        delivery = AlertDelivery.objects.get()
        started = time.monotonic()

        assert alert_deliver(delivery_id=delivery.id, now=now) == "pending"

        elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert 1 <= elapsed < 3, elapsed
    (attempt,) = delivery.attempt_rows.all()
    assert attempt.status_code is None and "TimeoutError" in attempt.error, attempt.error
    assert 1000 <= attempt.duration_ms < 3000


def test_a_listed_host_is_opened_only_on_the_port_listed_with_it(company, stateless_agent, receiver, settings):
    budget = company_budget(company, receiver.url)  # written in local_trusted mode: 127.0.0.1:<port>
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({"127.0.0.1"})  # http's port 80 only
    spend(stateless_agent, "8.5")
    now = timezone.now()
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
    delivery = AlertDelivery.objects.get(alert__budget=budget)

    assert alert_deliver(delivery_id=delivery.id, now=now) == "pending"
    assert receiver.requests == []
    assert "PAPERCLIP_ALERT_HOSTS" in AlertDelivery.objects.get().last_error

    port = urlsplit(receiver.url).port
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({f"127.0.0.1:{port}"})
    later = now + timedelta(hours=1)
    assert alert_deliver(delivery_id=delivery.id, now=later) == "delivered"
    assert len(receiver.requests) == 1


@pytest.mark.django_db(transaction=True)
def test_the_secret_is_never_logged_or_recorded(company, stateless_agent, receiver, caplog, monkeypatch):
    caplog.set_level("DEBUG")
    receiver.answer(500)
    budget = company_budget(company, receiver.url)
    AlertTarget.objects.create(budget=budget, url=refused_url(), secret=SECRET)
    spend(stateless_agent, "9.60")
    now = timezone.now()

    def broker_down(*args, **kwargs):
        raise ConnectionError("the broker is down")

    monkeypatch.setattr("django_q.tasks.async_task", broker_down)
    budget_alerts_fire(uses=budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=now), now=now)
    monkeypatch.undo()
    for delivery in AlertDelivery.objects.all():
        alert_deliver(delivery_id=delivery.id, now=now)

    assert len(receiver.requests) == 2  # soft and second, to the target that answers
    assert "broker is down" in caplog.text
    assert SECRET not in caplog.text
    assert not AlertDelivery.objects.filter(last_error__contains=SECRET).exists()
