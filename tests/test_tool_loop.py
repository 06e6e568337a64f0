"""The tool loop of a heartbeat, through the real SDK and the fake API: memory written and
read across sessions, rounds bounded, every call billed, no half turn in the history."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import Budget, CostEvent
from costs_app.money import usd
from memory_app.models import (
    MemoryAccess,
    MemoryFile,
    MemoryStore,
    MemoryStoreShare,
    MemoryVersion,
    MemoryWriter,
    RunToolLoop,
)
from memory_app.stores import Writer, file_write, mounts_for
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, SessionStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import beat, context_agent, on_own_connection
from tests.fake_anthropic import Reply

FACT = "Remember: the launch code is AZURE-PELICAN-42."


def memory_agent(company, **config) -> Agent:
    return Agent.objects.create(
        company=company,
        name="Rememberer",
        system_prompt="You keep notes.",
        adapter_config={"model": "claude-opus-4-5", "memory": True, **config},
    )


def sent(fake, index: int) -> str:
    return json.dumps(fake.message_requests[index])


def history(agent) -> list:
    session = AgentSession.objects.get(agent=agent, status=SessionStatus.ACTIVE)
    return store_for(session).read(session)


def test_a_remembered_fact_is_written_by_the_run_and_recalled_by_a_stateless_agent(company, fake_anthropic):
    agent = memory_agent(company)
    run = beat(agent, FACT)
    assert run.status == RunStatus.SUCCEEDED, run.error
    stored = MemoryFile.objects.get(store__agent=agent)
    assert stored.content == FACT and stored.path.startswith("facts/")
    version = stored.versions.get()
    assert (version.written_by, version.run_id, version.operation) == (MemoryWriter.RUN, run.id, "create")
    first = fake_anthropic.message_requests[0]
    assert first["tools"] == [{"type": "memory_20250818", "name": "memory"}]
    assert "context-management-2025-06-27" in fake_anthropic.requests[0]["headers"].get("anthropic-beta", "")
    # Stateless: the next heartbeat sends no history, yet the fact comes back from memory.
    fake_anthropic.reset_log()
    recalled = beat(agent, "Recall the launch code.")
    assert recalled.status == RunStatus.SUCCEEDED, recalled.error
    assert "AZURE-PELICAN-42" not in sent(fake_anthropic, 0)
    assert "AZURE-PELICAN-42" in sent(fake_anthropic, -1)
    assert len(fake_anthropic.message_requests) == 3  # view the folder, view the file, answer
    assert RunToolLoop.objects.get(run=recalled).rounds == 2


def test_every_call_of_the_loop_is_one_ledger_row_and_the_run_costs_their_sum(company, fake_anthropic):
    agent = memory_agent(company)
    beat(agent, FACT)
    run = beat(agent, "Recall it.")
    rows = CostEvent.objects.filter(run=run).order_by("call_number")
    assert [row.call_number for row in rows] == [1, 2, 3]
    assert run.cost_usd == sum((row.cost_usd for row in rows), Decimal(0)) > 0
    loop = RunToolLoop.objects.get(run=run)
    assert (loop.rounds, loop.tool_calls, loop.tool_errors) == (2, 2, 0)


def test_a_persistent_session_keeps_each_tool_use_with_its_result(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent")
    run = beat(agent, FACT)
    turns = history(agent)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    use = next(b for b in turns[1]["content"] if b["type"] == "tool_use")
    assert turns[2]["content"][0]["tool_use_id"] == use["id"]
    assert [t["seq"] for t in turns] == [0, 1, 2, 3]
    session = AgentSession.objects.get(agent=agent)
    assert (session.message_count, session.next_seq) == (4, 4)
    assert session.total_cost_usd == run.cost_usd
    # The fake refuses (400) a tool_use without its result: the replayed history is whole.
    assert beat(agent, "And now?").status == RunStatus.SUCCEEDED
    assert len(history(agent)) == 6


def test_tool_rounds_are_bounded_and_over_the_bound_the_run_fails_billed(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent", max_tool_rounds=2)
    beat(agent, "hello")
    before = history(agent)
    writes = [
        Reply.tool_calls({"command": "create", "path": f"/memories/r{n}.md", "file_text": f"round {n}"})
        for n in range(3)
    ]
    fake_anthropic.push(*writes)
    run = beat(agent, "loop forever")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "tool_rounds_exceeded")
    assert "max_tool_rounds" in run.error
    # Three calls made, three rows; the two writes carried out stay; the history is untouched.
    assert CostEvent.objects.filter(run=run).count() == 3
    assert sorted(MemoryFile.objects.values_list("path", flat=True)) == ["r0.md", "r1.md"]
    assert history(agent) == before
    assert RunToolLoop.objects.get(run=run).rounds == 2


def test_a_failure_mid_loop_keeps_the_memory_written_and_leaves_no_half_turn(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent", max_retries=0)
    beat(agent, "hello")
    before = history(agent)
    fake_anthropic.push(
        Reply.tool_calls({"command": "create", "path": "/memories/kept.md", "file_text": "kept"}),
        Reply.error(500, "the model fell over"),
    )
    run = beat(agent, "write and fail")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "model_server_error")
    assert MemoryFile.objects.get(path="kept.md").content == "kept"
    assert history(agent) == before
    assert CostEvent.objects.filter(run=run).count() == 1
    assert beat(agent, "again").status == RunStatus.SUCCEEDED


def test_a_bad_tool_call_is_an_error_result_the_model_reads_not_a_failed_run(company, fake_anthropic):
    agent = memory_agent(company)
    fake_anthropic.push(
        Reply.tool_calls(
            {"command": "view", "path": "/memories/../../etc/passwd"},
            {"command": "create", "path": "/memories/x.md", "file_text": "x" * 70_000},
            {"command": "launch"},
        ),
        Reply.tool_calls({"command": "view", "path": "/memories"}, name="web_search"),
    )
    run = beat(agent, "try things")
    assert run.status == RunStatus.SUCCEEDED, run.error
    results = fake_anthropic.message_requests[1]["messages"][-1]["content"]
    assert [r["is_error"] for r in results] == [True, True, True]
    assert "escape" in results[0]["content"] and "65536" in results[1]["content"]
    unknown = fake_anthropic.message_requests[2]["messages"][-1]["content"][0]
    assert unknown["is_error"] and "Unknown tool" in unknown["content"]
    assert RunToolLoop.objects.get(run=run).tool_errors == 4
    assert not MemoryFile.objects.exists()


def test_a_run_whose_memory_writes_are_all_refused_leaves_no_store(company, fake_anthropic, settings):
    """The refusals a run's write can meet, on an agent with a named store beside its default
    one (NUL never reaches the tool: the reply is stored with U+FFFD): none leaves a store
    behind (before: the run's tool made both stores as it began, so an empty store stayed
    in the admin after every run whose writes were all refused, or that only read)."""
    settings.PAPERCLIP_MEMORY_MAX_STORE_BYTES = 20  # below the file limit: the store's quota refuses first
    agent = memory_agent(company, memory=["team"])
    fake_anthropic.push(
        Reply.tool_calls(
            {"command": "view", "path": "/memories"},
            {"command": "view", "path": "/memories/team/plan.md"},
            {"command": "create", "path": "/memories/../escape.md", "file_text": "x"},
            {"command": "create", "path": "/memories/big.md", "file_text": "x" * 70_000},
            {"command": "create", "path": "/memories/team/full.md", "file_text": "x" * 21},
            {"command": "create", "path": "/memories/team", "file_text": "a folder"},
            {"command": "str_replace", "path": "/memories/a.md", "old_str": "a", "new_str": "b"},
            {"command": "insert", "path": "/memories/team/a.md", "insert_line": 0, "insert_text": "b"},
            {"command": "delete", "path": "/memories/a.md"},
            {"command": "rename", "old_path": "/memories/team/a.md", "new_path": "/memories/team/b.md"},
        ),
    )

    run = beat(agent, "try to remember")

    assert run.status == RunStatus.SUCCEEDED, run.error
    results = fake_anthropic.message_requests[1]["messages"][-1]["content"]
    assert [bool(r.get("is_error")) for r in results] == [False] + [True] * 9, results
    assert "20 bytes" in results[4]["content"]  # the quota, not another refusal
    # Each names the path the model wrote, the named store's folder included.
    assert results[5]["content"] == "/memories/team is a directory; name a file below it."
    assert results[9]["content"] == "The path /memories/team/a.md does not exist."
    assert not MemoryStore.objects.exists()
    assert not MemoryFile.objects.exists()


def test_a_runs_first_write_makes_its_store_and_the_run_reads_it_back(company, fake_anthropic):
    agent = memory_agent(company, memory=["team"])
    fake_anthropic.push(
        Reply.tool_calls({"command": "create", "path": "/memories/team/../x.md", "file_text": "refused"}),
        Reply.tool_calls(
            {"command": "create", "path": "/memories/team/plan.md", "file_text": "ship"},
            {"command": "view", "path": "/memories/team/plan.md"},
            {"command": "str_replace", "path": "/memories/team/plan.md", "old_str": "ship", "new_str": "ship it"},
            {"command": "view", "path": "/memories"},
        ),
    )

    run = beat(agent, "plan")

    assert run.status == RunStatus.SUCCEEDED, run.error
    results = fake_anthropic.message_requests[2]["messages"][-1]["content"]
    assert not any(r.get("is_error") for r in results), results
    assert "ship" in results[1]["content"] and "/memories/team/plan.md" in results[3]["content"]
    assert list(MemoryStore.objects.values_list("name", flat=True)) == ["team"]
    assert MemoryFile.objects.get(store__name="team").content == "ship it"


def test_each_call_of_the_loop_is_reserved_against_the_budget(company, fake_anthropic):
    agent = memory_agent(company, max_tokens=1000)
    big = "word " * 12_000  # 60 kB: read into the second request, which the budget cannot hold
    file_write(mounts_for(agent)[0], "big.md", lambda current: big, operation="create", writer=Writer(operator="ops"))
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.10"))
    fake_anthropic.push(*[Reply.tool_calls({"command": "view", "path": "/memories/big.md"}) for _ in range(3)])
    run = beat(agent, "read the big file")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert CostEvent.objects.filter(run=run).count() == 1  # the first call, billed; the second never sent
    assert len(fake_anthropic.message_requests) == 1
    spent = sum(CostEvent.objects.values_list("cost_usd", flat=True), Decimal(0))
    assert 0 < spent <= Decimal("0.10")


@pytest.mark.django_db(transaction=True)
def test_each_call_offering_the_tool_holds_at_least_what_it_is_billed(company, fake_anthropic):
    """The API adds a tool-use system prompt to every request that offers tools, billed as
    input but absent from the request's bytes: each call of the loop must hold it too."""
    fake_anthropic.tool_prompt_tokens = 804  # the largest figure Anthropic publishes
    agent = memory_agent(company, max_tokens=16)  # a small answer: the input decides
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))  # far: held by the byte bound
    held = []

    def look():
        held.append(HeartbeatRun.objects.get(agent=agent, status=RunStatus.RUNNING).reserved_usd)

    fake_anthropic.push(*[Reply.during(on_own_connection(look)) for _ in range(2)])
    run = beat(agent, "remember: the tea is green")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert fake_anthropic.action_errors == []
    billed = list(CostEvent.objects.filter(run=run).order_by("call_number").values_list("cost_usd", flat=True))
    assert len(billed) == len(held) == 2  # the memory write, then the answer
    assert all(hold >= cost for hold, cost in zip(held, billed, strict=True)), (held, billed)


@pytest.mark.parametrize("ending", ["force_fresh", "expiry", "rotation", "deletion"])
def test_memory_outlives_the_session(company, fake_anthropic, ending):
    agent = memory_agent(company, session_mode="persistent", session_ttl_hours=1, rotate_after_turns=5)
    now = timezone.now()
    assert beat(agent, FACT, now=now).status == RunStatus.SUCCEEDED
    first = AgentSession.objects.get(agent=agent)
    kwargs = {}
    later = now + timedelta(minutes=1)
    if ending == "force_fresh":
        kwargs["force_fresh"] = True
    elif ending == "expiry":
        later = now + timedelta(hours=2)
    elif ending == "rotation":
        for n in range(5):
            beat(agent, f"filler {n}", now=now + timedelta(seconds=n + 1))
    else:
        session_delete(session=first, now=now)
    fake_anthropic.reset_log()
    run = beat(agent, "Recall the launch code.", now=later, **kwargs)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.session_id != first.id
    # The memory tool brings the fact back, whatever the new session holds.
    results = fake_anthropic.message_requests[-1]["messages"][-1]["content"]
    assert any("AZURE-PELICAN-42" in r["content"] for r in results if r["type"] == "tool_result")
    if ending != "rotation":  # a rotated session opens with a handoff note about the old one
        assert "AZURE-PELICAN-42" not in json.dumps(fake_anthropic.message_requests[0]["messages"])


def test_summarising_a_session_of_tool_loops_never_splits_a_tool_use_from_its_result(company, fake_anthropic):
    agent = context_agent(company, memory=True, context_budget_tokens=1500, keep_recent_turns=1)
    for n in range(8):
        run = beat(agent, f"Remember fact {n}: {'detail ' * 30}")
        assert run.status == RunStatus.SUCCEEDED, (n, run.error_code, run.error)
    session = AgentSession.objects.get(agent=agent, status=SessionStatus.ACTIVE)
    assert session.compaction_count >= 1
    turns = store_for(session).read(session)
    for index, turn in enumerate(turns):
        if any(b.get("type") == "tool_result" for b in turn["content"] if isinstance(b, dict)):
            assert any(b.get("type") == "tool_use" for b in turns[index - 1]["content"])
    assert MemoryFile.objects.filter(store__agent=agent).count() == 8


def test_clear_tool_uses_sends_the_edit_and_reports_what_was_cleared(company, fake_anthropic):
    # A budget that no summary trims (the defaults would): clearing is what bounds it here.
    agent = memory_agent(
        company,
        session_mode="persistent",
        context_budget_tokens=100_000,
        clear_tool_uses={"trigger_input_tokens": 1000, "keep_tool_uses": 1},
    )
    for n in range(6):
        beat(agent, f"Remember item {n}: {'padding ' * 60}")
    run = beat(agent, "Remember the last one too.")
    edits = fake_anthropic.message_requests[-1]["context_management"]["edits"]
    assert edits == [
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 1000},
            "keep": {"type": "tool_uses", "value": 1},
        }
    ]
    loop = RunToolLoop.objects.get(run=run)
    assert loop.cleared_tool_uses > 0 and loop.cleared_input_tokens > 0


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_heartbeats_sharing_a_store_lose_no_write(postgres_only, company, fake_anthropic):
    owner = memory_agent(company, memory=["team"])
    guest = Agent.objects.create(
        company=company, name="Guest", adapter_config={"model": "claude-opus-4-5", "memory": ["team"]}
    )
    team = MemoryStore.objects.create(company=company, agent=owner, name="team")
    MemoryStoreShare.objects.create(store=team, agent=guest, access=MemoryAccess.WRITE)
    file_write(
        mounts_for(owner)[1], "log.md", lambda current: "start", operation="create", writer=Writer(operator="ops")
    )
    # Both runs' first answers arrive together, each an insert into the same file.
    both_asked = threading.Barrier(2)
    fake_anthropic.push(
        *[
            Reply.tool_calls(
                {"command": "insert", "path": "/memories/team/log.md", "insert_line": 1, "insert_text": f"line {n}"},
                before=lambda: both_asked.wait(10),
            )
            for n in range(2)
        ]
    )
    runs = {}

    def run(agent):
        try:
            runs[agent.name] = beat(agent, "note it")
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(agent,)) for agent in (owner, guest)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {r.status for r in runs.values()} == {RunStatus.SUCCEEDED}
    log = MemoryFile.objects.get(store=team, path="log.md")
    assert set(log.content.split("\n")) == {"start", "line 0", "line 1"}
    assert log.version == 3
    assert {v.run_id for v in log.versions.filter(number__gt=1)} == {r.id for r in runs.values()}
    assert HeartbeatRun.objects.filter(status=RunStatus.SUCCEEDED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_run_reaped_as_its_tool_call_arrives_commits_no_memory_write(company, fake_anthropic):
    """The reaper fails the run (on its own connection) while the model's answer asking to
    write memory is on its way: a reaped run commits nothing, a memory write included."""
    from sessions_app.maintenance import runs_reap

    agent = memory_agent(company)
    reaped = []

    def reaper_past_the_deadline():
        run = HeartbeatRun.objects.get(agent=agent)
        reaped.extend(runs_reap(now=run.deadline_at + timedelta(seconds=1)))

    fake_anthropic.push(
        Reply.tool_calls(
            {"command": "create", "path": "/memories/late.md", "file_text": "late"},
            before=on_own_connection(reaper_past_the_deadline),
        )
    )

    run = beat(agent, "write it down")

    assert fake_anthropic.action_errors == []
    assert reaped == [agent.id]
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    assert not MemoryFile.objects.exists()
    assert not MemoryVersion.objects.exists()
    assert len(fake_anthropic.message_requests) == 1  # and no further call
    assert CostEvent.objects.filter(run=run).count() == 1  # the call made is billed


@pytest.mark.django_db(transaction=True)
def test_a_reaper_arriving_during_a_memory_write_waits_for_it(postgres_only, company, fake_anthropic):
    """The worst moment: the write has checked that its run is running and not committed yet
    (held open by a trigger waiting for a lock the test holds) when the reaper fails the
    run. The reaper waits for the write's lock on the run, so the write committed while its
    run was running."""
    from sessions_app.maintenance import runs_reap

    agent = memory_agent(company)
    run, _ = heartbeat_enqueue(agent=agent, task="write", now=timezone.now())
    HeartbeatRun.objects.filter(id=run.id).update(
        status=RunStatus.RUNNING, started_at=timezone.now(), deadline_at=timezone.now() + timedelta(minutes=5)
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION held_version() RETURNS trigger AS $$ BEGIN PERFORM pg_advisory_xact_lock(4242); "
            "RETURN NEW; END $$ LANGUAGE plpgsql; CREATE TRIGGER held_version BEFORE INSERT ON memory_versions "
            "FOR EACH ROW EXECUTE FUNCTION held_version(); SELECT pg_advisory_lock(4242);"
        )
    seen = []

    def write():
        try:
            file_write(
                mounts_for(agent)[0],
                "kept.md",
                lambda current: "kept",
                operation="create",
                writer=Writer(run_id=run.id),
            )
        finally:
            connection.close()

    def reap():
        try:
            runs_reap(now=timezone.now() + timedelta(hours=1))
        finally:
            connection.close()

    writer = threading.Thread(target=write)
    reaper = threading.Thread(target=reap)
    writer.start()
    try:
        seen.append(wait_for_activity('%INSERT INTO "memory_versions"%', waiting_on_lock=True))
        reaper.start()
        seen.append(wait_for_activity('UPDATE "heartbeat_runs"%', waiting_on_lock=True))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(4242)")
        writer.join(30)
        if reaper.ident is not None:
            reaper.join(30)
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS held_version ON memory_versions; DROP FUNCTION IF EXISTS held_version();"
            )

    assert seen == [True, True]  # the write held open, then the reaper waiting (without the lock: not)
    assert MemoryVersion.objects.get(file__path="kept.md").run_id == run.id
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")


def wait_for_activity(statement_like: str, *, waiting_on_lock: bool = False) -> bool:
    """Wait until another connection runs a statement like `statement_like` (and, when
    asked, is waiting for a lock); True once seen, False after 10 s (PostgreSQL)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE %s AND state = 'active' "
                "AND pid <> pg_backend_pid() AND (NOT %s OR wait_event_type = 'Lock')",
                [statement_like, waiting_on_lock],
            )
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.02)
    return False


def test_the_run_api_reports_the_tool_loop(company, fake_anthropic, client):
    agent = memory_agent(company)
    plain = beat(agent, "say hello")
    run = beat(agent, FACT)
    base = f"/api/companies/{company.id}/agents/{agent.id}/runs"
    assert client.get(f"{base}/{plain.id}").json()["tool_loop"] is None
    detail = client.get(f"{base}/{run.id}").json()
    assert detail["tool_loop"] == {
        "rounds": 1,
        "tool_calls": 1,
        "tool_errors": 0,
        "cleared_tool_uses": 0,
        "cleared_input_tokens": 0,
    }
    assert [r["tool_loop"] is not None for r in client.get(base).json()["runs"]] == [True, False]


def test_a_round_of_a_live_session_is_billed_to_it_at_once(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent")
    beat(agent, "hello")
    session = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(
        Reply.tool_calls({"command": "create", "path": "/memories/a.md", "file_text": "a"}),
        Reply.error(400, "refused"),
    )
    run = beat(agent, "write then fail")
    assert run.error_code == "model_bad_request"
    # The round's row was written when its call returned, naming the session it ran in.
    row = CostEvent.objects.get(run=run)
    assert (row.call_number, row.session_id) == (1, session.id)


def test_the_rounds_of_the_run_that_starts_a_session_are_billed_to_that_session(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent")

    run = beat(agent, FACT)  # a round (the memory write), then the answer that creates the session

    session = AgentSession.objects.get(agent=agent)
    rows = CostEvent.objects.filter(run=run).order_by("call_number")
    assert [(row.call_number, row.session_id) for row in rows] == [(1, session.id), (2, session.id)]
    assert session.total_cost_usd == sum((row.cost_usd for row in rows), Decimal(0)) > 0


@pytest.mark.django_db(transaction=True)
def test_when_the_commit_that_starts_the_session_fails_its_rounds_stay_billed_to_no_session(
    company, fake_anthropic, refuse_at_commit
):
    agent = memory_agent(company, session_mode="persistent")
    refuse_at_commit("agent_sessions", when="1 = 1", event="INSERT")

    run = beat(agent, FACT)  # a round billed at once, then the answer whose commit fails

    assert run.status == RunStatus.FAILED
    assert not AgentSession.objects.exists()
    rows = CostEvent.objects.filter(run=run).order_by("call_number")
    # Every call is billed once, and none names a session that was never created.
    assert [(row.call_number, row.session_id) for row in rows] == [(1, None), (2, None)]


def test_memory_is_a_claude_code_setting_only():
    from sessions_app.adapters import AgentConfigError, validate_agent_config

    with pytest.raises(AgentConfigError) as refused:
        validate_agent_config("process", {"command": ["true"], "memory": True})
    assert "adapter_config.memory" in refused.value.fields


def test_a_tool_rounds_cost_in_the_history_is_money_by_the_one_rule(company, fake_anthropic):
    agent = memory_agent(company, session_mode="persistent")
    beat(agent, FACT)
    costs = [turn["cost_usd"] for turn in history(agent) if turn["role"] == "assistant"]
    assert len(costs) == 2
    assert costs == [usd(Decimal(cost)) for cost in costs]


def test_a_batch_run_with_tools_is_reserved_at_the_direct_price_it_is_billed_at(company, fake_anthropic):
    # Tools are a beta the Batches API is not sent: the call goes direct, so its
    # reservation must hold the direct price (twice the batch one), tools included.
    agent = memory_agent(company, max_tokens=1000)
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.02"))
    fake_anthropic.push(Reply.message("done", usage={"input_tokens": 10, "output_tokens": 1000}))
    run = beat(agent, "note nothing", delivery="batch")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert fake_anthropic.message_requests == [] and not CostEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_agent_deleted_as_its_tool_call_arrives_gains_no_memory(company, fake_anthropic):
    """The agent is deleted (its own connection) while the model's answer asking to write
    memory is on its way: its deletion took its memory, and the run writes none back."""
    from memory_app.models import MemoryStore
    from sessions_app.services import agent_delete

    agent = memory_agent(company)
    fake_anthropic.push(
        Reply.tool_calls(
            {"command": "create", "path": "/memories/late.md", "file_text": "late"},
            before=on_own_connection(lambda: agent_delete(agent=agent, now=timezone.now())),
        )
    )

    run = beat(agent, "write it down")

    assert fake_anthropic.action_errors == []
    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted"), run.error
    assert not MemoryStore.objects.filter(agent=agent).exists()
    assert not MemoryFile.objects.exists()
    assert len(fake_anthropic.message_requests) == 1  # and no further call
    assert CostEvent.objects.filter(run=run).count() == 1  # the call made is billed


@pytest.mark.django_db(transaction=True)
def test_a_run_whose_agent_was_deleted_before_its_memory_is_mounted_fails_agent_deleted(company):
    """The deletion commits between the run's claim and the mount of its memory: no store is
    made, and the run fails as deleted before its call."""
    from types import SimpleNamespace

    from memory_app.models import MemoryStore
    from sessions_app.errors import RunAbandoned
    from sessions_app.services import agent_delete
    from sessions_app.tool_loop import memory_tool_for

    agent = memory_agent(company)
    run, _ = heartbeat_enqueue(agent=agent, task="write", now=timezone.now())
    claimed = Agent.objects.get(pk=agent.pk)  # as the claim read it
    agent_delete(agent=agent, now=timezone.now())

    with pytest.raises(RunAbandoned) as abandoned:
        memory_tool_for(SimpleNamespace(agent=claimed, run=run))

    assert abandoned.value.code == "agent_deleted"
    assert not MemoryStore.objects.filter(agent=agent).exists()
