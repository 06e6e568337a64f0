"""Text the databases cannot store as sent (NUL, lone surrogates) is kept with replacement marks."""

from __future__ import annotations

import json

from costs_app.models import CostEvent
from sessions_app.models import AgentSession, RunStatus
from sessions_app.stores import store_for
from tests.conftest import beat, process_agent
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
