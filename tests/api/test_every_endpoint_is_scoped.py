"""Every endpoint under /api/companies/{company_id}, found from the URL configuration (so a
new one is covered the day it is added): in `authenticated` mode it needs a key, and a key of
another company gets 404, exactly as an unknown id would, and changes nothing."""

from __future__ import annotations

import uuid

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from sessions_app.models import Agent, AgentSession, HeartbeatRun
from tests.api.conftest import Api, assert_error, make_run, make_session

pytestmark = pytest.mark.django_db

METHODS = ("get", "post", "put", "patch", "delete")


def api_routes() -> list[tuple[str, list[str]]]:
    """Each route of the API below a company, with the methods its view answers."""

    def walk(resolver: URLResolver, prefix: str):
        for entry in resolver.url_patterns:
            if isinstance(entry, URLResolver):
                yield from walk(entry, prefix + str(entry.pattern))
            elif isinstance(entry, URLPattern):
                yield prefix + str(entry.pattern), entry.callback

    routes = []
    for route, callback in walk(get_resolver(), "/"):
        view = getattr(callback, "cls", None)
        if route.startswith("/api/companies/<uuid:company_id>") and view is not None:
            routes.append((route, [method for method in METHODS if hasattr(view, method)]))
    return routes


def filled(route: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        route = route.replace(f"<{name}>", value)
    assert "<" not in route, f"a parameter of {route} has no value here: add it"
    return route


def call(client: Api, method: str, path: str):
    if method in ("post", "patch"):
        return getattr(client, method)(path, {})
    if method == "put":
        return client.put(path, {})
    return getattr(client, method)(path)


def path_values(company, agent) -> dict[str, str]:
    """A value for each parameter of the routes: `agent`'s own run and session under `company`."""
    return {
        "uuid:company_id": str(company.id),
        "uuid:agent_id": str(agent.id),
        "uuid:run_id": str(make_run(agent).id),
        "str:session_id": make_session(agent).public_id,
        "uuid:pin_id": str(uuid.uuid4()),
        "int:output_id": "1",
        "int:target_id": "1",
        "memory_path:memory_path": "notes/todo.md",
    }


@pytest.fixture
def own_paths(company, persistent_agent):
    values = path_values(company, persistent_agent)
    return [(method, filled(route, values)) for route, methods in api_routes() for method in methods]


def test_the_walk_finds_the_endpoints_the_contract_names(own_paths):
    found = {(method, path.split("/agents/")[-1].split("/", 1)[-1]) for method, path in own_paths}
    for expected in [("post", "heartbeat"), ("get", "runs"), ("get", "sessions"), ("get", "memory")]:
        assert expected in found
    assert len(own_paths) >= 40


def test_every_company_endpoint_needs_a_key_in_authenticated_mode(authenticated, api, own_paths):
    for method, path in own_paths:
        response = call(api, method, path)
        assert response.status_code == 401, (method, path, response.status_code)
        assert_error(response, 401, "not_authenticated")


def test_another_companys_key_gets_404_from_every_company_endpoint(other_key_api, persistent_agent, own_paths):
    session_ids = set(AgentSession.objects.values_list("id", flat=True))
    runs = HeartbeatRun.objects.count()
    for method, path in own_paths:
        response = call(other_key_api, method, path)
        assert response.status_code == 404, (method, path, response.status_code, response.content[:200])
        assert_error(response, 404, "not_found")
    agent = Agent.objects.get(pk=persistent_agent.pk)
    assert (agent.name, agent.status) == ("Persistent", "active")
    assert set(AgentSession.objects.values_list("id", flat=True)) == session_ids
    assert HeartbeatRun.objects.count() == runs


def test_another_companys_agent_is_404_through_every_agent_endpoint_of_this_company(
    api, company, persistent_agent, other_agent
):
    values = path_values(company, other_agent)
    foreign_routes = [(route, methods) for route, methods in api_routes() if "<uuid:agent_id>" in route]
    assert len(foreign_routes) >= 20
    session_ids = set(AgentSession.objects.values_list("id", flat=True))
    for route, methods in foreign_routes:
        for method in methods:
            path = filled(route, values)
            response = call(api, method, path)
            assert response.status_code == 404, (method, path, response.status_code, response.content[:200])
    other_agent.refresh_from_db()
    assert (other_agent.name, other_agent.status) == ("Foreign", "active")
    assert set(AgentSession.objects.values_list("id", flat=True)) == session_ids
    assert HeartbeatRun.objects.filter(agent=other_agent).count() == 1
