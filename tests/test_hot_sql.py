"""The hot path's hand-made statements: the claim's read compiled once (`CompiledLookup`)
gives what the ORM gives, an insert skipping conflicts writes what bulk_create would in
fewer round trips, the enqueue's pipelined transaction is one round trip and commits all or
nothing, and a stateless run's one-statement commit
(`agent_not_deleted_locked`) against an agent's deletion open, uncommitted, on another
connection at its worst moment (PostgreSQL: SQLite runs one writer at a time)."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.db import DataError, IntegrityError, ProgrammingError, connection, transaction
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from psycopg import pq

from bench.heartbeat_overhead import round_trips  # the counter the benchmark prints
from costs_app.models import CostEvent
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.hot_sql import (
    queued_run_insert_locking,
    row_insert,
    rows_insert_ignoring_conflicts,
    session_take_run,
    write_then_read,
)
from sessions_app.maintenance import runs_reap, sessions_expire
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    Agent,
    AgentSession,
    AgentStatus,
    CredentialHold,
    HeartbeatRun,
    ManagedEndAction,
    ManagedSessionEnd,
    RunStatus,
    SessionStatus,
)
from sessions_app.plan import SESSION_TAKE, take_statement
from sessions_app.run_queue import (
    CLAIM_READ,
    CLAIM_UPDATE,
    CLAIM_UPDATE_UNLESS_HELD,
    NEXT_QUEUED,
    claim_read_query,
    claim_run,
    claim_update_query,
    heartbeat_enqueue,
    next_queued_query,
)
from sessions_app.services import agent_delete, session_delete, session_expire
from sessions_app.stores import store_for
from tests.conftest import Actor, beat, on_own_connection, wait_until_blocked
from tests.fake_anthropic import Reply, plain_messages, text_turn


@pytest.mark.django_db(transaction=True)
def test_a_stateless_commit_waits_for_an_open_deletion_of_its_agent_and_then_fails_agent_deleted(
    postgres_only, stateless_agent, fake_anthropic
):
    locked, release = threading.Event(), threading.Event()

    def delete_and_hold() -> None:
        # The deletion has written the agent's row and not committed when the answer arrives.
        with transaction.atomic():
            agent_delete(agent=Agent.objects.get(pk=stateless_agent.pk), now=timezone.now())
            locked.set()
            assert release.wait(30), "the test never released the deletion"

    deletion = Actor(delete_and_hold)
    fake_anthropic.push(Reply.during(lambda: (deletion.start(), locked.wait(30))))
    heartbeat = Actor(lambda: beat(stateless_agent, "one"))
    heartbeat.start()

    wait_until_blocked(heartbeat)  # its commit's UPDATE waits for the deletion's row lock
    assert HeartbeatRun.objects.get(agent=stateless_agent).status == RunStatus.RUNNING
    release.set()
    deletion.result()
    run = heartbeat.result()

    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert Agent.objects.get(pk=stateless_agent.pk).status == AgentStatus.DELETED
    assert CostEvent.objects.get(run=run).kind == "message"  # the answered call stays billed


@pytest.mark.django_db(transaction=True)
def test_a_persistent_commit_waits_for_an_open_deletion_of_its_agent_and_then_fails_agent_deleted(
    postgres_only, persistent_agent, fake_anthropic
):
    """The commit's one UPDATE of a resumed session (`heartbeat._session_append`) in place
    of the agent's lock, the session's lock and the save: a deletion open when the answer
    arrives (it has written the agent's row and the session's) holds that UPDATE until it
    commits, and the UPDATE then matches nothing. (Either lock alone holds it: the
    deletion writes both rows; the condition takes the agent's first, in the order the
    deletion takes them.)"""
    beat(persistent_agent, "zero")
    locked, release = threading.Event(), threading.Event()

    def delete_and_hold() -> None:
        with transaction.atomic():
            agent_delete(agent=Agent.objects.get(pk=persistent_agent.pk), now=timezone.now())
            locked.set()
            assert release.wait(30), "the test never released the deletion"

    deletion = Actor(delete_and_hold)
    fake_anthropic.push(Reply.during(lambda: (deletion.start(), locked.wait(30))))
    heartbeat = Actor(lambda: beat(persistent_agent, "one"))
    heartbeat.start()

    wait_until_blocked(heartbeat)  # its commit's UPDATE waits for the deletion's row lock
    assert HeartbeatRun.objects.get(agent=persistent_agent, task="one").status == RunStatus.RUNNING
    release.set()
    deletion.result()
    run = heartbeat.result()

    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert not AgentSession.objects.filter(agent=persistent_agent).exists()
    assert CostEvent.objects.filter(run=run).count() == 1  # the answered call stays billed


@pytest.mark.django_db(transaction=True)
def test_a_persistent_commit_after_its_session_ended_fails_session_ended_and_writes_no_turn(
    persistent_agent, fake_anthropic
):
    beat(persistent_agent, "zero")
    session = AgentSession.objects.get(agent=persistent_agent)
    end = on_own_connection(
        lambda: AgentSession.objects.filter(pk=session.pk).update(status=SessionStatus.ENDED, end_reason="operator")
    )
    fake_anthropic.push(Reply.during(end))

    run = beat(persistent_agent, "one")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_ended")
    session.refresh_from_db()
    assert (session.status, session.message_count, session.turn_count) == (SessionStatus.ENDED, 2, 1)
    assert CostEvent.objects.filter(run=run).count() == 1


@pytest.mark.django_db(transaction=True)
def test_session_hours_billed_while_the_model_answers_are_not_added_back_by_the_commit(
    persistent_agent, fake_anthropic
):
    """The commit adds the run's time and tokens to the row as it is: counters read by
    the plan before the call are never written back over a bill made during it."""
    beat(persistent_agent, "zero")
    session = AgentSession.objects.get(agent=persistent_agent)
    assert session.unbilled_active_seconds > 0
    bill = on_own_connection(lambda: session_hours_bill(session_ids=[session.pk], now=timezone.now()))
    fake_anthropic.push(Reply.during(bill))

    run = beat(persistent_agent, "one")

    assert run.status == RunStatus.SUCCEEDED, run.error
    billed = AgentSession.objects.get(pk=session.pk)
    run_seconds = (run.finished_at - run.started_at).total_seconds()
    assert 0 < billed.unbilled_active_seconds <= run_seconds + 0.001  # this run's time only
    assert billed.active_seconds > billed.unbilled_active_seconds  # the first run's stays counted
    assert (billed.message_count, billed.turn_count, billed.next_seq) == (4, 2, 4)


@pytest.mark.django_db(transaction=True)
def test_a_persistent_commit_after_its_run_was_reaped_writes_no_turn(settings, persistent_agent, fake_anthropic):
    """The reaper failed the run while the model answered: the session's turn and the run's
    outcome are both or neither (on PostgreSQL one statement, whose session half matched:
    it must be undone), and the file keeps the old history."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "zero")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).path_for(session).read_bytes()
    reap = on_own_connection(lambda: runs_reap(now=timezone.now() + timedelta(hours=2)))
    fake_anthropic.push(Reply.during(reap))

    run = beat(persistent_agent, "one")

    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    session.refresh_from_db()
    assert (session.message_count, session.turn_count, session.next_seq) == (2, 1, 2)
    assert store_for(session).path_for(session).read_bytes() == before
    assert CostEvent.objects.filter(run=run).count() == 1  # the answered call stays billed


@pytest.mark.django_db(transaction=True)
def test_a_persistent_commit_waits_for_an_open_reap_of_its_run_and_then_writes_nothing(
    postgres_only, persistent_agent, fake_anthropic
):
    """The reaper's `run_fail` holds the session's row and the run's, uncommitted, when the
    answer arrives: the one-statement commit takes the session's lock first, as `run_fail`
    does (no deadlock), waits, and then finds the run failed and writes nothing."""
    beat(persistent_agent, "zero")
    session = AgentSession.objects.get(agent=persistent_agent)
    history = store_for(session).read(session)
    locked, release = threading.Event(), threading.Event()

    def reap_and_hold() -> None:
        with transaction.atomic():
            assert runs_reap(now=timezone.now() + timedelta(hours=2))
            locked.set()
            assert release.wait(30), "the test never released the reap"

    reaper = Actor(reap_and_hold)
    fake_anthropic.push(Reply.during(lambda: (reaper.start(), locked.wait(30))))
    heartbeat = Actor(lambda: beat(persistent_agent, "one"))
    heartbeat.start()

    wait_until_blocked(heartbeat)
    release.set()
    reaper.result()
    run = heartbeat.result()

    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    session.refresh_from_db()
    assert (session.message_count, session.turn_count) == (2, 1)
    assert store_for(session).read(session) == history


def as_the_orm_reads_it(run: HeartbeatRun) -> tuple:
    fields = {f.attname: getattr(run, f.attname) for f in HeartbeatRun._meta.concrete_fields}
    agent = {f.attname: getattr(run.agent, f.attname) for f in Agent._meta.concrete_fields}
    annotations = {
        k: v for k, v in vars(run).items() if k in ("budgeted", "held", "prices_revision") or k.startswith("wake_")
    }
    return fields, agent, annotations


def test_the_compiledclaim_read_query_gives_what_the_orm_gives_for_each_run(
    persistent_agent, stateless_agent, fake_anthropic
):
    runs = [beat(persistent_agent, "one"), beat(persistent_agent, "two"), beat(stateless_agent, "three")]

    for run in runs:  # the second and third reuse the first's compiled statement
        compiled = CLAIM_READ.first(run.id)
        assert compiled.agent.adapter_config == run.agent.adapter_config
        assert as_the_orm_reads_it(compiled) == as_the_orm_reads_it(claim_read_query(run.id).get())
    assert CLAIM_READ.first(uuid.uuid4()) is None


def test_the_compiled_next_queued_run_is_the_orms_for_each_agent(persistent_agent, stateless_agent):
    now = timezone.now()
    for agent, ages in ((persistent_agent, (3, 1, 2)), (stateless_agent, (5,))):
        for minutes in ages:
            HeartbeatRun.objects.create(
                company_id=agent.company_id, agent=agent, task=f"{minutes}", created_at=now - timedelta(minutes=minutes)
            )
    HeartbeatRun.objects.filter(agent=persistent_agent, task="3").update(status=RunStatus.SUCCEEDED)

    for agent, oldest_queued in ((persistent_agent, "2"), (stateless_agent, "5")):
        compiled = NEXT_QUEUED.first(agent.id)
        assert compiled.pk == next_queued_query(agent.id).get().pk
        assert HeartbeatRun.objects.get(pk=compiled.pk).task == oldest_queued
    HeartbeatRun.objects.filter(agent=stateless_agent).update(status=RunStatus.SUCCEEDED)
    assert NEXT_QUEUED.first(stateless_agent.id) is None


@pytest.mark.parametrize("credential", [None, "fingerprint-1"])
def test_the_compiled_claim_update_is_the_statement_the_orm_writes_for_any_values(persistent_agent, credential):
    compiled = CLAIM_UPDATE_UNLESS_HELD if credential else CLAIM_UPDATE
    at = timezone.now()
    for status, batch_state, started in [("queued", "", at), ("submitted", "ready", at + timedelta(days=400))]:
        values = {
            "run_id": uuid.uuid4(),
            "status": status,
            "batch_state": batch_state,
            "credential": credential,
            "started_at": started,
            "deadline_at": started + timedelta(hours=1),
            "claimed_by": f"host:{status}",
        }
        with CaptureQueriesContext(connection) as ours:
            assert compiled.update(**values) == 0
        queryset, running = claim_update_query(SimpleNamespace(**values))
        with CaptureQueriesContext(connection) as the_orms:
            queryset.update(**running)
        assert [q["sql"] for q in ours] == [q["sql"] for q in the_orms]


@pytest.mark.parametrize(
    "repairs",
    [{}, {"repair__model": "claude-haiku-4-5", "repair__message_count": 7, "repair__next_seq": 9}],
    ids=["none", "a row inserted by raw SQL"],
)
def test_the_compiled_take_is_the_statement_the_take_writes_for_any_values(postgres_only, persistent_agent, repairs):
    at = timezone.now()
    for shift, last_used in enumerate((at, at + timedelta(days=400))):
        values = {
            "session_id": uuid.uuid4(),
            "run_id": uuid.uuid4(),
            "last_used": last_used,
            "expires_at": last_used + timedelta(hours=24),
            "pause_at": last_used + timedelta(minutes=5),
            **{name: value * (shift + 1) for name, value in repairs.items()},
        }
        assert SESSION_TAKE.statement(**values) == take_statement(SimpleNamespace(**values))


@pytest.mark.django_db(transaction=True)
def test_the_compiled_take_takes_a_live_session_and_links_its_run_and_takes_nothing_ended(
    postgres_only, persistent_agent, fake_anthropic
):
    first = beat(persistent_agent, "first")
    session = AgentSession.objects.get(pk=first.session_id)
    run, _ = heartbeat_enqueue(agent=persistent_agent, task="second", now=timezone.now())
    at = timezone.now() + timedelta(hours=1)
    times = {"last_used": at, "expires_at": at + timedelta(hours=24), "pause_at": at + timedelta(minutes=5)}

    assert session_take_run(SESSION_TAKE.statement(session_id=session.pk, run_id=run.id, **times))
    session.refresh_from_db()
    assert (session.last_used, session.expires_at, session.pause_at) == tuple(times.values())
    assert HeartbeatRun.objects.get(pk=run.pk).session_id == session.pk

    AgentSession.objects.filter(pk=session.pk).update(status=SessionStatus.EXPIRED)
    HeartbeatRun.objects.filter(pk=run.pk).update(session=None)
    assert not session_take_run(SESSION_TAKE.statement(session_id=session.pk, run_id=run.id, **times))
    assert HeartbeatRun.objects.get(pk=run.pk).session_id is None


def test_the_compiled_claim_update_moves_a_queued_run_to_running_unless_its_credential_is_held(persistent_agent):
    now = timezone.now()
    run = HeartbeatRun.objects.create(
        company_id=persistent_agent.company_id, agent=persistent_agent, task="t", created_at=now
    )
    values = {
        "run_id": run.id,
        "status": "queued",
        "batch_state": "",
        "credential": "fingerprint-1",
        "started_at": now,
        "deadline_at": now + timedelta(hours=1),
        "claimed_by": "host:1",
    }
    hold = CredentialHold.objects.create(credential="fingerprint-1", held_until=now + timedelta(minutes=5))
    assert CLAIM_UPDATE_UNLESS_HELD.update(**values) == 0
    hold.probe_run = run.id  # the hold's probe may go
    hold.save()
    assert CLAIM_UPDATE_UNLESS_HELD.update(**values) == 1
    run.refresh_from_db()
    assert (run.status, run.started_at, run.deadline_at, run.claimed_by) == (
        "running",
        now,
        now + timedelta(hours=1),
        "host:1",
    )
    assert CLAIM_UPDATE.update(**{**values, "credential": None}) == 0  # no longer queued


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("actor", ["operator", "maintenance", "deletion"])
def test_a_session_ended_and_held_open_while_a_heartbeat_takes_it_is_never_resumed(
    postgres_only, persistent_agent, fake_anthropic, monkeypatch, actor
):
    """The take and the run's link are one statement (`session_take_run`). An operator's
    expiry, or the maintenance pass's, or an operator's deletion has ended the session and
    not committed when the heartbeat, which read it live, takes it: the take waits for the
    row, then finds it ended (or gone), links nothing, and the run starts a fresh session."""
    start = timezone.now()
    first = beat(persistent_agent, "remember 42", now=start)
    session = AgentSession.objects.get(pk=first.session_id)
    later = start + timedelta(hours=23)
    locked, release = threading.Event(), threading.Event()

    def end_and_hold() -> None:
        with transaction.atomic():
            if actor == "operator":
                assert session_expire(session=AgentSession.objects.get(pk=session.pk), now=later)
            elif actor == "deletion":
                assert session_delete(session=AgentSession.objects.get(pk=session.pk), now=later) is None
            else:
                assert sessions_expire(now=start + timedelta(hours=30)) == 1
            locked.set()
            assert release.wait(30), "the test never released the expiry"

    ender = Actor(end_and_hold)
    store = type(store_for(session))
    read = store.read

    def read_then_end(self, live):
        history = read(self, live)
        ender.start()  # once: the second read of the test's session would raise
        assert locked.wait(30)
        return history

    monkeypatch.setattr(store, "read", read_then_end)
    heartbeat = Actor(lambda: beat(persistent_agent, "what did I say?", now=later))
    heartbeat.start()

    wait_until_blocked(heartbeat)  # the take waits for the expiry's row lock
    release.set()
    ender.result()
    run = heartbeat.result()

    assert run.status == RunStatus.SUCCEEDED
    assert run.session_id != session.pk
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "what did I say?")]
    if actor == "deletion":
        assert not AgentSession.objects.filter(pk=session.pk).exists()
        assert AgentSession.objects.get(pk=run.session_id).message_count == 2
        return
    session.refresh_from_db()
    assert (session.status, session.message_count, session.last_used) == (
        SessionStatus.EXPIRED,
        2,
        first.finished_at,
    )
    assert not HeartbeatRun.objects.filter(session=session, task="what did I say?").exists()


def remote_end(remote_id: str, company) -> ManagedSessionEnd:
    return ManagedSessionEnd(remote_session_id=remote_id, action=ManagedEndAction.ARCHIVE, company=company)


@pytest.mark.django_db(transaction=True)
def test_one_row_is_one_statement_and_a_row_already_there_is_skipped(company, django_assert_num_queries):
    rows_insert_ignoring_conflicts([remote_end("sesn_1", company)])
    with django_assert_num_queries(1):  # no BEGIN and COMMIT around it
        rows_insert_ignoring_conflicts([remote_end("sesn_1", company)])

    (row,) = ManagedSessionEnd.objects.all()
    assert (row.remote_session_id, row.action, row.company_id, row.attempts, row.done_at) == (
        "sesn_1",
        ManagedEndAction.ARCHIVE,
        company.id,
        0,
        None,
    )


def ledger_row(agent: Agent, run_id, *, call_number: int = 1, at=None) -> CostEvent:
    return CostEvent(
        company_id=agent.company_id,
        agent_id=agent.id,
        run_id=run_id,
        call_number=call_number,
        model="claude-haiku-4-5",
        input_tokens=12,
        output_tokens=7,
        cost_usd=Decimal("0.0000123456"),
        price_source="library 1",
        message_id="msg_1",
        raw_usage={"input_tokens": 12, "output_tokens": 7},
        created_at=at or timezone.now(),
    )


@pytest.mark.django_db(transaction=True)
def test_a_row_inserted_is_the_row_save_writes_in_one_statement(stateless_agent, django_assert_num_queries):
    run_id, at = uuid.uuid4(), timezone.now()
    saved = ledger_row(stateless_agent, run_id, call_number=1, at=at)
    inserted = ledger_row(stateless_agent, run_id, call_number=2, at=at)
    saved.save(force_insert=True)
    with django_assert_num_queries(1):  # no BEGIN and COMMIT around it
        row_insert(inserted)

    assert inserted.pk is not None and inserted.pk != saved.pk and not inserted._state.adding
    columns = [field.attname for field in CostEvent._meta.concrete_fields if field.attname not in ("id", "call_number")]
    written = CostEvent.objects.filter(pk__in=[saved.pk, inserted.pk]).order_by("call_number").values(*columns)
    assert written[0] == written[1]


def test_a_row_the_ledger_s_constraint_refuses_raises_and_leaves_the_transaction_usable(stateless_agent):
    run_id = uuid.uuid4()
    row_insert(ledger_row(stateless_agent, run_id))
    with pytest.raises(IntegrityError), transaction.atomic():
        row_insert(ledger_row(stateless_agent, run_id))
    assert CostEvent.objects.filter(run_id=run_id).count() == 1


def test_a_row_whose_saves_are_listened_to_is_saved_by_save(stateless_agent):
    heard = []

    def receiver(sender, instance, created, **kwargs):
        heard.append((instance.pk, created))

    post_save.connect(receiver, sender=CostEvent)
    try:
        row = ledger_row(stateless_agent, uuid.uuid4())
        row_insert(row)
    finally:
        post_save.disconnect(receiver, sender=CostEvent)
    assert heard == [(row.pk, True)]


@pytest.mark.django_db(transaction=True)
def test_rows_beyond_one_statement_go_in_one_transaction_all_or_nothing(company):
    many = [remote_end(f"sesn_{i}", company) for i in range(3000)]  # more parameters than one statement takes
    rows_insert_ignoring_conflicts(many)
    assert ManagedSessionEnd.objects.count() == 3000

    doomed = [remote_end(f"sesn_new_{i}", company) for i in range(2999)] + [
        ManagedSessionEnd(remote_session_id="sesn_x", action=ManagedEndAction.ARCHIVE, company_id=uuid.uuid4())
    ]
    with pytest.raises(IntegrityError):  # the last batch names a company that does not exist
        rows_insert_ignoring_conflicts(doomed)
    assert ManagedSessionEnd.objects.count() == 3000


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_outside_a_transaction_is_one_round_trip(postgres_only, persistent_agent):
    heartbeat_enqueue(agent=persistent_agent, task="warm", now=timezone.now())  # the prices, read once

    assert round_trips(lambda: heartbeat_enqueue(agent=persistent_agent, task="one", now=timezone.now())) == 1
    assert list(
        HeartbeatRun.objects.filter(agent=persistent_agent).values_list("task", flat=True).order_by("task")
    ) == [
        "one",
        "warm",
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("mode", "trips"), [("stateless", 5), ("persistent", 6)])
def test_a_heartbeat_outside_a_transaction_makes_its_few_round_trips(
    postgres_only, stateless_agent, persistent_agent, fake_anthropic, mode, trips
):
    """Enqueue to release: the enqueue (one pipelined transaction), the claim's read, its
    UPDATE (and then, for a persistent agent, its live session's read, in the same round
    trip), the session's take, the ledger row, and the commit (and then the release's read
    of the next queued run, in the same round trip)."""
    agent = stateless_agent if mode == "stateless" else persistent_agent
    beat(agent, "first")
    beat(agent, "second")  # a session resumed: the same statements from now on

    def heartbeat():
        run, _ = heartbeat_enqueue(agent=agent, task="counted", now=timezone.now())
        assert heartbeat_execute(run_id=run.id).status == RunStatus.SUCCEEDED

    assert round_trips(heartbeat) == trips
    if mode == "persistent":
        assert AgentSession.objects.get(agent=agent).message_count == 6


@pytest.mark.django_db(transaction=True)
def test_a_claim_reads_the_live_session_only_when_it_claimed_and_leaves_the_connection_usable(
    postgres_only, persistent_agent, fake_anthropic
):
    beat(persistent_agent, "first")
    session = AgentSession.objects.get(agent=persistent_agent)
    first, _ = heartbeat_enqueue(agent=persistent_agent, task="one", now=timezone.now())
    second, _ = heartbeat_enqueue(agent=persistent_agent, task="two", now=timezone.now())

    claimed, ok = claim_run(run_id=first.id, now=timezone.now())
    assert ok and claimed.live_session_read.row == session
    assert claimed.live_session_read.row.history == session.history

    refused, ok = claim_run(run_id=second.id, now=timezone.now())  # the one-running index refuses it
    assert not ok and refused.live_session_read is None
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE
    assert HeartbeatRun.objects.get(pk=second.pk).status == RunStatus.QUEUED


@pytest.mark.django_db(transaction=True)
def test_a_read_after_a_write_sees_it_committed_and_is_not_run_when_the_write_fails(postgres_only, persistent_agent):
    run = queued_run(persistent_agent)
    run.save()
    table = HeartbeatRun._meta.db_table
    rename = f'UPDATE "{table}" SET task = %s WHERE id = %s AND 1 / %s = 1'  # noqa: S608 (the model's table)
    read_task = (f'SELECT task FROM "{table}" WHERE id = %s', [run.id])  # noqa: S608

    assert write_then_read((rename, ["renamed", run.id, 1]), read_task) == (1, [("renamed",)])
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE
    reader = Actor(lambda: HeartbeatRun.objects.get(pk=run.pk).task)
    reader.start()
    assert reader.result() == "renamed"  # committed

    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY SEQUENCE reads")
    with pytest.raises(DataError):
        write_then_read((rename, ["lost", run.id, 0]), ("SELECT nextval('reads')", []))
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE
    assert HeartbeatRun.objects.get(pk=run.pk).task == "renamed"
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval('reads')")
        assert cursor.fetchone() == (1,)  # the read after the failed write never ran


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "failing_read",
    [("SELECT 1 / %s", [0]), ("SELECT %s", [object()])],  # fails at the server; refused before it is sent
    ids=["at the server", "before it is sent"],
)
def test_a_read_that_fails_after_the_commit_leaves_the_write_committed_and_says_so(
    postgres_only, persistent_agent, failing_read, caplog
):
    run = queued_run(persistent_agent)
    run.save()
    table = HeartbeatRun._meta.db_table
    rename = (f'UPDATE "{table}" SET task = %s WHERE id = %s', ["renamed", run.id])  # noqa: S608 (the model's table)

    assert write_then_read(rename, failing_read) == (1, None)  # the write's outcome, no rows
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE
    reader = Actor(lambda: HeartbeatRun.objects.get(pk=run.pk).task)
    reader.start()
    assert reader.result() == "renamed"
    assert "A read after a committed write failed" in caplog.text


def queued_run(agent, **fields) -> HeartbeatRun:
    return HeartbeatRun(company_id=agent.company_id, agent=agent, task="t", created_at=timezone.now(), **fields)


@pytest.mark.django_db(transaction=True)
def test_a_pipelined_statement_that_fails_commits_nothing_before_it_and_leaves_the_connection_usable(
    postgres_only, persistent_agent
):
    refusing_lock = ("SELECT 1 / %s", [0])  # fails after BEGIN, before the INSERT
    with pytest.raises(DataError):
        queued_run_insert_locking(
            queued_run(persistent_agent), agent_id=persistent_agent.pk, bound=5, lock=refusing_lock
        )
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE

    unsendable_lock = ("SELECT %s", [object()])  # refused by psycopg before it is sent, after the BEGIN
    with pytest.raises(ProgrammingError):
        queued_run_insert_locking(
            queued_run(persistent_agent), agent_id=persistent_agent.pk, bound=5, lock=unsendable_lock
        )
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE

    unlocked = ("SELECT 1", [])
    orphan = HeartbeatRun(company_id=uuid.uuid4(), agent=persistent_agent, task="t", created_at=timezone.now())
    with pytest.raises(IntegrityError):  # the COMMIT's deferred foreign key check refuses it
        queued_run_insert_locking(orphan, agent_id=persistent_agent.pk, bound=5, lock=unlocked)
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE
    assert not HeartbeatRun.objects.exists()

    assert queued_run_insert_locking(queued_run(persistent_agent), agent_id=persistent_agent.pk, bound=1, lock=unlocked)
    assert not queued_run_insert_locking(
        queued_run(persistent_agent), agent_id=persistent_agent.pk, bound=1, lock=unlocked
    )  # the bound: one queued run
    assert HeartbeatRun.objects.count() == 1
