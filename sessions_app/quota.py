"""Quota-aware dispatch: a credential a provider refused is held until its reset.

1. A call refused by a rate limit whose reset lies beyond the retry window, or by a spent
   quota (`adapters.base.QuotaRefused`), holds the credential it used (`quota_hold`):
   until the reset the provider named, or PAPERCLIP_QUOTA_HOLD_SECONDS when it named none.
   The run goes back to `queued` (`run_queue.run_requeue`), its attempt not counted as a
   failure and its billed calls kept (the next attempt numbers its ledger rows after them).
2. While a credential is held no run that would use it is claimed (`claim_check`, and
   `hold_free` in the claim's UPDATE itself, so a hold set between a claim's read and its
   write still stops it); scheduled ticks merge into the queued runs as they always do.
3. Once the reset has passed, exactly one run takes the probe (a conditional update of
   the hold's row); the others stay queued. The probe's end releases the hold when it was
   not refused again (`probe_end`) and the queue drains under PAPERCLIP_MAX_CONCURRENT_RUNS;
   a refusal extends the hold.
4. Before any refusal, an answer's `anthropic-ratelimit-*-remaining` headers pace claims
   (`quota_observe`): below PAPERCLIP_QUOTA_PACE_BELOW_PERCENT of its tightest limit, the
   credential is held (`paced`) for the time that spreads what is left until the reset.

Who wakes the queue at a reset: a ONCE django-q2 schedule armed for it
(`sessions_app.tasks.quota_wake`; the scheduler looks every 30 seconds) and the maintenance pass's dispatch of stuck queues.
A new hold and its release are `quota_held` / `quota_released` alert events.

No extra database round trip is made when nothing is held: the claim asks whether any
credential is held in the query it makes anyway (`holds_exist`).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, Q
from django.db.models.functions import Greatest

from sessions_app.adapters.base import QuotaRefused
from sessions_app.adapters.rate_limits import Headroom
from sessions_app.models import CredentialHold, HeartbeatRun

logger = logging.getLogger(__name__)

PACED = "paced"
WAKE_FUNC = "sessions_app.tasks.quota_wake"


def wake_schedule_name(credential: str) -> str:
    return f"quota:{credential}"


# The claim's side (called from `run_queue.claim_run`).


def holds_exist() -> Exists:
    """Whether any credential is held: an annotation of the claim's own query (it reads
    holds_active_idx), so a claim with nothing held makes no extra round trip."""
    return Exists(CredentialHold.objects.filter(held_until__isnull=False))


def hold_free(*, credential: str | None, run_id) -> Q:
    """The claim UPDATE's condition: the credential is not held, or this run is its probe."""
    if credential is None:
        return Q()
    held = CredentialHold.objects.filter(credential=credential, held_until__isnull=False).exclude(probe_run=run_id)
    return ~Exists(held)


def claim_check(*, run: HeartbeatRun, credential: str | None, now: datetime, lease_until: datetime) -> bool:
    """Called by a claim that saw a hold: whether `run` may be claimed. A run of a held
    credential waits until the reset; then the first to take the probe (until
    `lease_until`, the run's deadline) goes, and is marked `run.quota_probe`."""
    if credential is None:
        return True
    hold = CredentialHold.objects.filter(credential=credential, held_until__isnull=False).first()
    if hold is None:
        return True
    if hold.held_until > now:
        run.quota_held_until = hold.held_until
        return False
    if hold.probe_run == run.id:
        run.quota_probe = credential
        return True
    if hold.probe_run is not None and hold.probe_until is not None and hold.probe_until > now:
        run.quota_held_until = hold.probe_until  # at the latest: the probe may end it sooner
        return False
    # Of two claimers (any cluster) one update matches the row as it was read.
    taken = CredentialHold.objects.filter(
        pk=hold.pk, held_until=hold.held_until, probe_run=hold.probe_run, probe_until=hold.probe_until
    ).update(probe_run=run.id, probe_until=lease_until)
    if taken:
        run.quota_probe = credential
    return bool(taken)


def probe_give_back(*, run: HeartbeatRun) -> None:
    """The probe's claim did not go through (its agent was busy, no place was free): the
    next claimer may take it at once."""
    if run.quota_probe is not None:
        CredentialHold.objects.filter(credential=run.quota_probe, probe_run=run.id).update(
            probe_run=None, probe_until=None
        )
        run.quota_probe = None


# The engine's side (called from `heartbeat`).


def quota_refused(*, credential: str | None, refusal: QuotaRefused, now: datetime) -> None:
    """A call was refused by a quota: hold the credential it used (the engine then puts
    the run back in the queue, `run_queue.run_requeue`)."""
    if credential is not None:
        until = refusal.reset(now=now)
        quota_hold(credential=credential, code=refusal.code, reason=refusal.message, until=until, now=now)


def quota_hold(*, credential: str, code: str, reason: str, until: datetime | None, now: datetime) -> bool:
    """Hold `credential` until `until` (PAPERCLIP_QUOTA_HOLD_SECONDS from now when None),
    or extend its hold to it; never shortened by a later, nearer reset. True when this
    started the hold (then, and only then, `quota_held` is sent: two workers refused at
    once start it once)."""
    held_until = until if until is not None and until > now else None
    held_until = held_until or now + timedelta(seconds=settings.PAPERCLIP_QUOTA_HOLD_SECONDS)
    fields = {"code": code, "reason": reason[:1000], "probe_run": None, "probe_until": None}
    _row(credential)
    rows = CredentialHold.objects.filter(credential=credential)
    # A refusal starts a hold over a mere pacing; a pacing never replaces a refusal's hold.
    startable = Q(held_until__isnull=True) if code == PACED else Q(held_until__isnull=True) | Q(code=PACED)
    started = rows.filter(startable).update(held_until=held_until, held_at=now, released_at=None, refusals=1, **fields)
    if not started and code != PACED:
        # A refused probe (or a second worker refused at once) extends the hold.
        rows.filter(held_until__isnull=False).exclude(code=PACED).update(
            held_until=Greatest(F("held_until"), held_until), refusals=F("refusals") + 1, **fields
        )
    elif not started:
        # A newer answer's pace replaces the last one's (its run, probing, then releases nothing).
        rows.filter(code=PACED, held_until__isnull=False).update(held_until=held_until, **fields)
    hold = CredentialHold.objects.get(credential=credential)
    _arm_wake(credential=credential, at=hold.held_until)
    if started and code != PACED:
        logger.warning("Credential %s is %s", credential, hold.status_text)
        quota_event(kind="quota_held", hold=hold, now=now)
    return bool(started)


def _row(credential: str) -> None:
    if not CredentialHold.objects.filter(credential=credential).exists():
        try:
            with transaction.atomic():
                CredentialHold.objects.create(credential=credential)
        except IntegrityError:
            pass  # another worker made it


def probe_end(*, run: HeartbeatRun, now: datetime) -> bool:
    """The probe ended without a refusal: release the hold (True: the engine then lets the
    queue drain). A refusal meanwhile cleared the probe, so this then releases nothing."""
    credential = run.quota_probe
    if credential is None:
        return False
    released = CredentialHold.objects.filter(credential=credential, probe_run=run.id).update(
        held_until=None, probe_run=None, probe_until=None, released_at=now
    )
    run.quota_probe = None
    if not released:
        return False
    from django_q.models import Schedule

    Schedule.objects.filter(name=wake_schedule_name(credential)).delete()
    hold = CredentialHold.objects.get(credential=credential)
    if hold.code != PACED:
        logger.warning("Credential %s is released", credential)
        quota_event(kind="quota_released", hold=hold, now=now)
    return True


def quota_observe(*, credential: str | None, headroom: Headroom | None, now: datetime) -> None:
    """Pace claims by what an answer said is left: below PAPERCLIP_QUOTA_PACE_BELOW_PERCENT
    of its tightest limit, the credential is held for one share of the time to the reset
    (the time left split evenly among the requests or tokens left). Nothing is written
    above the threshold."""
    below = settings.PAPERCLIP_QUOTA_PACE_BELOW_PERCENT
    if credential is None or headroom is None or headroom.reset_at is None or headroom.left * 100 >= below:
        return
    until = headroom.reset_at
    if headroom.remaining > 0:
        until = now + (headroom.reset_at - now) / (headroom.remaining + 1)
    if until <= now:
        return
    reason = (
        f"paced: {headroom.remaining} of {headroom.limit} {headroom.kind} left until {headroom.reset_at.isoformat()}"
    )
    quota_hold(credential=credential, code=PACED, reason=reason, until=until, now=now)


def _arm_wake(*, credential: str, at: datetime) -> None:
    """A ONCE schedule that dispatches the waiting runs at the reset (one of them probes)."""
    from django_q.models import Schedule

    Schedule.objects.update_or_create(
        name=wake_schedule_name(credential),
        defaults={"func": WAKE_FUNC, "schedule_type": Schedule.ONCE, "repeats": -1, "next_run": at},
    )


# What operators see.


def holds_now() -> list[CredentialHold]:
    """The credentials held now (reads holds_active_idx)."""
    return list(CredentialHold.objects.filter(held_until__isnull=False).order_by("held_until"))


def holds_count() -> int:
    """How many credentials are held now (the metrics' gauge, read in the exporter's own
    thread, whose connection is closed after)."""
    from django.db import connection

    try:
        return CredentialHold.objects.filter(held_until__isnull=False).count()
    finally:
        connection.close()


def hold_json(hold: CredentialHold) -> dict:
    return {
        "credential": hold.credential,
        "held_until": hold.held_until.isoformat() if hold.held_until else None,
        "code": hold.code,
        "reason": hold.reason,
        "status": hold.status_text,
        "held_at": hold.held_at.isoformat() if hold.held_at else None,
        "refusals": hold.refusals,
        "probing": hold.probe_run is not None,
    }


def quota_event(*, kind: str, hold: CredentialHold, now: datetime) -> None:
    from costs_app.alerts import alert_event_fire

    alert_event_fire(
        kind=kind,
        key=f"{kind}:{hold.credential}:{hold.held_at.isoformat() if hold.held_at else ''}",
        payload={
            "credential": hold.credential,
            "held_until": hold.held_until.isoformat() if hold.held_until else None,
            "released_at": hold.released_at.isoformat() if hold.released_at else None,
            "code": hold.code,
            "reason": hold.reason,
        },
        now=now,
    )
