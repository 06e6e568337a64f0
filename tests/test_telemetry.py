"""OpenTelemetry (paperclip/telemetry.py), with the SDK's in-memory exporter: one trace per
heartbeat, its steps in order, each model call's span beneath `call`, for every runtime;
nothing imported, nothing exported, when the OTEL_* variables are unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from paperclip import telemetry
from sessions_app import history_cache
from sessions_app.adapters.claude_cli import cli_environment
from sessions_app.models import AgentSession, RunStatus
from tests.conftest import REPORTER, beat, process_agent
from tests.test_claude_cli_adapter import cli_agent, workspace

STEPS = ["claim", "plan", "fit", "reserve", "call", "commit", "release"]


@pytest.fixture
def traced():
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    assert telemetry.telemetry_start(span_exporter=exporter, metric_reader=reader, held_count=lambda: 0)
    try:
        yield exporter, reader
    finally:
        telemetry.telemetry_stop()


def heartbeat_trace(exporter) -> tuple:
    """The one trace of the heartbeat: its run span and every span of it, by id."""
    spans = exporter.get_finished_spans()
    roots = [span for span in spans if span.name == "heartbeat"]
    assert len(roots) == 1, [span.name for span in spans]
    root = roots[0]
    mine = [span for span in spans if span.context.trace_id == root.context.trace_id]
    return root, mine


def children(spans, parent) -> list:
    found = [span for span in spans if span.parent is not None and span.parent.span_id == parent.context.span_id]
    return sorted(found, key=lambda span: span.start_time)


def assert_one_trace_of_steps(exporter, run) -> tuple:
    root, spans = heartbeat_trace(exporter)
    steps = children(spans, root)
    assert [span.name for span in steps if span.name in STEPS] == STEPS
    assert root.attributes["paperclip.run.id"] == str(run.id)
    assert root.attributes["paperclip.agent.id"] == str(run.agent_id)
    assert root.attributes["paperclip.company.id"] == str(run.company_id)
    assert root.attributes["paperclip.run.status"] == run.status
    for span in steps:
        if span.name not in ("claim", "release"):
            assert span.attributes["paperclip.run.id"] == str(run.id)
            assert span.attributes["paperclip.agent.id"] == str(run.agent_id)
    call = next(span for span in steps if span.name == "call")
    return root, call, children(spans, call)


@pytest.mark.django_db
def test_an_api_heartbeat_is_one_trace_and_the_sdks_span_of_its_call_is_beneath_call(
    traced, fake_anthropic, persistent_agent
):
    exporter, reader = traced
    run = beat(persistent_agent, "hello")
    assert run.status == RunStatus.SUCCEEDED
    root, call, beneath = assert_one_trace_of_steps(exporter, run)
    sdk = [span for span in beneath if span.name == "anthropic.messages.create"]
    assert len(sdk) == 1
    assert sdk[0].attributes["gen_ai.request.model"] == persistent_agent.model_name
    assert sdk[0].attributes["gen_ai.usage.output_tokens"] == 12
    assert [span.name for span in beneath if span.name == "bill"] == ["bill"]
    assert root.attributes["paperclip.run.cost_usd"] == str(run.cost_usd)
    assert root.attributes["paperclip.session.id"] == str(run.session_id)
    # A new session has no id before its commit creates it; the run's span names it.
    commit = next(span for span in children(exporter.get_finished_spans(), root) if span.name == "commit")
    assert "paperclip.session.id" not in commit.attributes
    metrics = json.loads(reader.get_metrics_data().to_json())
    names = {m["name"] for rm in metrics["resource_metrics"] for sm in rm["scope_metrics"] for m in sm["metrics"]}
    assert {"paperclip.runs", "paperclip.run.duration", "paperclip.spend", "paperclip.tokens"} <= names
    assert "paperclip.credentials.held" in names


@pytest.mark.django_db
def test_each_heartbeat_is_its_own_trace(traced, fake_anthropic, stateless_agent):
    exporter, _ = traced
    beat(stateless_agent, "one")
    beat(stateless_agent, "two")
    roots = [span for span in exporter.get_finished_spans() if span.name == "heartbeat"]
    assert len({span.context.trace_id for span in roots}) == 2


@pytest.mark.django_db
def test_a_process_agents_reported_call_is_billed_beneath_call(traced, company, tmp_path):
    exporter, _ = traced
    run = beat(process_agent(company, tmp_path, REPORTER), "hello")
    assert run.status == RunStatus.SUCCEEDED
    _, _, beneath = assert_one_trace_of_steps(exporter, run)
    bills = [span for span in beneath if span.name == "bill"]
    assert [span.attributes["gen_ai.usage.input_tokens"] for span in bills] == [3]


@pytest.mark.django_db
def test_a_claude_code_run_bills_each_model_request_beneath_call(traced, company, fake_anthropic):
    exporter, _ = traced
    agent = cli_agent(company)
    run = beat(agent, "Say hello.")
    assert run.status == RunStatus.SUCCEEDED, run.error
    _, _, beneath = assert_one_trace_of_steps(exporter, run)
    assert len([span for span in beneath if span.name == "bill"]) >= 1
    assert workspace(agent).exists()


def test_claude_code_is_given_the_trace_context_of_its_call(tmp_path):
    env = cli_environment(
        agent_id="a",
        workspace=tmp_path,
        mark="m",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    assert env["TRACEPARENT"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert "TRACEPARENT" not in cli_environment(agent_id="a", workspace=tmp_path, mark="m")


@pytest.mark.django_db
def test_with_the_variables_unset_nothing_is_traced(fake_anthropic, stateless_agent):
    assert not telemetry.enabled()
    assert telemetry.step("plan") is not None and telemetry.traceparent() is None
    run = beat(stateless_agent, "hello")
    assert run.status == RunStatus.SUCCEEDED
    from opentelemetry import trace

    # The SDK's spans go to OpenTelemetry's default provider, which records nothing.
    assert not trace.get_tracer_provider().get_tracer("x").start_span("probe").is_recording()


def test_with_the_variables_unset_nothing_of_opentelemetry_is_imported():
    script = (
        "import django, sys; django.setup();"
        "import sessions_app.heartbeat, sessions_app.adapters.claude_code, anthropic;"
        "print([m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter',"
        " 'opentelemetry.instrumentation'))])"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # And with them set, the process traces from its start.
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    script = "import django; django.setup(); from paperclip import telemetry; print(telemetry.generation())"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


@pytest.mark.django_db(transaction=True)
def test_django_requests_and_their_queries_are_traced_by_the_official_instrumentations(traced, client):
    from django.db import connection

    exporter, _ = traced
    connection.close()  # the next query opens a connection through the instrumented driver
    assert client.get("/api/health").status_code in (200, 503)
    spans = exporter.get_finished_spans()
    request = next(span for span in spans if span.attributes.get("http.route") == "api/health")
    queries = [span for span in spans if span.parent is not None and span.parent.span_id == request.context.span_id]
    assert any(span.attributes.get("db.system") or span.attributes.get("db.system.name") for span in queries), [
        (span.name, dict(span.attributes)) for span in spans
    ]


@pytest.mark.django_db(transaction=True)
def test_the_step_that_read_a_session_says_whether_a_kept_history_served(
    postgres_only, traced, fake_anthropic, persistent_agent
):
    exporter, _ = traced
    history_cache.forget_all()
    beat(persistent_agent, "one")
    beat(persistent_agent, "two")  # keeps the history it wrote

    def kept_on_the_claim() -> object:
        exporter.clear()
        beat(persistent_agent, "next")
        _, spans = heartbeat_trace(exporter)
        claim = next(span for span in spans if span.name == "claim")
        return claim.attributes.get("paperclip.history_kept")

    assert kept_on_the_claim() is True
    AgentSession.objects.filter(agent=persistent_agent).update(history=[])  # an operator's clear
    assert kept_on_the_claim() is False
