"""The memory API: listing, reading with versions, operator writes and deletes, errors,
and company scoping."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from memory_app.models import MemoryAccess, MemoryFile, MemoryStore, MemoryStoreShare, MemoryWriter
from memory_app.stores import Writer, mounts_for
from memory_app.tool import StoreMemoryTool
from sessions_app.models import Agent
from tests.api.conftest import agent_url, assert_error


@pytest.fixture
def memory_agent(company):
    return Agent.objects.create(company=company, name="Rememberer", adapter_config={"memory": True})


def written(agent, path: str, text: str) -> None:
    StoreMemoryTool(mounts_for(agent), writer=Writer(operator="setup")).call(
        {"command": "create", "path": f"/memories/{path}", "file_text": text}
    )


def test_an_agent_without_memory_lists_nothing_and_creates_no_store(api, memory_agent):
    response = api.get(agent_url(memory_agent, "/memory"))
    assert response.status_code == 200
    assert response.json() == {"files": [], "truncated": False}
    assert not MemoryStore.objects.exists()


def test_put_get_list_and_delete_a_file(api, memory_agent):
    url = agent_url(memory_agent, "/memory/notes/todo.md")
    put = api.put(url, {"content": "buy milk"})
    assert put.status_code == 200, put.content
    assert put.json()["path"] == "/memories/notes/todo.md" and put.json()["version"] == 1
    assert api.put(url, {"content": "buy oat milk", "version": 1}).status_code == 200
    got = api.get(url).json()
    assert got["content"] == "buy oat milk" and got["store"] == "default"
    assert [v["number"] for v in got["versions"]] == [2, 1]
    assert {v["written_by"] for v in got["versions"]} == {MemoryWriter.OPERATOR}
    assert api.get(url, {"version": 1}).json()["content"] == "buy milk"
    assert_error(api.get(url, {"version": 0}), 400, "invalid_parameter")
    listing = api.get(agent_url(memory_agent, "/memory")).json()
    assert [f["path"] for f in listing["files"]] == ["/memories/notes/todo.md"]
    assert api.delete(url).status_code == 204
    assert_error(api.get(url), 404, "memory_not_found")
    assert api.get(url, {"version": 3}).json()["versions"][0]["deleted"] is True
    assert api.get(agent_url(memory_agent, "/memory")).json()["files"] == []


def test_version_0_creates_a_file_that_was_deleted_and_only_then(api, memory_agent):
    """A create-only-if-absent client: GET answers 404 after a delete, so version 0 (no
    file) must be able to create it again; it continues the file's numbering."""
    url = agent_url(memory_agent, "/memory/lock.md")
    assert api.put(url, {"content": "held", "version": 0}).json()["version"] == 1
    assert_error(api.put(url, {"content": "again", "version": 0}), 409, "memory_version_conflict")
    assert api.delete(url).status_code == 204
    assert_error(api.get(url), 404, "memory_not_found")

    created = api.put(url, {"content": "held again", "version": 0})

    assert created.status_code == 200, created.content
    assert created.json()["version"] == 3
    assert api.get(url).json()["content"] == "held again"
    assert_error(api.put(url, {"content": "third", "version": 0}), 409, "memory_version_conflict")


def test_a_path_differing_in_case_names_another_file(api, memory_agent):
    written(memory_agent, "notes/todo.md", "buy milk")
    assert_error(api.delete(agent_url(memory_agent, "/memory/Notes")), 404, "memory_not_found")
    assert_error(api.get(agent_url(memory_agent, "/memory/Notes/todo.md")), 404, "memory_not_found")
    assert api.get(agent_url(memory_agent, "/memory/notes/todo.md")).json()["content"] == "buy milk"


def test_a_stale_version_is_a_conflict_not_a_lost_write(api, memory_agent):
    url = agent_url(memory_agent, "/memory/a.md")
    api.put(url, {"content": "one"})
    api.put(url, {"content": "two", "version": 1})
    assert_error(api.put(url, {"content": "three", "version": 1}), 409, "memory_version_conflict")
    assert_error(api.put(agent_url(memory_agent, "/memory/new.md"), {"content": "x", "version": 3}), 409)
    assert api.get(url).json()["content"] == "two"


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/memory/a.md", {"content": 5}, 400, "content"),
        ("/memory/a.md", {}, 400, "content"),
        ("/memory/a.md", {"content": "x", "version": -1}, 400, "version"),
        ("/memory/a.md", {"content": "x", "version": True}, 400, "version"),
        ("/memory/a.md", {"content": "x", "extra": 1}, 400, "extra"),
        ("/memory/a.md", ["content"], 400, None),
        ("/memory/a.md", {"content": "a\u0000b"}, 400, None),
        ("/memory/../a.md", {"content": "x"}, 400, "path"),
        ("/memory/a/./b.md", {"content": "x"}, 400, "path"),
    ],
)
def test_bad_writes_are_400s_naming_the_field(api, memory_agent, path, body, status, field):
    error = assert_error(api.put(agent_url(memory_agent, path), body), status)
    if field:
        assert field in error.get("fields", {}), error
    assert not MemoryFile.objects.exists()


@pytest.mark.parametrize("path", ["notes/todo.md/more.md", "notes"])
def test_a_path_refused_while_writing_names_the_path(api, memory_agent, path):
    # Found under the store's lock (a file below a file, a folder written as a file), after
    # the path itself was checked: still the path's fault, not the content's.
    written(memory_agent, "notes/todo.md", "buy milk")

    error = assert_error(api.put(agent_url(memory_agent, f"/memory/{path}"), {"content": "x"}), 400)

    assert error["code"] == "memory_path_invalid"
    assert list(error["fields"]) == ["path"]
    assert list(MemoryFile.objects.values_list("path", flat=True)) == ["notes/todo.md"]


@pytest.mark.parametrize(
    "path",
    ["a%0Ab.md", "a.md%0A", "%0Anotes/a.md", "notes%0A/a.md", "a%0Db.md", "a%01b.md", "a%7Fb.md", "a%C2%85b.md"],
)
@pytest.mark.parametrize("method", ["get", "put", "delete"])
def test_a_control_character_in_the_path_is_a_400_naming_the_path(api, memory_agent, method, path):
    # A newline as much as any other: it must reach the view's path check, not miss the URL.
    url = agent_url(memory_agent, f"/memory/{path}")
    response = api.put(url, {"content": "x"}) if method == "put" else getattr(api, method)(url)

    error = assert_error(response, 400, "memory_path_invalid")

    assert list(error["fields"]) == ["path"]
    assert not MemoryFile.objects.exists()


def test_limits_answer_with_their_codes(api, memory_agent, settings):
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 10
    settings.PAPERCLIP_MEMORY_MAX_STORE_BYTES = 15
    error = assert_error(api.put(agent_url(memory_agent, "/memory/a.md"), {"content": "x" * 11}), 400)
    assert error["code"] == "memory_file_too_large" and "content" in error["fields"]
    api.put(agent_url(memory_agent, "/memory/a.md"), {"content": "x" * 10})
    assert_error(api.put(agent_url(memory_agent, "/memory/b.md"), {"content": "y" * 6}), 409, "memory_store_full")


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/memory/a.md", {"content": "x" * 11}, 400, "memory_file_too_large"),
        ("/memory/team/a.md", {"content": "x" * 11}, 400, "memory_file_too_large"),
        ("/memory/a.md", {"content": "x" * 6}, 409, "memory_store_full"),
        ("/memory/a.md", {"content": "x", "version": 2}, 409, "memory_version_conflict"),
        ("/memory/team", {"content": "x"}, 400, "memory_path_invalid"),
        ("/memory/a.md", {"content": "a\u0000b"}, 400, None),
        ("/memory/a%01.md", {"content": "x"}, 400, "memory_path_invalid"),
    ],
)
def test_a_refused_write_leaves_no_store(api, memory_agent, settings, path, body, status, code):
    # Before: the write's stores (the default one and every one configured) were made before
    # the write was refused, and stayed, empty, in the admin's list of stores.
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 10
    settings.PAPERCLIP_MEMORY_MAX_STORE_BYTES = 5
    memory_agent.adapter_config = {"memory": ["team"]}
    memory_agent.save()

    assert_error(api.put(agent_url(memory_agent, path), body), status, code)

    assert not MemoryStore.objects.exists()
    assert api.get(agent_url(memory_agent, "/memory")).json()["files"] == []


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("put", "team", {"content": "x"}, 400, "/memories/team is a directory; name a file below it."),
        ("get", "team", None, 400, "/memories/team is a directory; name a file below it."),
        ("put", "team/notes", {"content": "x"}, 400, "/memories/team/notes is a directory or lies inside a file."),
        ("put", "team/notes/a.md/b.md", {"content": "x"}, 400, "/memories/team/notes/a.md/b.md is a directory"),
        ("put", "team/big.md", {"content": "x" * 11}, 400, "/memories/team/big.md would be 11 bytes"),
        ("put", "spare/big.md", {"content": "x" * 11}, 400, "/memories/spare/big.md would be 11 bytes"),
        ("put", "team/notes/a.md", {"content": "x", "version": 3}, 409, "/memories/team/notes/a.md is at version 1,"),
        ("put", "spare/a.md", {"content": "x", "version": 3}, 409, "/memories/spare/a.md is at version 0,"),
        ("get", "team/gone.md", None, 404, "No memory file /memories/team/gone.md."),
        ("delete", "team/gone.md", None, 404, "The path /memories/team/gone.md does not exist."),
        ("delete", "spare/gone.md", None, 404, "No memory file /memories/spare/gone.md."),
        ("delete", "team", None, 400, "Cannot delete the /memories/team directory itself."),
        ("delete", "spare", None, 400, "Cannot delete the /memories/spare directory itself."),
    ],
)
def test_a_refusal_in_a_named_store_names_the_path_with_its_folder(
    api, memory_agent, settings, method, path, body, status, message
):
    # Before: a named store's file was named by its path inside the store, as if in the
    # default one (`/memories/gone.md` for team/gone.md), and its folder as /memories.
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 10
    memory_agent.adapter_config = {"memory": ["team", "spare"]}  # spare: no write has made it
    memory_agent.save()
    written(memory_agent, "team/notes/a.md", "a")
    url = agent_url(memory_agent, f"/memory/{path}")

    response = getattr(api, method)(url, body) if body is not None else getattr(api, method)(url)

    error = assert_error(response, status)
    assert error["message"].startswith(message), error
    if status == 400:
        assert error["fields"] == {"path" if "directory" in message else "content": error["message"]}
    assert list(MemoryFile.objects.values_list("path", "version")) == [("notes/a.md", 1)]


def test_a_write_makes_only_the_store_it_writes_to(api, memory_agent):
    memory_agent.adapter_config = {"memory": ["team"]}
    memory_agent.save()

    assert api.put(agent_url(memory_agent, "/memory/team/a.md"), {"content": "x"}).status_code == 200

    assert list(MemoryStore.objects.values_list("name", "bytes_used")) == [("team", 1)]
    assert_error(api.delete(agent_url(memory_agent, "/memory/b.md")), 404, "memory_not_found")
    assert list(MemoryStore.objects.values_list("name", flat=True)) == ["team"]


def test_files_written_by_runs_and_shared_stores_are_listed(api, company, memory_agent):
    owner = Agent.objects.create(company=company, name="Owner", adapter_config={"memory": ["team"]})
    team = MemoryStore.objects.create(company=company, agent=owner, name="team")
    MemoryStoreShare.objects.create(store=team, agent=memory_agent, access=MemoryAccess.READ)
    memory_agent.adapter_config = {"memory": ["team"]}
    memory_agent.save()
    written(owner, "team/plan.md", "ship")
    written(memory_agent, "mine.md", "x")
    listing = api.get(agent_url(memory_agent, "/memory")).json()["files"]
    assert [(f["path"], f["store"], f["writable"]) for f in listing] == [
        ("/memories/mine.md", "default", True),
        ("/memories/team/plan.md", "team", False),
    ]
    assert_error(api.put(agent_url(memory_agent, "/memory/team/plan.md"), {"content": "no"}), 409, "memory_read_only")


def test_the_listing_takes_a_bounded_number_of_queries(api, company, memory_agent):
    for n in range(30):
        written(memory_agent, f"f{n}.md", "x")
    with CaptureQueriesContext(connection) as queries:
        assert len(api.get(agent_url(memory_agent, "/memory")).json()["files"]) == 30
    assert len(queries) <= 6


def test_a_key_never_reads_another_companys_memory(key_api, other_key_api, memory_agent, other_agent):
    written(memory_agent, "secret.md", "the vault code")
    for path in ("/memory", "/memory/secret.md"):
        assert_error(other_key_api.get(agent_url(memory_agent, path)), 404)
    assert_error(other_key_api.put(agent_url(memory_agent, "/memory/secret.md"), {"content": "mine"}), 404)
    assert_error(other_key_api.delete(agent_url(memory_agent, "/memory/secret.md")), 404)
    # The other company's agent, reached through this company's URL, is not found either.
    wrong = f"/api/companies/{memory_agent.company_id}/agents/{other_agent.id}/memory"
    assert_error(other_key_api.get(wrong), 404)
    assert key_api.get(agent_url(memory_agent, "/memory/secret.md")).json()["content"] == "the vault code"
    assert MemoryFile.objects.get(path="secret.md").content == "the vault code"


def test_an_api_write_records_the_key_not_the_secret(key_api, company_key, memory_agent):
    key_api.put(agent_url(memory_agent, "/memory/a.md"), {"content": "x"})
    version = MemoryFile.objects.get(path="a.md").versions.get()
    assert company_key[0].prefix in version.operator and company_key[1] not in version.operator


def test_config_validation_names_the_field(api, company):
    url = f"/api/companies/{company.id}/agents"
    for config, field in [
        ({"memory": "yes"}, "adapter_config.memory"),
        ({"memory": ["Bad Name"]}, "adapter_config.memory"),
        ({"max_tool_rounds": 0.5}, "adapter_config.max_tool_rounds"),
        ({"max_tool_rounds": 99}, "adapter_config.max_tool_rounds"),
        ({"clear_tool_uses": "on"}, "adapter_config.clear_tool_uses"),
        ({"clear_tool_uses": {"keep_tool_uses": -1}}, "adapter_config.clear_tool_uses.keep_tool_uses"),
        ({"clear_tool_uses": {"trigger": 5}}, "adapter_config.clear_tool_uses.trigger"),
    ]:
        response = api.post(url, {"name": "x", "adapter_type": "claude-code", "adapter_config": config})
        error = assert_error(response, 400)
        assert field in error["fields"], (config, error)
    ok = api.post(
        url,
        {
            "name": "ok",
            "adapter_type": "claude-code",
            "adapter_config": {"memory": ["team"], "max_tool_rounds": 3, "clear_tool_uses": {"keep_tool_uses": 2}},
        },
    )
    assert ok.status_code == 201, ok.content


@pytest.mark.django_db(transaction=True)
def test_a_write_arriving_while_the_agent_is_deleted_waits_for_the_deletion_and_answers_404(api, memory_agent):
    from django.utils import timezone

    from sessions_app.services import agent_delete
    from tests.conftest import Actor, WriteGate, wait_until_blocked

    written(memory_agent, "notes.md", "v1")
    url = agent_url(memory_agent, "/memory/notes.md")

    # The worst moment: the deletion is removing the agent's memory files (held at the
    # first, its transaction open) when the operator's write of one of them arrives.
    with WriteGate("memory_files", event="DELETE") as gate:
        deletion = Actor(lambda: agent_delete(agent=memory_agent, now=timezone.now()))
        deletion.start()
        gate.wait_entered()
        write = Actor(lambda: api.put(url, {"content": "v2"}))
        write.start()
        wait_until_blocked(write)
        gate.open()
        deletion.result()
        response = write.result()

    assert_error(response, 404, "agent_deleted")
    assert not MemoryStore.objects.filter(agent=memory_agent).exists()
    assert not MemoryFile.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_first_write_whose_agent_is_deleted_as_its_store_is_made_leaves_no_store(api, memory_agent):
    from django.utils import timezone

    from sessions_app.services import agent_delete
    from tests.conftest import Actor, WriteGate, wait_until_blocked

    url = agent_url(memory_agent, "/memory/notes.md")

    # The worst moment: the operator's first write is making the agent's store (its insert
    # held at a gate, uncommitted) when the agent's deletion runs.
    with WriteGate("memory_stores", event="INSERT") as gate:
        write = Actor(lambda: api.put(url, {"content": "v1"}))
        write.start()
        gate.wait_entered()
        deletion = Actor(lambda: agent_delete(agent=memory_agent, now=timezone.now()))
        deletion.start()
        wait_until_blocked(deletion)  # before: it did not wait, and missed the store being made
        gate.open()
        deletion.result()
        response = write.result()

    # Written before the deletion committed (then deleted with the rest), or refused after it.
    assert response.status_code == 200 or assert_error(response, 404, "agent_deleted")
    assert not MemoryStore.objects.filter(agent=memory_agent).exists()
    assert not MemoryFile.objects.exists()
