"""The error surface: one JSON shape for every failure, never a 500."""

from __future__ import annotations

import json

import pytest

from sessions_app.models import Agent, Company
from tests.api.conftest import agent_url, assert_error

pytestmark = pytest.mark.django_db


def test_malformed_json_is_400(api, company):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", raw=b'{"name": "x",'), 400, "malformed_json")
    assert "JSON" in error["message"]


def test_nan_is_malformed_json(api, company):
    assert_error(api.post(f"/api/companies/{company.id}/agents", raw=b'{"name": NaN}'), 400, "malformed_json")


def test_body_that_is_not_utf8_is_400(api, company):
    assert_error(api.post(f"/api/companies/{company.id}/agents", raw=b'{"name": "\xff"}'), 400)


def test_unsupported_media_type_is_415(api, company):
    response = api.client.post(f"/api/companies/{company.id}/agents", "name=x", content_type="text/plain")
    assert_error(response, 415, "unsupported_media_type")


@pytest.mark.parametrize(
    "body",
    [
        {"name": "ab\x00cd"},
        {"name": "ok", "system_prompt": "\x00"},
        {"name": "ok", "adapter_config": {"model": "claude\x00"}},
        {"name": "ok", "adapter_config": {"nested\x00key": 1}},
        {"name": "ok", "adapter_config": {"list": ["a", ["b\x00"]]}},
    ],
)
def test_nul_characters_anywhere_in_the_body_are_400(api, company, body):
    assert_error(api.post(f"/api/companies/{company.id}/agents", body), 400, "nul_character")
    assert not Agent.objects.exists()


def test_escaped_nul_in_raw_json_is_400(api):
    assert_error(api.post("/api/companies", raw=b'{"name": "a\\u0000b"}'), 400, "nul_character")
    assert not Company.objects.exists()


def test_lone_surrogate_is_400(api):
    assert_error(api.post("/api/companies", raw=b'{"name": "a\\ud800b"}'), 400, "invalid_unicode")


def test_nul_in_heartbeat_task_is_400(api, persistent_agent):
    assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "a\x00b"}), 400, "nul_character")


def test_nul_in_a_query_parameter_is_400(api, persistent_agent):
    assert_error(api.get(agent_url(persistent_agent, "/sessions"), {"status": "a\x00"}), 400, "nul_character")


def test_deeply_nested_json_is_400(api, company):
    deep = b'{"name": "x", "adapter_config": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(api.post(f"/api/companies/{company.id}/agents", raw=deep), 400)


def test_body_over_the_limit_is_413(api, company, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    body = {"name": "x", "system_prompt": "y" * 5000}
    assert_error(api.post(f"/api/companies/{company.id}/agents", body), 413, "payload_too_large")
    assert not Agent.objects.exists()


def test_a_body_over_the_limit_names_the_limit_and_the_setting(api, company, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    body = {"name": "x", "system_prompt": "y" * 5000}
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", body), 413, "payload_too_large")
    assert "2048 bytes" in error["message"] and "PAPERCLIP_MAX_BODY_BYTES" in error["message"]


def test_a_body_too_big_for_django_itself_names_the_limit_and_the_setting(rf, settings):
    from django.core.exceptions import RequestDataTooBig

    from sessions_app.api.exceptions import json_bad_request

    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    response = json_bad_request(rf.post("/api/companies"), RequestDataTooBig("too big"))
    message = json.loads(response.content)["error"]["message"]
    assert "4096 bytes" in message and "PAPERCLIP_MAX_BODY_BYTES" in message


def test_a_query_string_with_too_many_parameters_is_a_400_naming_the_limit(api, company, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
    query = "&".join(f"p{index}=1" for index in range(11))
    error = assert_error(api.client.get(f"/api/companies/{company.id}/agents?{query}"), 400, "invalid_parameter")
    assert "more than 10 parameters" in error["message"]


@pytest.mark.parametrize("raw", [b'["hi"]', b'"hi"', b"42", b"null", b"true"])
def test_a_body_that_is_not_a_json_object_says_an_object_was_expected(api, company, persistent_agent, raw):
    for path in ("/api/companies", f"/api/companies/{company.id}/agents", agent_url(persistent_agent, "/heartbeat")):
        error = assert_error(api.post(path, raw=raw), 400, "expected_json_object")
        assert "expected a JSON object" in error["message"], (path, error)


def test_parser_reads_no_more_than_the_limit_when_no_length_is_declared(settings):
    from io import BytesIO

    from sessions_app.api.exceptions import PayloadTooLarge
    from sessions_app.api.parsers import StrictJSONParser

    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    stream = BytesIO(b'{"name": "' + b"y" * 5000 + b'"}')
    with pytest.raises(PayloadTooLarge):
        StrictJSONParser().parse(stream, parser_context={})
    assert stream.tell() == 2049


@pytest.mark.parametrize(
    "path",
    [
        "/api/companies/not-a-uuid",
        "/api/companies/123/agents",
        "/api/companies/00000000-0000-4000-8000-00000000000z/agents",
        "/api/companies/{company}/agents/not-a-uuid",
        "/api/companies/{company}/agents/not-a-uuid/sessions",
        "/api/nothing-here",
        "/api",
    ],
)
def test_unknown_paths_and_non_uuid_ids_are_json_404(api, company, path):
    assert_error(api.get(path.format(company=company.id)), 404, "not_found")


def test_pages_outside_the_api_keep_django_html_404(client, db):
    response = client.get("/nothing-here")
    assert response.status_code == 404
    assert not response["Content-Type"].startswith("application/json")


def test_a_host_header_the_server_does_not_answer_for_is_a_json_400_naming_the_setting(client, db):
    response = client.get("/api/health", HTTP_HOST="elsewhere.example")

    error = assert_error(response, 400, "disallowed_host")
    assert "DJANGO_ALLOWED_HOSTS" in error["message"]
    assert "elsewhere.example" not in error["message"]


def test_a_disallowed_host_outside_the_api_keeps_django_page(client, db):
    response = client.get("/admin/", HTTP_HOST="elsewhere.example")

    assert response.status_code == 400
    assert not response["Content-Type"].startswith("application/json")


def test_server_error_on_an_api_path_is_json(rf):
    from sessions_app.api.exceptions import json_server_error

    response = json_server_error(rf.get("/api/companies"))
    assert response.status_code == 500
    assert json.loads(response.content)["error"]["code"] == "server_error"


def test_request_data_too_big_outside_a_view_is_json_413(rf):
    from django.core.exceptions import RequestDataTooBig

    from sessions_app.api.exceptions import json_bad_request

    response = json_bad_request(rf.post("/api/companies"), RequestDataTooBig("too big"))
    assert response.status_code == 413
    assert json.loads(response.content)["error"]["code"] == "payload_too_large"


def test_database_errors_are_503(api, persistent_agent, monkeypatch):
    from django.db import OperationalError

    from sessions_app import views

    def broken(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(views, "agent_delete", broken)
    assert_error(api.delete(agent_url(persistent_agent)), 503, "database_unavailable")


def test_heartbeat_when_the_task_queue_is_down_is_503(api, persistent_agent, monkeypatch):
    from sessions_app import heartbeat

    def broken(*, run):
        raise ConnectionError("broker down")

    monkeypatch.setattr(heartbeat, "heartbeat_dispatch", broken)
    error = assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi"}), 503, "queue_unavailable")
    assert "recorded" in error["message"]
