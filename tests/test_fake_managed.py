"""The Managed Agents fake, driven through the real anthropic SDK."""

import anthropic
import pytest
from anthropic.types.beta import BetaManagedAgentsAgent, BetaManagedAgentsSession

from tests.fake_managed import FakeManaged


@pytest.fixture
def managed():
    fake = FakeManaged().start()
    yield fake
    fake.stop()


@pytest.fixture
def client(managed):
    return anthropic.Anthropic(api_key="test-key", base_url=managed.base_url, max_retries=0)


def test_an_agent_created_validates_as_the_sdks_model(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5", system="Be brief.")
    strict = BetaManagedAgentsAgent.model_validate(managed.agents[agent.id])
    assert strict.version == 1
    assert client.beta.agents.retrieve(agent.id).system == "Be brief."


def test_an_update_makes_a_new_version_and_a_stale_one_is_refused(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5")
    updated = client.beta.agents.update(agent.id, version=1, system="New prompt.")
    assert updated.version == 2
    BetaManagedAgentsAgent.model_validate(managed.agents[agent.id])
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
    BetaManagedAgentsSession.model_validate(managed.sessions[session.id])
    fetched = client.beta.sessions.retrieve(session.id)
    assert (fetched.status, fetched.agent.version) == ("idle", 1)


def test_a_session_archived_then_deleted_is_gone(client, managed):
    agent = client.beta.agents.create(name="writer", model="claude-sonnet-4-5")
    session = client.beta.sessions.create(agent=agent.id, environment_id="env_1")
    assert client.beta.sessions.archive(session.id).archived_at is not None
    assert client.beta.sessions.delete(session.id).type == "session_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.beta.sessions.retrieve(session.id)
