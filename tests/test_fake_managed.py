"""The Managed Agents fake, driven through the real anthropic SDK."""

import anthropic
import pytest
from anthropic.types.beta import BetaManagedAgentsAgent

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
