"""Heartbeats through the real SDK against the fake Messages API."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.adapters.base import Adapter
from sessions_app.errors import HeartbeatRefused, RunRemoved
from sessions_app.heartbeat import heartbeat_execute, heartbeat_start, heartbeat_wait
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, AgentStatus, HeartbeatRun, RunStatus, RunTrigger, SessionStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.services import agent_delete, agent_pause, agents_hard_delete
from sessions_app.stores import store_for
from tests.admin.conftest import conversation, make_session
from tests.conftest import (
    Actor,
    WriteGate,
    beat,
    context_agent,
    failing_once,
    on_own_connection,
    refuse_writes,
    snapshot,
    terminate_backend_running,
    wait_until_blocked,
)
from tests.fake_anthropic import Reply, plain_messages, plain_system, text_turn


def test_stateless_request_carries_system_prompt_and_one_user_message(stateless_agent, fake_anthropic):
    run = beat(stateless_agent, "What is 2+2?")
    beat(stateless_agent, "And 3+3?")

    assert run.status == RunStatus.SUCCEEDED, run.error
    first, second = fake_anthropic.message_requests
    assert plain_system(first) == "You are terse."
    assert first["model"] == "claude-opus-4-5"
    assert first["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert second["messages"] == [{"role": "user", "content": "And 3+3?"}]
    # The system prompt is the cacheable prefix of a stateless agent.
    assert first["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert run.session_id is None
    assert not AgentSession.objects.exists()
    assert run.output.startswith("answer 1")


def test_persistent_request_k_carries_2k_minus_1_alternating_messages_verbatim(persistent_agent, fake_anthropic):
    for k in range(1, 6):
        run = beat(persistent_agent, f"task {k}")
        assert run.status == RunStatus.SUCCEEDED, run.error

    requests = fake_anthropic.message_requests
    for k, body in enumerate(requests, start=1):
        messages = plain_messages(body)
        assert len(messages) == 2 * k - 1
        assert [m["role"] for m in messages] == ["user", "assistant"] * (k - 1) + ["user"]
        assert messages[-1] == text_turn("user", f"task {k}")
        if k > 1:
            # Every earlier request's messages come back verbatim, then its answer.
            previous = plain_messages(requests[k - 2])
            assert messages[: len(previous)] == previous
            assert messages[len(previous)] == text_turn("assistant", f"answer {k - 1}: task {k - 1}")
    session = AgentSession.objects.get()
    assert session.message_count == 10
    assert run.session_id == session.id


def test_same_idempotency_key_returns_the_same_run_and_calls_the_model_once(persistent_agent, fake_anthropic):
    first = beat(persistent_agent, "once", idempotency_key="k-1")
    again, created = heartbeat_enqueue(agent=persistent_agent, task="once", now=timezone.now(), idempotency_key="k-1")
    assert not created
    assert again.id == first.id
    assert heartbeat_execute(run_id=again.id).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 1
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="other", now=timezone.now(), idempotency_key="k-1")
    assert refused.value.code == "idempotency_key_reused"


@pytest.mark.parametrize(
    ("replies", "code"),
    [
        ([Reply.error(400, "bad request")], "model_bad_request"),
        ([Reply.error(500, "boom", 1)] * 3, "model_server_error"),
        ([Reply.error(529, "overloaded", 1)] * 3, "model_overloaded"),
        ([Reply.malformed()], "model_malformed_response"),
    ],
)
def test_permanent_failure_leaves_history_and_ledger_untouched(persistent_agent, fake_anthropic, replies, code):
    ok = beat(persistent_agent, "first")
    session = AgentSession.objects.get(id=ok.session_id)
    history_before = store_for(session).read(session)
    fake_anthropic.push(*replies)

    failed = beat(persistent_agent, "second")

    assert failed.status == RunStatus.FAILED
    assert failed.error_code == code
    assert failed.finished_at is not None
    session.refresh_from_db()
    assert store_for(session).read(session) == history_before
    assert session.message_count == 2
    assert CostEvent.objects.count() == 1
    # ...and the next heartbeat resumes from the intact history.
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests[-1]["messages"]) == 3


def test_paused_and_deleted_agents_are_refused_without_a_model_call(persistent_agent, fake_anthropic):
    agent_pause(agent=persistent_agent)
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="x", now=timezone.now())
    assert refused.value.code == "agent_paused"

    persistent_agent.status = AgentStatus.ACTIVE
    persistent_agent.save()
    run, _ = heartbeat_enqueue(agent=persistent_agent, task="queued before pause", now=timezone.now())
    agent_pause(agent=persistent_agent)
    failed = heartbeat_execute(run_id=run.id)
    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "agent_paused")
    assert fake_anthropic.message_requests == []


def test_a_second_run_waits_while_the_agent_is_busy(persistent_agent, fake_anthropic):
    now = timezone.now()
    first, _ = heartbeat_enqueue(agent=persistent_agent, task="first", now=now)
    second, _ = heartbeat_enqueue(agent=persistent_agent, task="second", now=now)
    HeartbeatRun.objects.filter(id=first.id).update(status=RunStatus.RUNNING, started_at=now)

    assert heartbeat_execute(run_id=second.id).status == RunStatus.QUEUED
    assert fake_anthropic.message_requests == []

    HeartbeatRun.objects.filter(id=first.id).update(status=RunStatus.FAILED)
    assert heartbeat_execute(run_id=second.id).status == RunStatus.SUCCEEDED


@pytest.mark.parametrize("mode", ["stateless", "persistent"])
def test_a_heartbeat_makes_the_same_few_queries_however_long_the_session(
    mode, stateless_agent, persistent_agent, fake_anthropic, django_assert_max_num_queries
):
    agent = persistent_agent if mode == "persistent" else stateless_agent
    # A budget no turn here reaches: a summary is a heartbeat's extra step, measured elsewhere.
    agent.adapter_config = {**agent.adapter_config, "context_budget_tokens": 100_000}
    agent.save()
    for i in range(20):
        beat(agent, f"turn {i}")
    # The queue bound's count with the budget check in one query (and, on PostgreSQL, its
    # advisory lock) at enqueue, claim, session read, link and touch, the agent's lock,
    # price, ledger row, session and run updates, next queued run, the agent's last wakes
    # (its cache lifetime), and the savepoints around them; with the file store, the
    # publication's check, under the row's lock, that the row still names its version (a
    # transaction of its own: its savepoint here, BEGIN and COMMIT outside a test): none of it
    # per message of history.
    publication = 3 if mode == "persistent" and AgentSession.objects.get(agent=agent).store == "file" else 0
    with django_assert_max_num_queries(19 if mode == "stateless" else 24 + publication):
        assert beat(agent, "turn 20").status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_run_answering_within_its_agents_timeout_is_not_reaped(company, fake_anthropic):
    from django.db import connection

    from sessions_app.maintenance import runs_reap

    agent = Agent.objects.create(
        company=company,
        name="slow thinker",
        adapter_config={"model": "claude-opus-4-5", "timeout_seconds": 3600, "max_retries": 1},
    )
    start = timezone.now()
    passes = []

    def reaper_an_hour_into_the_call():
        # The first attempt took its whole hour; the retry is answering.
        passes.append(runs_reap(now=start + timedelta(minutes=61)))
        connection.close()

    fake_anthropic.push(Reply(before=reaper_an_hour_into_the_call))

    run = beat(agent, "think hard", now=start)

    assert passes == [[]]  # the reaper did run while the call was answering, and reaped nothing
    assert run.status == RunStatus.SUCCEEDED, run.error
    # Two attempts of an hour, the wait between them, and the run timeout for the rest.
    assert run.deadline_at == start + timedelta(seconds=2 * 3600 + 60 + 600)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("resumed", [False, True], ids=["new-session", "resumed-session"])
def test_an_agent_deleted_during_its_heartbeat_gains_no_session(
    persistent_agent, fake_anthropic, paperclip_home, resumed
):
    if resumed:
        beat(persistent_agent, "zero")
    fake_anthropic.push(
        Reply.during(on_own_connection(lambda: agent_delete(agent=persistent_agent, now=timezone.now())))
    )

    run = beat(persistent_agent, "one")

    assert fake_anthropic.action_errors == []
    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert not AgentSession.objects.filter(agent=persistent_agent).exists()
    assert list(paperclip_home.rglob("*.json")) == []
    assert CostEvent.objects.get(run=run).kind == "message"  # billed, so recorded


@pytest.mark.django_db(transaction=True)
def test_an_answer_whose_commit_fails_leaves_the_old_file_and_the_next_heartbeat_resumes(
    settings, persistent_agent, fake_anthropic, refuse_at_commit
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).path_for(session).read_bytes()
    allow = refuse_at_commit("agent_sessions", when="NEW.message_count > OLD.message_count")

    failed = beat(persistent_agent, "two")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert store_for(session).path_for(session).read_bytes() == before
    allow()
    run = beat(persistent_agent, "three")
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert [m["content"] for m in store_for(session).read(session) if m["role"] == "user"] == ["one", "three"]
    assert plain_messages(fake_anthropic.message_requests[-1])[:2] == [
        text_turn("user", "one"),
        text_turn("assistant", "answer 1: one"),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_first_answer_whose_commit_fails_leaves_no_session_and_no_file(
    settings, persistent_agent, fake_anthropic, refuse_at_commit
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    refuse_at_commit("agent_sessions", when="1 = 1", event="INSERT")

    failed = beat(persistent_agent, "one")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert not AgentSession.objects.exists()
    folder = settings.PAPERCLIP_HOME / "sessions" / str(persistent_agent.id)
    assert not folder.exists() or list(folder.iterdir()) == []


def test_an_answer_whose_rename_fails_after_the_commit_is_published_by_the_next_read(
    settings, persistent_agent, fake_anthropic, monkeypatch
):
    """The COMMIT succeeded, then the rename (or the directory's fsync) failed: the run is
    answered, and the staged file the row names is put in place by the next reader."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "one")
    failures = failing_once(monkeypatch, "replace")

    answered = beat(persistent_agent, "two")

    assert (answered.status, answered.error_code) == (RunStatus.SUCCEEDED, ""), answered.error
    assert failures, "the rename was never attempted"
    session = AgentSession.objects.get(agent=persistent_agent)
    assert len(json.loads(store_for(session).path_for(session).read_text())["messages"]) == 2
    run = beat(persistent_agent, "three")
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert [m["content"] for m in store_for(session).read(session) if m["role"] == "user"] == ["one", "two", "three"]
    assert len(json.loads(store_for(session).path_for(session).read_text())["messages"]) == 6


def test_the_queue_bound_refuses_with_queue_full_and_a_used_key_still_answers(settings, persistent_agent):
    settings.PAPERCLIP_MAX_QUEUED_RUNS = 2
    now = timezone.now()
    first, _ = heartbeat_enqueue(agent=persistent_agent, task="one", now=now, idempotency_key="k1")
    heartbeat_enqueue(agent=persistent_agent, task="two", now=now)
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="three", now=now)
    assert refused.value.code == "queue_full"
    assert heartbeat_enqueue(agent=persistent_agent, task="one", now=now, idempotency_key="k1") == (first, False)
    # Running and finished runs take no place in the queue.
    HeartbeatRun.objects.filter(pk=first.pk).update(status=RunStatus.SUCCEEDED)
    assert heartbeat_enqueue(agent=persistent_agent, task="three", now=now)[1] is True


@pytest.mark.django_db(transaction=True)
def test_two_enqueues_racing_for_the_last_place_in_the_queue_let_one_in(settings, persistent_agent):
    """The second enqueue arrives while the first's insert is still uncommitted (held at a
    gate inside it): without serialization (PostgreSQL: the agent's queue lock; SQLite:
    IMMEDIATE transactions) both would see room for one. The gate opens only once the
    second is seen waiting for a lock."""
    settings.PAPERCLIP_MAX_QUEUED_RUNS = 2
    heartbeat_enqueue(agent=persistent_agent, task="already queued", now=timezone.now())

    def enqueue(name):
        try:
            return heartbeat_enqueue(agent=persistent_agent, task=name, now=timezone.now())[1]
        except HeartbeatRefused as exc:
            return exc.code

    with WriteGate("heartbeat_runs", event="INSERT") as gate:
        first = Actor(lambda: enqueue("first"))
        first.start()
        gate.wait_entered()
        second = Actor(lambda: enqueue("second"))
        second.start()
        wait_until_blocked(second)
        gate.open()
        outcomes = {"first": first.result(), "second": second.result()}

    assert outcomes == {"first": True, "second": "queue_full"}
    assert HeartbeatRun.objects.filter(agent=persistent_agent, status=RunStatus.QUEUED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_repeated_key_arriving_while_the_first_insert_is_uncommitted_gets_that_run_and_no_second_call(
    persistent_agent, fake_anthropic
):
    """The worst moment for "never calls the model twice": the second request with the same
    idempotency key arrives after the first found no run under it and while the first's
    insert is uncommitted (held at a gate inside it), so it finds none either. It waits for
    the first (the agent's queue lock; SQLite: IMMEDIATE transactions), then meets the
    key's run and returns it: one run, one model call."""

    def enqueue():
        return heartbeat_enqueue(agent=persistent_agent, task="once", now=timezone.now(), idempotency_key="k-race")

    with WriteGate("heartbeat_runs", event="INSERT") as gate:
        first = Actor(enqueue)
        first.start()
        gate.wait_entered()
        second = Actor(enqueue)
        second.start()
        wait_until_blocked(second)
        gate.open()
        (first_run, first_created), (second_run, second_created) = first.result(), second.result()

    assert (first_created, second_created) == (True, False)
    assert second_run.id == first_run.id
    assert HeartbeatRun.objects.filter(agent=persistent_agent).count() == 1
    assert heartbeat_execute(run_id=first_run.id).status == RunStatus.SUCCEEDED
    assert heartbeat_execute(run_id=second_run.id).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 1


class SessionKeepingAdapter(Adapter):
    """A runtime that resumes a session it keeps itself: it is sent only the new turn."""

    type_name = "own-session-test"
    keeps_own_session = True
    config_keys = frozenset({"model"})

    def __init__(self, *, keeps_own_session: bool = True) -> None:
        self.keeps_own_session = keeps_own_session
        self.requests = []

    def validate_config(self, config, errors):
        return {"model": config.get("model", "runtime-model")}

    def call_seconds(self, config) -> float:
        return 5

    def call(self, request):
        from sessions_app.adapters import AdapterReply

        self.requests.append(request)
        text = f"answer {len(self.requests)}"
        return AdapterReply(text=text, content=text, model=request.model, usage={"input_tokens": 7, "output_tokens": 3})


def runtime_agent(company, monkeypatch, adapter):
    from sessions_app.adapters import ADAPTERS

    monkeypatch.setitem(ADAPTERS, adapter.type_name, adapter)
    return Agent.objects.create(
        company=company,
        name="Runtime",
        adapter_type=adapter.type_name,
        # A budget far too small to replay anything, and a rotation after every turn: a
        # runtime that keeps its own session is neither compacted nor rotated.
        adapter_config={"session_mode": "persistent", "context_budget_tokens": 1000, "rotate_after_turns": 1},
    )


def test_a_runtime_that_keeps_its_own_session_gets_only_the_new_turn_and_reports_it_back(company, monkeypatch):
    from sessions_app.models import SessionCompaction

    adapter = SessionKeepingAdapter()
    agent = runtime_agent(company, monkeypatch, adapter)
    big = "x" * 6000  # alone over the 1000-token budget: a replayed session could not fit it twice

    runs = [beat(agent, f"{big} task {n}") for n in range(3)]

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * 3, [run.error for run in runs]
    assert [len(request.messages) for request in adapter.requests] == [1, 1, 1]
    assert adapter.requests[2].messages[0]["content"] == f"{big} task 2"
    session = AgentSession.objects.get(agent=agent)  # one session: never rotated
    assert {run.session_id for run in runs} == {session.id}
    assert (session.turn_count, session.message_count, session.total_output_tokens) == (3, 6, 9)
    assert [m["content"] for m in store_for(session).read(session)][1::2] == ["answer 1", "answer 2", "answer 3"]
    assert not SessionCompaction.objects.exists()
    assert CostEvent.objects.filter(agent=agent).count() == 3


def test_a_runtime_without_its_own_session_has_the_history_replayed(company, monkeypatch):
    adapter = SessionKeepingAdapter(keeps_own_session=False)
    agent = runtime_agent(company, monkeypatch, adapter)
    agent.adapter_config = {"session_mode": "persistent"}
    agent.save()

    beat(agent, "one")
    beat(agent, "two")

    assert [len(request.messages) for request in adapter.requests] == [1, 3]


def test_the_heartbeat_command_sees_the_run_of_a_repeated_key_through(persistent_agent, fake_anthropic, capsys):
    from django.core.management import call_command

    heartbeat_enqueue(agent=persistent_agent, task="queued earlier", now=timezone.now(), idempotency_key="k-cmd")
    call_command("heartbeat", str(persistent_agent.id), "--task", "queued earlier", "--idempotency-key", "k-cmd")

    assert "answer 1: queued earlier" in capsys.readouterr().out
    assert HeartbeatRun.objects.get().status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["database", "file"])
def test_terminated_connection_mid_commit_leaves_history_whole_and_still_bills(
    postgres_only, settings, persistent_agent, fake_anthropic, store
):
    settings.PAPERCLIP_SESSION_STORE = store
    beat(persistent_agent, "first")
    count, history, costs = snapshot(persistent_agent)
    with connection.cursor() as cursor:
        # Hold the commit transaction open: the turn's update of the session sleeps, so it can be killed.
        cursor.execute(
            "CREATE FUNCTION slow_turn() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER slow_turn BEFORE UPDATE ON agent_sessions "
            "FOR EACH ROW WHEN (NEW.message_count <> OLD.message_count) EXECUTE FUNCTION slow_turn();"
        )
    outcome = {}

    def run_heartbeat():
        try:
            outcome["run"] = beat(persistent_agent, "second")
        except Exception as exc:  # the connection dies under it
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run_heartbeat)
    thread.start()
    try:
        terminate_backend_running('%UPDATE "agent_sessions"%')
        thread.join(timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS slow_turn ON agent_sessions; DROP FUNCTION IF EXISTS slow_turn();")

    # Nothing of the answer's commit was written, but the answer was billed when it
    # returned, before the commit began.
    assert snapshot(persistent_agent) == (count, history, costs + 1)
    stuck = HeartbeatRun.objects.get(task="second")
    assert CostEvent.objects.get(run=stuck).kind == "message"
    assert stuck.status in (RunStatus.RUNNING, RunStatus.FAILED)
    runs_reap(now=timezone.now() + timedelta(hours=1))
    assert HeartbeatRun.objects.get(task="second").status == RunStatus.FAILED
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert snapshot(persistent_agent)[0] == count + 2
    assert [m["content"] for m in snapshot(persistent_agent)[1] if m["role"] == "user"] == ["first", "third"]


def test_a_database_error_while_committing_the_answer_still_records_its_cost(persistent_agent, fake_anthropic):
    beat(persistent_agent, "first")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).read(session)
    refuse_writes("agent_sessions", when="NEW.message_count > OLD.message_count")

    run = beat(persistent_agent, "second")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    billed = fake_anthropic.message_requests[-1]
    event = CostEvent.objects.get(run=run)
    assert (event.kind, event.input_tokens) == (CostKind.MESSAGE, fake_anthropic.default_usage(billed)["input_tokens"])
    session.refresh_from_db()
    assert (session.message_count, store_for(session).read(session)) == (2, before)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_concurrent_heartbeats_lose_no_turn_and_never_interleave(persistent_agent, fake_anthropic):
    """One writer per agent, proven with real threads and connections on PostgreSQL."""
    # Each answer takes a moment, so the threads really overlap.
    fake_anthropic.push(*[Reply.delay(0.05) for _ in range(12)])
    tasks = [f"task {i}" for i in range(12)]
    errors = []

    def fire(task):
        try:
            run, _ = heartbeat_enqueue(agent=persistent_agent, task=task, now=timezone.now())
            heartbeat_wait(run_id=run.id, timeout_seconds=60)
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=fire, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    assert set(HeartbeatRun.objects.values_list("status", flat=True)) == {RunStatus.SUCCEEDED}
    session = AgentSession.objects.get()
    history = store_for(session).read(session)
    assert len(history) == 24 == session.message_count
    assert [m["role"] for m in history] == ["user", "assistant"] * 12
    assert sorted(m["content"] for m in history if m["role"] == "user") == sorted(tasks)
    # Never interleaved: each answer directly follows its own task, from the same run.
    for user, assistant in zip(history[::2], history[1::2], strict=True):
        assert user["run_id"] == assistant["run_id"]
    # Request k saw exactly the 2k-1 messages that existed when it ran.
    assert sorted(len(body["messages"]) for body in fake_anthropic.message_requests) == list(range(1, 24, 2))
    assert CostEvent.objects.count() == 12


def make_agents(company, count: int) -> list[Agent]:
    return [
        Agent.objects.create(
            company=company, name=f"Agent {i}", adapter_type="claude-code", adapter_config={"model": "claude-opus-4-5"}
        )
        for i in range(count)
    ]


def dispatched_run_ids() -> list[str]:
    """Run ids handed to the task queue (the ORM broker), in the order they were queued."""
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    return [SignedPackage.loads(row.payload)["args"][0] for row in OrmQ.objects.order_by("id")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_a_cap_of_two_holds_five_agents_heartbeating_at_once_to_two_running_in_order(settings, company, fake_anthropic):
    """Five `"wait": true` heartbeats at once on five agents, each answer slow: never more
    than two running (sampled as each request arrives), all five finish, claimed in the
    order they were created (up to the race between two places freed at once)."""
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 2
    agents = make_agents(company, 5)
    samples = []

    def sample():
        samples.append(HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count())

    fake_anthropic.push(*[Reply(kind="delay", seconds=0.3, before=on_own_connection(sample)) for _ in agents])
    errors = []

    def fire(agent):
        try:
            heartbeat_start(
                agent=agent, task="go", trigger=RunTrigger.API, now=timezone.now(), wait=True, wait_seconds=60
            )
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)
        finally:
            connection.close()

    threads = []
    for agent in agents:
        threads.append(threading.Thread(target=fire, args=(agent,)))
        threads[-1].start()
        time.sleep(0.02)  # distinct creation times, so the order is defined
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    assert len(samples) == 5 and max(samples) == 2
    runs = list(HeartbeatRun.objects.order_by("created_at"))
    assert {run.status for run in runs} == {RunStatus.SUCCEEDED}
    # In order: places freed at the same moment are claimed by the oldest waiting runs,
    # between which the start order is a race (two claims, one clock each), so a run may
    # swap with its neighbour but never overtake a run two places older.
    started = sorted(runs, key=lambda run: run.started_at)
    assert all(abs(started.index(run) - created) <= 1 for created, run in enumerate(runs)), [
        runs.index(run) for run in started
    ]


@pytest.mark.django_db(transaction=True)
def test_two_claims_racing_for_the_last_place_under_the_cap_let_one_in(settings, company):
    """The second claim counts while the first's move to `running` is still uncommitted
    (held at a gate inside its update): without serialization (PostgreSQL: the cap's lock;
    SQLite: IMMEDIATE transactions) both would see a free place. The gate opens only once
    the second is seen waiting for a lock."""
    from sessions_app.run_queue import claim_run

    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    now = timezone.now()
    first, second = (heartbeat_enqueue(agent=agent, task="go", now=now)[0] for agent in make_agents(company, 2))

    def claim(run):
        return claim_run(run_id=run.id, now=timezone.now())[1]

    with WriteGate("heartbeat_runs", event="UPDATE", when="NEW.status = 'running'") as gate:
        claim_first = Actor(lambda: claim(first))
        claim_first.start()
        gate.wait_entered()
        claim_second = Actor(lambda: claim(second))
        claim_second.start()
        wait_until_blocked(claim_second)
        gate.open()
        outcomes = {first.id: claim_first.result(), second.id: claim_second.result()}

    assert outcomes == {first.id: True, second.id: False}
    assert HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_a_run_finishing_under_the_cap_wakes_the_oldest_run_of_another_agent_waiting_for_its_place(
    settings, company, fake_anthropic
):
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    busy, older, newer = make_agents(company, 3)
    now = timezone.now()
    first, _ = heartbeat_enqueue(agent=busy, task="first", now=now)
    waiting = [
        heartbeat_enqueue(agent=agent, task="wait", now=now + timedelta(seconds=s))[0]
        for s, agent in ((2, newer), (1, older))
    ]
    refused = []
    fake_anthropic.push(
        Reply.during(
            on_own_connection(lambda: refused.extend(heartbeat_execute(run_id=run.id).status for run in waiting))
        )
    )

    assert heartbeat_execute(run_id=first.id).status == RunStatus.SUCCEEDED

    assert fake_anthropic.action_errors == []
    assert refused == [RunStatus.QUEUED, RunStatus.QUEUED]  # the cap held them while the first ran
    assert dispatched_run_ids() == [str(waiting[1].id)]  # one place: the oldest waiting run


def test_the_maintenance_pass_wakes_waiting_runs_oldest_first_within_the_cap(
    settings, company, django_capture_on_commit_callbacks
):
    from sessions_app.maintenance import queues_unstick

    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 3
    busy, *waiting_agents = make_agents(company, 4)
    now = timezone.now()
    running, _ = heartbeat_enqueue(agent=busy, task="busy", now=now)
    HeartbeatRun.objects.filter(id=running.id).update(status=RunStatus.RUNNING, started_at=now)
    ages = (5, 30, 10)
    waiting = [
        heartbeat_enqueue(agent=agent, task="wait", now=now - timedelta(seconds=age))[0]
        for agent, age in zip(waiting_agents, ages, strict=True)
    ]

    with django_capture_on_commit_callbacks(execute=True):
        assert queues_unstick() == 2
    assert dispatched_run_ids() == [str(waiting[1].id), str(waiting[2].id)]


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (5, "a JSON number, not an object"),
        ("hello", "a JSON string, not an object"),
        (None, "a JSON null, not an object"),
        ([1], "a JSON array, not an object"),
        ({"role": "user", "content": 7}, "its content is not a text or a list of blocks"),
        ({"role": "user"}, "its content is not a text or a list of blocks"),
        ({"content": "hi"}, "its role is not 'user' or 'assistant'"),
    ],
    ids=["number", "string", "null", "array", "content", "no-content", "no-role"],
)
def test_a_history_with_an_entry_that_is_not_a_turn_fails_the_run_naming_it_before_any_call(
    company, fake_anthropic, entry, why
):
    agent = context_agent(company)
    history = conversation(6)
    history.insert(3, entry)  # as a damaged or hand-edited history holds it
    session = make_session(agent, history=history, status=SessionStatus.ACTIVE)

    run = beat(agent, "next")

    assert (run.status, run.error_code, run.error) == (
        RunStatus.FAILED,
        "history_malformed",
        f"The session's history cannot be replayed: entry 4 is not a turn ({why}).",
    )
    assert fake_anthropic.message_requests == []
    session.refresh_from_db()
    assert (session.status, session.message_count, store_for(session).read(session)) == (
        SessionStatus.ACTIVE,
        7,
        history,
    )
    assert beat(agent, "start over", force_fresh=True).status == RunStatus.SUCCEEDED  # the way out docs give


@pytest.mark.django_db(transaction=True)
def test_an_agent_removed_entirely_while_the_model_answers_keeps_the_call_in_the_ledger_and_answers_agent_deleted(
    company, fake_anthropic
):
    """The admin's delete takes the agent's runs with it (its own connection, from inside
    the fake API's answer): the worker finds its run gone, says so as a refusal would, and
    the answered call stays billed."""
    agent = context_agent(company)
    beat(agent, "one")
    remove = on_own_connection(lambda: agents_hard_delete(agents=Agent.objects.filter(pk=agent.pk), now=timezone.now()))
    fake_anthropic.push(Reply.during(remove))

    with pytest.raises(RunRemoved) as removed:
        beat(agent, "two")

    assert fake_anthropic.action_errors == []
    assert removed.value.code == "agent_deleted"
    assert not HeartbeatRun.objects.exists() and not AgentSession.objects.exists()
    billed = CostEvent.objects.filter(agent_id=agent.id, kind=CostKind.MESSAGE)
    assert billed.count() == 2  # both answered calls, the second's run gone


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
@pytest.mark.parametrize("mode", ["stateless", "persistent"])
def test_a_run_queued_while_the_commit_is_committing_is_woken_by_the_release(
    stateless_agent, persistent_agent, fake_anthropic, mode
):
    """On PostgreSQL the release's read of the agent's next queued run goes with the
    commit's statement, after its COMMIT, in one round trip (`hot_sql.write_then_read`). A
    run queued while that COMMIT is still running (held here by a deferred trigger waiting
    for a lock the test holds) was not there when the statement ran, and is there when the
    COMMIT ends: the release must see it, or it would wait queued with nobody to wake it."""
    agent = stateless_agent if mode == "stateless" else persistent_agent
    beat(agent, "first")  # a session to resume
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION held_commit() RETURNS trigger AS $$ BEGIN PERFORM pg_advisory_lock(4242); "
            "PERFORM pg_advisory_unlock(4242); RETURN NULL; END $$ LANGUAGE plpgsql; "
            "CREATE CONSTRAINT TRIGGER held_commit AFTER UPDATE ON heartbeat_runs DEFERRABLE INITIALLY DEFERRED "
            "FOR EACH ROW WHEN (NEW.status = 'succeeded' AND OLD.status = 'running') EXECUTE FUNCTION held_commit();"
            "SELECT pg_advisory_lock(4242);"
        )
    try:
        run, _ = heartbeat_enqueue(agent=agent, task="now", now=timezone.now())
        heartbeat = Actor(lambda: heartbeat_execute(run_id=run.id))
        heartbeat.start()
        wait_until_blocked(heartbeat)  # in its COMMIT, waiting for the test's lock
        queued, _ = heartbeat_enqueue(agent=agent, task="next", now=timezone.now())
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(4242)")
        assert heartbeat.result().status == RunStatus.SUCCEEDED
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS held_commit ON heartbeat_runs; DROP FUNCTION IF EXISTS held_commit();"
            )

    assert dispatched_run_ids() == [str(queued.id)]
