"""OpenAPI at /api/schema/, Swagger UI without a CDN, and schemathesis against a live server."""

from __future__ import annotations

import re

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from costs_app.models import AlertTarget, Budget
from sessions_app.api_keys import api_key_create
from sessions_app.models import Agent, Company, PinnedFact
from tests.api.conftest import assert_error, make_run, make_session
from tests.api.test_managed_outputs import stored_output

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(api):
    response = api.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    return response.json()


def test_schema_is_openapi_3_with_every_endpoint(schema):
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    for path, methods in {
        "/api/companies": {"post"},
        "/api/companies/{company_id}": {"get"},
        "/api/companies/{company_id}/agents": {"get", "post"},
        "/api/companies/{company_id}/agents/{agent_id}": {"get", "patch", "delete"},
        "/api/companies/{company_id}/agents/{agent_id}/heartbeat": {"post"},
        "/api/companies/{company_id}/agents/{agent_id}/runs": {"get"},
        "/api/companies/{company_id}/agents/{agent_id}/runs/{run_id}": {"get"},
        "/api/companies/{company_id}/agents/{agent_id}/sessions": {"get"},
        "/api/companies/{company_id}/agents/{agent_id}/sessions/{session_id}": {"get", "delete"},
        "/api/companies/{company_id}/costs/daily": {"get"},
        "/api/companies/{company_id}/costs/summary": {"get"},
        "/api/companies/{company_id}/budget/targets": {"get", "post"},
        "/api/companies/{company_id}/budget/targets/{target_id}": {"delete"},
        "/api/companies/{company_id}/agents/{agent_id}/budget/targets": {"get", "post"},
        "/api/companies/{company_id}/agents/{agent_id}/budget/targets/{target_id}": {"delete"},
    }.items():
        assert methods <= set(paths[path]), path


def test_every_operation_documents_its_bodies_and_the_error_shape(schema):
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            responses = operation["responses"]
            success = [code for code in responses if code.startswith("2")]
            assert success, (method, path)
            for code in success:
                if code != "204":
                    content = responses[code]["content"]
                    downloads = content.get("application/octet-stream", {}).get("schema", {}).get("format")
                    assert "application/json" in content or downloads == "binary", (method, path, code)
            if method in ("post", "patch"):
                assert "application/json" in operation["requestBody"]["content"], (method, path)
            if path.startswith("/api/companies/"):
                for code in ("401", "404"):
                    ref = responses[code]["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/Error"), (method, path, code)
    assert schema["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"


def test_swagger_ui_is_served_without_a_cdn(api):
    response = api.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "drf_spectacular_sidecar" in html
    assert not re.search(r"https?://(?!localhost|127\.0\.0\.1)", html.split("<body")[1] if "<body" in html else html)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("OPTIONS", "/api/docs/", 405, "method_not_allowed"),  # was a 500: no template for the metadata
        ("POST", "/api/docs/", 405, "method_not_allowed"),
        ("GET", "/api/docs/?format=json", 404, "not_found"),
        ("POST", "/api/schema/", 405, "method_not_allowed"),
        ("GET", "/api/schema/?format=xml", 404, "not_found"),
    ],
)
def test_the_schema_and_its_page_answer_errors_in_json(api, method, path, status, code):
    response = api.client.generic(method, path)
    assert_error(response, status, code)


# schemathesis: generated requests for every operation against a live server; no 5xx, and
# every answer (status, content type, body) as the schema says.

# Valid requests (by the schema) and invalid ones (wrong types, missing fields, bad ids).
MAX_EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 15}
# Authenticated mode answers the same views through another door (the key, 401 and 403 on
# top): a third of the corpus there finds what is particular to it, at a third of the time.
AUTHENTICATED_MAX_EXAMPLES = {GenerationMode.POSITIVE: 8, GenerationMode.NEGATIVE: 5}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["local_trusted", "authenticated"])
def test_schemathesis_finds_no_server_errors_and_no_schema_violations(live_server, fake_anthropic, settings, mode):
    settings.PAPERCLIP_HEARTBEAT_RATE = "1000/min"
    settings.PAPERCLIP_DEPLOYMENT_MODE = mode
    company = Company.objects.create(name="Fuzz")
    headers = {"Authorization": f"Bearer {api_key_create(company=company)[1]}"} if mode == "authenticated" else {}
    agent = Agent.objects.create(
        company=company,
        name="Fuzzed",
        adapter_config={"model": "claude-haiku-4-5", "session_mode": "persistent"},
    )
    session = make_session(agent, status="ended")
    run = make_run(agent)
    pin = PinnedFact.objects.create(agent=agent, text="Fuzzed facts stay.")
    known = {
        "pin_id": str(pin.id),
        "company_id": str(company.id),
        "agent_id": str(agent.id),
        "session_id": session.public_id,
        "run_id": str(run.id),
        "memory_path": "notes/todo.md",
        "output_id": stored_output(agent, "fuzzed.txt", b"fuzzed output").id,
        # A budget without limits, for its alert target: the fuzzed heartbeats are not refused.
        "target_id": AlertTarget.objects.create(
            budget=Budget.objects.create(company=company), url="https://alerts.example/hook", secret="s" * 32
        ).id,
    }
    api_schema = schemathesis.openapi.from_url(f"{live_server.url}/api/schema/?format=json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15

    plan = [(operation, generation) for operation in operations for generation in GenerationMode]
    for operation, generation in plan:
        if operation.method.upper() == "DELETE" and operation.path.endswith("{agent_id}"):
            continue  # deleting the one agent would turn every later call into a 404

        @given(case=operation.as_strategy(generation_mode=generation), use_known_ids=st.booleans())
        @hypothesis_settings(
            max_examples=(AUTHENTICATED_MAX_EXAMPLES if mode == "authenticated" else MAX_EXAMPLES)[generation],
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case, use_known_ids):
            if use_known_ids and case.path_parameters:
                case.path_parameters = {**case.path_parameters, **{k: known[k] for k in case.path_parameters}}
            response = case.call(base_url=live_server.url, headers=headers, timeout=30)
            case.validate_response(response, checks=checks, headers=headers)

        check()
