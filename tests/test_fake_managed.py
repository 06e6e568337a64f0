"""The Managed Agents fake, driven through the real anthropic SDK."""

import inspect
import time
import typing
from decimal import Decimal

import anthropic
import pydantic
import pytest
from anthropic.types.beta import (
    BetaDeletedFile,
    BetaEnvironment,
    BetaEnvironmentDeleteResponse,
    BetaFileMetadata,
    BetaManagedAgentsAgent,
    BetaManagedAgentsDeletedSession,
    BetaManagedAgentsSession,
)
from anthropic.types.beta.sessions import (
    BetaManagedAgentsDeleteSessionResource,
    BetaManagedAgentsFileResource,
    BetaManagedAgentsSendSessionEvents,
    BetaManagedAgentsSessionEvent,
)

from tests.fake_managed import FakeManaged


def union_members(union) -> list[type]:
    if inspect.isclass(union) and issubclass(union, pydantic.BaseModel):
        return [union]
    return [member for arg in typing.get_args(union) for member in union_members(arg)]


# The SDK's event union is annotated for its own discriminator, so each event is validated
# against the one model its `type` names.
EVENT_MODELS = {m.model_fields["type"].annotation.__args__[0]: m for m in union_members(BetaManagedAgentsSessionEvent)}


def assert_no_extra(value, where: str) -> None:
    """The SDK's models allow extra keys; an answer that carried any would not be the API's shape."""
    if isinstance(value, pydantic.BaseModel):
        assert not value.model_extra, f"{where}: unexpected {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            assert_no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            assert_no_extra(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            assert_no_extra(item, f"{where}[{key!r}]")


def strict(model: type[pydantic.BaseModel], payload: dict):
    parsed = model.model_validate(payload)
    assert_no_extra(parsed, model.__name__)
    return parsed


def strict_event(payload: dict):
    return strict(EVENT_MODELS[payload["type"]], payload)


@pytest.fixture
def managed():
    fake = FakeManaged().start()
    yield fake
    fake.stop()


@pytest.fixture
def client(managed):
    return anthropic.Anthropic(api_key="test-key", base_url=managed.base_url, max_retries=0)


@pytest.fixture
def session(client):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5")
    environment = client.beta.environments.create(name="box")
    return client.beta.sessions.create(agent=agent.id, environment_id=environment.id)


def user_message(text: str) -> dict:
    return {"type": "user.message", "content": [{"type": "text", "text": text}]}


def turn(client, session_id: str, event: dict) -> list:
    """Open the stream, send, read until the session stops: what a worker does."""
    with client.beta.sessions.events.stream(session_id) as stream:
        client.beta.sessions.events.send(session_id, events=[event])
        seen = []
        for received in stream:
            seen.append(received)
            if received.type in ("session.status_idle", "session.status_terminated"):
                return seen
    raise AssertionError("the stream ended before the session stopped")


def wait_status(client, session_id: str, status: str, timeout: float = 2.0):
    deadline = time.monotonic() + timeout
    while (fetched := client.beta.sessions.retrieve(session_id)).status != status:
        assert time.monotonic() < deadline, f"still {fetched.status}"
        time.sleep(0.01)
    return fetched


# Agents and sessions


def test_an_agent_created_validates_as_the_sdks_model(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5", system="Be brief.")
    strict(BetaManagedAgentsAgent, managed.agents[agent.id])
    assert agent.version == 1
    assert client.beta.agents.retrieve(agent.id).system == "Be brief."


def test_an_update_makes_a_new_version_and_a_stale_one_is_refused(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5")
    updated = client.beta.agents.update(agent.id, version=1, system="New prompt.")
    assert updated.version == 2
    strict(BetaManagedAgentsAgent, managed.agents[agent.id])
    with pytest.raises(anthropic.ConflictError):
        client.beta.agents.update(agent.id, version=1, system="Stale.")
    assert client.beta.agents.retrieve(agent.id).version == 2


def test_a_missing_agent_is_a_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError):
        client.beta.agents.retrieve("agent_missing")


def test_a_session_keeps_the_agent_version_it_was_created_with(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5")
    session = client.beta.sessions.create(agent=agent.id, environment_id="env_1")
    client.beta.agents.update(agent.id, version=1, system="Changed.")
    strict(BetaManagedAgentsSession, managed.sessions[session.id])
    fetched = client.beta.sessions.retrieve(session.id)
    assert (fetched.status, fetched.agent.version) == ("idle", 1)


def test_a_session_archived_then_deleted_is_gone_with_its_events(client, managed, session):
    assert client.beta.sessions.archive(session.id).archived_at is not None
    deleted = client.beta.sessions.delete(session.id)
    strict(BetaManagedAgentsDeletedSession, deleted.model_dump())
    with pytest.raises(anthropic.NotFoundError):
        client.beta.sessions.retrieve(session.id)
    with pytest.raises(anthropic.NotFoundError):
        client.beta.sessions.events.list(session.id)


def test_every_managed_agents_request_carries_the_beta_header(client, managed, session):
    turn(client, session.id, user_message("hi"))
    client.beta.sessions.events.list(session.id)
    assert managed.beta_headers
    assert all("managed-agents-2026-04-01" in (h or "") for h in managed.beta_headers)
    assert ("GET", f"/v1/sessions/{session.id}/events/stream") in managed.requests


# Environments


def test_an_environment_is_created_updated_archived_and_deleted(client, managed):
    limited = {"type": "limited", "allowed_hosts": ["pypi.org"], "allow_package_managers": True}
    config = {"type": "cloud", "networking": limited, "packages": {"pip": ["pandas"]}}
    created = client.beta.environments.create(name="box", config=config, metadata={"team": "a"})
    strict(BetaEnvironment, managed.environments[created.id])
    assert created.config.networking.allowed_hosts == ["pypi.org"]
    assert created.config.packages.pip == ["pandas"]

    updated = client.beta.environments.update(created.id, description="d", config={"type": "cloud"})
    strict(BetaEnvironment, managed.environments[created.id])
    assert (updated.description, updated.config.networking.type) == ("d", "limited")
    opened = client.beta.environments.update(
        created.id, config={"type": "cloud", "networking": {"type": "unrestricted"}}
    )
    assert opened.config.networking.type == "unrestricted"
    assert client.beta.environments.retrieve(created.id).config.packages.pip == ["pandas"]

    assert client.beta.environments.archive(created.id).archived_at is not None
    deleted = client.beta.environments.delete(created.id)
    strict(BetaEnvironmentDeleteResponse, deleted.model_dump())
    with pytest.raises(anthropic.NotFoundError):
        client.beta.environments.retrieve(created.id)


def test_environments_are_listed_page_by_page(client):
    for i in range(3):
        client.beta.environments.create(name=f"box{i}")
    first = client.beta.environments.list(limit=2)
    assert len(first.data) == 2 and first.has_next_page()
    assert [e.name for e in first] == ["box0", "box1", "box2"]


# Turns


def test_a_streamed_turn_gives_its_events_in_order_each_in_the_sdks_shape(client, managed, session):
    seen = turn(client, session.id, user_message("hello"))
    assert [e.type for e in seen] == [
        "user.message",
        "session.status_running",
        "span.model_request_start",
        "agent.message",
        "span.model_request_end",
        "session.status_idle",
    ]
    for payload in managed.events[session.id]:
        strict_event(payload)
    assert seen[3].content[0].text == "reply 1: hello"
    assert seen[4].model_request_start_id == seen[2].id
    assert seen[4].model_usage.input_tokens == 100
    assert seen[5].stop_reason.type == "end_turn"
    assert seen[0].id.startswith("sevt_") and seen[0].processed_at is not None


def test_the_send_answer_is_the_sdks_shape(client, session):
    raw = client.beta.sessions.events.with_raw_response.send(session.id, events=[user_message("hi")])
    sent = strict(BetaManagedAgentsSendSessionEvents, raw.http_response.json())
    assert [e.type for e in sent.data] == ["user.message"]
    wait_status(client, session.id, "idle")


def test_the_default_reply_counts_the_messages_so_the_context_is_kept(client, managed, session):
    turn(client, session.id, user_message("one"))
    second = turn(client, session.id, user_message("two"))
    reply = next(e for e in second if e.type == "agent.message")
    assert reply.content[0].text == "reply 2: two"
    assert managed.user_messages[session.id] == ["one", "two"]
    usage = client.beta.sessions.retrieve(session.id).usage
    assert (usage.input_tokens, usage.output_tokens) == (300, 40)


def test_active_seconds_and_list_cost_grow_per_turn(client, managed, session):
    assert client.beta.sessions.retrieve(session.id).usage.list_cost is None  # until a list price is set
    managed.active_seconds_per_turn = 7.5
    managed.list_price = {
        "input": Decimal("0.003"),
        "output": Decimal("0.015"),
        "cache_read": Decimal("0.0003"),
        "cache_write": Decimal("0.00375"),
    }
    turn(client, session.id, user_message("one"))
    fetched = client.beta.sessions.retrieve(session.id)
    assert (fetched.usage.active_seconds, fetched.stats.active_seconds) == (7.5, 7.5)
    # In whole cents, as the API counts: 100 input and 20 output tokens cost $0.60.
    assert (fetched.usage.list_cost.amount, fetched.usage.list_cost.currency) == ("60", "USD")
    usage = {
        "input_tokens": 10,
        "output_tokens": 1,
        "cache_creation_input_tokens": 100,
        "cache_read_input_tokens": 1000,
    }
    managed.script(session.id, [("message", "cached", usage)])
    turn(client, session.id, user_message("two"))
    fetched = client.beta.sessions.retrieve(session.id)
    strict(BetaManagedAgentsSession, managed.sessions[session.id])
    assert fetched.stats.active_seconds == 15.0
    assert (fetched.usage.cache_read_input_tokens, fetched.usage.cache_creation.ephemeral_5m_input_tokens) == (
        1000,
        100,
    )
    # $0.60 + $0.72 (10 * 0.003 + 0.015 + 100 * 0.00375 + 1000 * 0.0003)
    assert fetched.usage.list_cost.amount == "132"
    assert managed.list_costs[session.id] == Decimal("1.32")


def test_a_script_for_any_session_serves_the_next_message(client, managed, session):
    managed.script(None, [("message", "scripted", {"input_tokens": 5, "output_tokens": 6})])
    seen = turn(client, session.id, user_message("hi"))
    assert [e.content[0].text for e in seen if e.type == "agent.message"] == ["scripted"]
    assert next(e for e in seen if e.type == "span.model_request_end").model_usage.output_tokens == 6


# Events list


def test_events_are_listed_page_by_page_with_order_and_type_filters(client, managed, session):
    turn(client, session.id, user_message("one"))
    turn(client, session.id, user_message("two"))
    everything = [e.type for e in client.beta.sessions.events.list(session.id, limit=5)]
    assert len(everything) == 12 and everything[0] == "user.message"
    page = client.beta.sessions.events.list(session.id, limit=5)
    assert len(page.data) == 5 and page.next_page
    assert (
        client.beta.sessions.events.list(session.id, limit=5, page=page.next_page).data[0].type == "session.status_idle"
    )
    newest = client.beta.sessions.events.list(session.id, order="desc", limit=1).data[0]
    assert newest.type == "session.status_idle"
    messages = client.beta.sessions.events.list(session.id, types=["user.message", "agent.message"])
    assert [e.type for e in messages] == ["user.message", "agent.message"] * 2
    after = client.beta.sessions.events.list(session.id, created_at_gt=managed.events[session.id][5]["processed_at"])
    assert [e.type for e in after][0] == "user.message"
    for payload in managed.events[session.id]:
        strict_event(payload)


# Tools and confirmations


def test_an_allowed_tool_is_followed_by_its_result(client, managed, session):
    managed.script(session.id, [("tool", "bash", {"command": "ls"}, "always_allow", "a.txt"), ("message", "listed")])
    seen = turn(client, session.id, user_message("list"))
    use = next(e for e in seen if e.type == "agent.tool_use")
    result = next(e for e in seen if e.type == "agent.tool_result")
    assert (use.evaluated_permission, use.evaluation.type) == ("allow", "always_allow")
    assert (result.tool_use_id, result.content[0].text, result.is_error) == (use.id, "a.txt", False)
    assert seen[-1].stop_reason.type == "end_turn"
    for payload in managed.events[session.id]:
        strict_event(payload)


@pytest.mark.parametrize(
    ("confirmation", "text", "is_error"),
    [
        ({"result": "allow"}, "bash: done", False),
        ({"result": "deny", "deny_message": "not here"}, "Tool use denied by the user: not here", True),
    ],
)
def test_a_tool_that_asks_waits_for_the_confirmation(client, managed, session, confirmation, text, is_error):
    managed.script(session.id, [("tool", "bash", {"command": "rm x"}, "always_ask"), ("message", "after")])
    asked = turn(client, session.id, user_message("clean"))
    use = next(e for e in asked if e.type == "agent.tool_use")
    assert use.evaluated_permission == "ask"
    assert (asked[-1].stop_reason.type, asked[-1].stop_reason.event_ids) == ("requires_action", [use.id])
    assert client.beta.sessions.retrieve(session.id).status == "idle"

    confirm = {"type": "user.tool_confirmation", "tool_use_id": use.id, **confirmation}
    resumed = turn(client, session.id, confirm)
    result = next(e for e in resumed if e.type == "agent.tool_result")
    assert (result.tool_use_id, result.content[0].text, result.is_error) == (use.id, text, is_error)
    assert [e.content[0].text for e in resumed if e.type == "agent.message"] == ["after"]
    assert resumed[-1].stop_reason.type == "end_turn"
    for payload in managed.events[session.id]:
        strict_event(payload)


def test_a_confirmation_for_no_waiting_tool_is_refused(client, session):
    with pytest.raises(anthropic.BadRequestError):
        client.beta.sessions.events.send(
            session.id, events=[{"type": "user.tool_confirmation", "tool_use_id": "sevt_9999", "result": "allow"}]
        )


# Stops, reschedules, termination


@pytest.mark.parametrize("reason", ["budget_reached", "retries_exhausted", "refusal"])
def test_a_stop_reason_idles_the_session_and_drops_the_rest(client, managed, session, reason):
    managed.script(session.id, [("message", "partial"), (reason,), ("message", "never")])
    seen = turn(client, session.id, user_message("go"))
    assert seen[-1].stop_reason.type == reason
    assert [e.content[0].text for e in seen if e.type == "agent.message"] == ["partial"]
    strict_event(managed.events[session.id][-1])


def test_a_reschedule_shows_rescheduling_then_runs_on(client, managed, session):
    managed.script(session.id, [("reschedule", 0.2), ("message", "back")])
    with client.beta.sessions.events.stream(session.id) as stream:
        client.beta.sessions.events.send(session.id, events=[user_message("go")])
        types = []
        for event in stream:
            types.append(event.type)
            if event.type == "session.status_rescheduled":
                assert client.beta.sessions.retrieve(session.id).status == "rescheduling"
            if event.type == "session.status_idle":
                break
    assert types[:4] == [
        "user.message",
        "session.status_running",
        "session.status_rescheduled",
        "session.status_running",
    ]
    assert client.beta.sessions.retrieve(session.id).status == "idle"
    for payload in managed.events[session.id]:
        strict_event(payload)


def test_a_terminated_session_refuses_later_messages(client, managed, session):
    managed.script(session.id, [("terminate", "sandbox lost")])
    seen = turn(client, session.id, user_message("go"))
    assert [e.type for e in seen[-2:]] == ["session.error", "session.status_terminated"]
    assert seen[-2].error.message == "sandbox lost"
    fetched = client.beta.sessions.retrieve(session.id)
    assert fetched.status == "terminated"
    strict(BetaManagedAgentsSession, managed.sessions[session.id])
    with pytest.raises(anthropic.BadRequestError):
        client.beta.sessions.events.send(session.id, events=[user_message("again")])
    assert managed.user_messages[session.id] == ["go"]
    for payload in managed.events[session.id]:
        strict_event(payload)


def test_an_interrupt_cuts_a_sleeping_turn_short(client, managed, session):
    """Also: the session is `running` during a turn and `idle` after it. A turn that lasts
    until it is interrupted, so that a loaded host's polls never miss it (a 0.2 s turn did)."""
    managed.script(session.id, [("sleep", 30), ("message", "never")])
    client.beta.sessions.events.send(session.id, events=[user_message("go")])
    strict(BetaManagedAgentsSession, managed.sessions[session.id])
    wait_status(client, session.id, "running", timeout=10)
    started = time.monotonic()
    client.beta.sessions.events.send(session.id, events=[{"type": "user.interrupt"}])
    wait_status(client, session.id, "idle")
    assert time.monotonic() - started < 1
    types = [e["type"] for e in managed.events[session.id]]
    assert "agent.message" not in types and types[-1] == "session.status_idle"
    for payload in managed.events[session.id]:
        strict_event(payload)


# Output files


def test_an_output_file_is_listed_under_the_session_and_downloaded(client, managed, session):
    managed.script(session.id, [("file", "report.md", b"# Report\n"), ("message", "written")])
    turn(client, session.id, user_message("write"))
    listed = client.beta.files.list(scope_id=session.id)
    assert [f.filename for f in listed] == ["report.md"]
    strict(BetaFileMetadata, managed.files[listed.data[0].id])
    assert (listed.data[0].scope.id, listed.data[0].size_bytes) == (session.id, 9)
    assert client.beta.files.download(listed.data[0].id).read() == b"# Report\n"
    assert client.beta.files.retrieve_metadata(listed.data[0].id).mime_type == "text/markdown"
    assert client.beta.files.list(scope_id="sesn_other").data == []
    strict(BetaDeletedFile, client.beta.files.delete(listed.data[0].id).model_dump())
    assert client.beta.files.list(scope_id=session.id).data == []


def test_a_file_resource_is_mounted_listed_and_removed(client, managed, session):
    added = client.beta.sessions.resources.add(session.id, type="file", file_id="file_in", mount_path="/mnt/in.csv")
    strict(BetaManagedAgentsFileResource, managed.sessions[session.id]["resources"][0])
    assert [r.id for r in client.beta.sessions.resources.list(session.id)] == [added.id]
    assert client.beta.sessions.resources.retrieve(added.id, session_id=session.id).mount_path == "/mnt/in.csv"
    strict(BetaManagedAgentsSession, managed.sessions[session.id])
    deleted = client.beta.sessions.resources.delete(added.id, session_id=session.id)
    strict(BetaManagedAgentsDeleteSessionResource, deleted.model_dump())
    assert client.beta.sessions.resources.list(session.id).data == []


# Failures on demand


def test_an_injected_429_is_a_rate_limit_error_with_retry_after(client, managed, session):
    managed.fail_next(429, path_prefix=f"/v1/sessions/{session.id}/events")
    client.beta.sessions.retrieve(session.id)
    with pytest.raises(anthropic.RateLimitError) as raised:
        client.beta.sessions.events.send(session.id, events=[user_message("hi")])
    assert raised.value.response.headers["retry-after"] == "1"
    assert raised.value.body["error"]["type"] == "rate_limit_error"
    assert managed.user_messages[session.id] == []
    client.beta.sessions.events.send(session.id, events=[user_message("hi")])
    assert managed.user_messages[session.id] == ["hi"]


def test_injected_529_and_500_are_status_errors(client, managed, session):
    managed.fail_next(529, times=2)
    managed.fail_next(500)
    for _ in range(2):
        with pytest.raises(anthropic.APIStatusError) as raised:
            client.beta.sessions.retrieve(session.id)
        assert raised.value.status_code == 529
        assert isinstance(raised.value, anthropic.OverloadedError)
    with pytest.raises(anthropic.InternalServerError):
        client.beta.sessions.events.stream(session.id)
    assert client.beta.sessions.retrieve(session.id).status == "idle"


# Stream housekeeping


def test_a_client_leaving_the_stream_does_not_disturb_the_fake(client, managed, session):
    managed.ping_interval = 0.02
    with client.beta.sessions.events.stream(session.id):
        time.sleep(0.05)
    seen = turn(client, session.id, user_message("still here"))
    assert seen[-1].type == "session.status_idle"
