"""Answers the databases cannot store as sent, and failures nobody planned for.

Whatever goes wrong after the model answered, the call was billed: the answer is kept
when it can be, and the ledger records the call either way.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal

import pytest

from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.models import Agent, AgentSession, RunStatus
from sessions_app.stores import store_for
from tests.conftest import beat, process_agent, refuse_writes
from tests.fake_anthropic import Reply, strip_markers

UNSTORABLE = "before\x00after \ud800 lone"  # NUL (PostgreSQL refuses it) and a lone surrogate
STORED = "before\ufffdafter \ufffd lone"


def test_an_answer_with_nul_and_lone_surrogates_is_kept_with_replacement_marks(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.message(UNSTORABLE))

    run = beat(persistent_agent, "first")

    assert (run.status, run.error_code, run.output) == (RunStatus.SUCCEEDED, "", STORED)
    session = AgentSession.objects.get(agent=persistent_agent)
    assert store_for(session).read(session)[1]["content"] == [{"type": "text", "text": STORED}]
    assert CostEvent.objects.get(run=run).message_id == run.message_id
    # The next request replays the answer as stored.
    assert beat(persistent_agent, "second").status == RunStatus.SUCCEEDED
    replayed = strip_markers(fake_anthropic.message_requests[-1]["messages"][1]["content"])
    assert replayed == [{"type": "text", "text": STORED}]


def test_an_agent_command_printing_nul_is_stored_and_its_failure_reported(company, tmp_path):
    answer = json.dumps({"text": UNSTORABLE, "usage": {"input_tokens": 5, "output_tokens": 2}})
    ok = process_agent(company, tmp_path, f"import sys\nsys.stdin.read()\nprint({answer!r})\n")
    run = beat(ok, "go")
    assert (run.status, run.output) == (RunStatus.SUCCEEDED, STORED)

    failing = process_agent(
        company, tmp_path, "import sys\nsys.stdin.read()\nsys.stderr.write('bad\\x00byte')\nsys.exit(3)\n"
    )
    run = beat(failing, "go")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_failed")
    assert run.error.endswith("bad\ufffdbyte")


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": 10**20, "output_tokens": 1},
        {"input_tokens": -5, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": "many"},
        {"input_tokens": 1, "output_tokens": 1, "iterations": [{"type": "compaction", "input_tokens": 10**12}]},
        {"input_tokens": 1, "output_tokens": 1, "iterations": "all of them"},
    ],
    ids=["overflow", "negative", "not-a-number", "iteration-overflow", "iterations-not-a-list"],
)
def test_an_impossible_usage_report_fails_the_run_clearly(company, tmp_path, usage):
    assert_refused_as_malformed(company, tmp_path, {"text": "done", "usage": usage}, "usage")


@pytest.mark.parametrize("field", ["message_id", "stop_reason"])
def test_an_identifier_longer_than_its_column_fails_the_run_clearly(company, tmp_path, field):
    answer = {"text": "done", "usage": {"input_tokens": 1, "output_tokens": 1}, field: "x" * 300}
    assert_refused_as_malformed(company, tmp_path, answer, field)


def test_an_answer_nested_too_deep_to_parse_fails_the_run_clearly(company, tmp_path):
    agent = process_agent(company, tmp_path, "import sys\nsys.stdin.read()\nprint('[' * 100000)\n")

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_malformed_response")


def test_an_artifact_line_nested_too_deep_is_ignored(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.message('done\nARTIFACT {"name": "deep", "kind": ' + "[" * 100000 + "}"))

    run = beat(persistent_agent, "go")

    assert (run.status, AgentSession.objects.get(agent=persistent_agent).manifest) == (RunStatus.SUCCEEDED, [])


def assert_refused_as_malformed(company, tmp_path, answer: dict, mentioned: str) -> None:
    answer = json.dumps(answer)
    agent = process_agent(company, tmp_path, f"import sys\nsys.stdin.read()\nprint({answer!r})\n")

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_malformed_response")
    assert mentioned in run.error
    assert not CostEvent.objects.exists()
    assert not AgentSession.objects.filter(agent=agent, message_count__gt=0).exists()


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


def rotating_agent(company) -> Agent:
    return Agent.objects.create(
        company=company,
        name="rotating",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "rotate_after_turns": 2},
    )


def test_a_handoff_note_is_recorded_when_the_new_session_cannot_be_written(company, fake_anthropic):
    agent = rotating_agent(company)
    for i in range(2):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    refuse_writes("agent_sessions", when="1 = 1", event="INSERT")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "turn 2")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 2  # the handoff note, then the turn
    assert sorted(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == sorted(
        [CostKind.COMPACTION, CostKind.MESSAGE]
    )
    assert AgentSession.objects.filter(agent=agent).count() == 1


def test_a_handoff_note_is_recorded_when_the_run_breaks_before_its_turn_is_sent(company, fake_anthropic):
    agent = rotating_agent(company)
    for i in range(2):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    # The note's reservation goes through; the turn's (the second on this run) breaks.
    refuse_writes("heartbeat_runs", when="OLD.reserved_usd > 0 AND NEW.reserved_usd > 0")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "turn 2")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 1  # the note only
    assert list(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == [CostKind.COMPACTION]


def test_a_summary_whose_compaction_cannot_be_written_is_still_in_the_ledger(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="summarising",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_budget_tokens": 1000,
            "keep_recent_turns": 1,
        },
    )
    for _ in range(3):
        assert beat(agent, "x" * 400).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    refuse_writes("session_compactions", when="1 = 1", event="INSERT")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 1  # the summary; the turn was never sent
    assert list(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == [CostKind.COMPACTION]
    session.refresh_from_db()
    assert (session.compaction_count, store_for(session).read(session)) == (0, before)


def test_an_agent_command_that_prints_without_end_is_killed_at_the_output_limit(settings, company, tmp_path):
    settings.PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES = 200_000
    pid_file = tmp_path / "pid"
    agent = process_agent(
        company,
        tmp_path,
        f"import os, sys\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "while True:\n    sys.stdout.write('x' * 65536)\n",
    )

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_output_too_large")
    assert "PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES" in run.error
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_an_agent_command_printing_bytes_that_are_not_utf8_is_read_with_replacement_marks(company, tmp_path):
    agent = process_agent(
        company,
        tmp_path,
        "import sys\nsys.stdin.read()\n"
        'sys.stdout.buffer.write(b\'{"text": "caf\\xe9", "usage": {"input_tokens": 1, "output_tokens": 1}}\')\n',
    )

    run = beat(agent, "go")

    assert (run.status, run.output) == (RunStatus.SUCCEEDED, "caf\ufffd")


def test_a_request_larger_than_a_pipe_reaches_a_slow_reader_whole(company, tmp_path):
    agent = process_agent(
        company,
        tmp_path,
        "import json, sys, time\ntime.sleep(0.3)\nrequest = json.load(sys.stdin)\n"
        "print(json.dumps({'text': str(len(request['messages'][-1]['content']))}))\n",
    )

    run = beat(agent, "y" * 90_000)  # over the 64 KiB a pipe holds

    assert (run.status, run.output) == (RunStatus.SUCCEEDED, "90000")


@pytest.mark.parametrize(
    "answer",
    [Reply.message(content=[]), Reply.message("  \n "), Reply.message(content=[{"type": "text", "text": ""}])],
    ids=["no-content", "whitespace", "empty-text-block"],
)
def test_an_empty_answer_does_not_break_the_session(persistent_agent, fake_anthropic, answer):
    # The API refuses empty messages and blank text blocks in earlier turns, yet models do
    # answer with no content (stop_reason end_turn, content []); replayed as stored, such a
    # turn would fail every later heartbeat of the session with a 400.
    fake_anthropic.push(answer)
    assert beat(persistent_agent, "first").status == RunStatus.SUCCEEDED

    second = beat(persistent_agent, "second")
    third = beat(persistent_agent, "third")

    assert [second.status, third.status] == [RunStatus.SUCCEEDED, RunStatus.SUCCEEDED], second.error
    replayed = strip_markers(fake_anthropic.message_requests[-1]["messages"][1]["content"])
    assert replayed in ("(no content)", [{"type": "text", "text": "(no content)"}])
    session = AgentSession.objects.get(agent=persistent_agent)
    assert session.message_count == 6  # the empty answer is kept as the model gave it
