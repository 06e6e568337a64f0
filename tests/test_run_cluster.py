"""An agent pinned to one host's task cluster (`cluster`: that cluster's PAPERCLIP_CLUSTER_NAME):
its heartbeats execute only there, whoever asks for them and wherever they were sent."""

from __future__ import annotations

import pytest
from django.utils import timezone
from django_q.brokers import get_broker

from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.heartbeat import heartbeat_start
from sessions_app.models import Agent, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.tasks import execute_run, scheduled_heartbeat
from tests.conftest import run_queued_tasks

pytestmark = pytest.mark.django_db(transaction=True)

HOST = "worker-b"


@pytest.fixture
def pinned(persistent_agent) -> Agent:
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "cluster": HOST}
    persistent_agent.save()
    return persistent_agent


def queued(cluster: str | None = None) -> int:
    return get_broker(cluster).queue_size()


def asked(agent: Agent, *, wait: bool) -> HeartbeatRun:
    """A heartbeat as the API, the admin and the `heartbeat` command ask for one."""
    run, _ = heartbeat_start(
        agent=agent, task="tidy the repository", trigger=RunTrigger.API, now=timezone.now(), wait=wait
    )
    return run


def test_a_heartbeat_of_a_pinned_agent_is_sent_to_its_cluster_and_runs_only_there(pinned, fake_anthropic, settings):
    assert asked(pinned, wait=False).status == RunStatus.QUEUED
    assert (queued(), queued(HOST)) == (0, 1)

    # The deployment's cluster has nothing to run; the pinned host's runs it.
    assert run_queued_tasks() == []
    assert fake_anthropic.message_requests == []
    settings.PAPERCLIP_CLUSTER_NAME = HOST  # a worker of that host's cluster
    assert run_queued_tasks(HOST) == [RunStatus.SUCCEEDED]
    assert len(fake_anthropic.message_requests) == 1


def test_waiting_on_a_pinned_agents_heartbeat_elsewhere_hands_it_to_its_cluster_and_runs_nothing_here(
    pinned, fake_anthropic, settings
):
    settings.PAPERCLIP_RUN_TIMEOUT_SECONDS = 1  # how long `wait` waits for the run to end

    # Before: the web process ran the agent's heartbeat itself, away from its workspace.
    assert asked(pinned, wait=True).status == RunStatus.QUEUED  # the API answers 202
    assert fake_anthropic.message_requests == []
    assert queued(HOST) == 1  # handed once, however long it waited


def test_the_pinned_host_runs_a_waited_heartbeat_itself(pinned, fake_anthropic, settings):
    settings.PAPERCLIP_CLUSTER_NAME = HOST  # the `heartbeat` command or a request on that host

    assert asked(pinned, wait=True).status == RunStatus.SUCCEEDED
    assert queued(HOST) == 0 and len(fake_anthropic.message_requests) == 1


def test_a_scheduled_tick_run_by_any_cluster_sends_the_run_to_the_pinned_one(pinned, fake_anthropic):
    assert scheduled_heartbeat(str(pinned.id)) == RunStatus.QUEUED
    assert fake_anthropic.message_requests == []
    assert (queued(), queued(HOST)) == (0, 1)


def test_a_run_sent_before_its_agent_was_pinned_is_passed_on_to_its_cluster(persistent_agent, fake_anthropic):
    run, _ = heartbeat_enqueue(agent=persistent_agent, task="tidy", now=timezone.now())
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "cluster": HOST}
    persistent_agent.save()

    assert execute_run(str(run.id)) == f"sent to cluster {HOST}"
    assert HeartbeatRun.objects.get(pk=run.pk).status == RunStatus.QUEUED
    assert fake_anthropic.message_requests == [] and queued(HOST) == 1


def test_the_next_queued_run_of_a_pinned_agent_is_woken_on_its_cluster(pinned, fake_anthropic, settings):
    settings.PAPERCLIP_CLUSTER_NAME = HOST
    first, _ = heartbeat_enqueue(agent=pinned, task="one", now=timezone.now())
    second, _ = heartbeat_enqueue(agent=pinned, task="two", now=timezone.now())

    assert execute_run(str(first.id)) == RunStatus.SUCCEEDED
    # Its release woke the next run on the agent's cluster, not the deployment's.
    assert (queued(), queued(HOST)) == (0, 1)
    assert run_queued_tasks(HOST) == [RunStatus.SUCCEEDED]
    assert HeartbeatRun.objects.get(pk=second.pk).status == RunStatus.SUCCEEDED


@pytest.mark.parametrize("cluster", ["", "-leading-dash", "a b", "x" * 65, 7, ["worker-b"]])
def test_a_cluster_that_no_task_cluster_can_be_named_is_refused(cluster):
    with pytest.raises(AgentConfigError) as refusal:
        validate_agent_config("claude-code", {"cluster": cluster})
    assert set(refusal.value.fields) == {"adapter_config.cluster"}


def test_a_cluster_name_or_none_is_taken():
    assert validate_agent_config("claude-code", {"cluster": "worker-b.eu_1"})["cluster"] == "worker-b.eu_1"
    assert validate_agent_config("claude-code", {"cluster": None})["cluster"] is None


def test_a_deleted_session_of_a_pinned_agent_loses_the_clis_own_copy_on_its_clusters_host(pinned, settings):
    from sessions_app.adapters.cli_home import config_dir
    from sessions_app.services import session_delete
    from tests.api.conftest import make_session

    cli_session_id = "6f1c2a9e-0b7d-4f6a-9a51-2c3d4e5f6a7b"
    session = make_session(pinned, cli_session_id=cli_session_id)
    local_copy = config_dir(pinned.id) / "projects" / "-workspace" / f"{cli_session_id}.jsonl"
    local_copy.parent.mkdir(parents=True)
    local_copy.write_text("{}\n")  # as Claude Code left it, on the pinned host's disk

    session_delete(session=session, now=timezone.now())

    # This process is not that host: the copy is that cluster's to delete (before: deleted
    # here, where it is not, and left there).
    assert local_copy.exists() and queued(HOST) == 1
    settings.PAPERCLIP_CLUSTER_NAME = HOST
    assert run_queued_tasks(HOST) == ["deleted"]
    assert not local_copy.exists()
