"""Memory stores and the memory tool, without a model: paths, limits, versions, sharing,
deletion with the agent, and concurrent writers."""

from __future__ import annotations

import threading

import pytest
from anthropic.lib.tools import ToolError
from django.db import connection
from django.utils import timezone

from memory_app.models import MemoryAccess, MemoryFile, MemoryStore, MemoryStoreShare, MemoryVersion, MemoryWriter
from memory_app.stores import MemoryFault, Writer, file_write, mounts_for, version_revert
from memory_app.tool import StoreMemoryTool, tool_result
from sessions_app.models import Agent
from sessions_app.services import agent_delete, agents_hard_delete


@pytest.fixture
def memory_agent(company):
    return Agent.objects.create(company=company, name="Rememberer", adapter_config={"memory": True})


def tool_for(agent, operator="tester") -> StoreMemoryTool:
    return StoreMemoryTool(mounts_for(agent), writer=Writer(operator=operator))


def content(agent, path: str, store: str = "default") -> str:
    return MemoryFile.objects.get(store__agent=agent, store__name=store, path=path, deleted=False).content


@pytest.mark.parametrize(
    "path",
    [
        "/memories/../etc/passwd",
        "/memories/notes/../../secret",
        "/etc/passwd",
        "memories/notes.md",
        "/memoriesX/notes.md",
        "/memories//notes.md",
        "/memories/./notes.md",
        "/memories/a\x00b",
        "/memories/a\\..\\b",
        "/memories/" + "x" * 600,
        None,
        42,
    ],
)
def test_paths_outside_memories_are_tool_errors(memory_agent, path):
    tool = tool_for(memory_agent)
    result = tool_result(tool, {"id": "t1", "input": {"command": "create", "path": path, "file_text": "x"}})
    assert result["is_error"] is True
    assert result["tool_use_id"] == "t1"
    assert MemoryFile.objects.count() == 0


@pytest.mark.parametrize(
    "command",
    [
        {"command": "explode", "path": "/memories/a.md"},
        {"path": "/memories/a.md"},
        {"command": "view"},
        {"command": "view", "path": "/memories/missing.md"},
        {"command": "create", "path": "/memories/a.md"},
        {"command": "create", "path": "/memories/a.md", "file_text": 7},
        {"command": "create", "path": "/memories", "file_text": "x"},
        {"command": "str_replace", "path": "/memories/missing.md", "old_str": "a", "new_str": "b"},
        {"command": "insert", "path": "/memories/missing.md", "insert_line": 0, "insert_text": "x"},
        {"command": "delete", "path": "/memories"},
        {"command": "delete", "path": "/memories/missing.md"},
        {"command": "rename", "old_path": "/memories/missing.md", "new_path": "/memories/b.md"},
        {"command": "view", "path": "/memories/x", "view_range": "all"},
    ],
)
def test_bad_commands_are_tool_errors(memory_agent, command):
    result = tool_result(tool_for(memory_agent), {"id": "t1", "input": command})
    assert result["is_error"] is True, result
    assert isinstance(result["content"], str) and result["content"]


def test_not_an_object_is_a_tool_error(memory_agent):
    assert tool_result(tool_for(memory_agent), {"id": "t1", "input": "view /memories"})["is_error"] is True


def test_the_commands_work_and_every_write_is_a_version(memory_agent):
    tool = tool_for(memory_agent)
    tool.call({"command": "create", "path": "/memories/notes.md", "file_text": "alpha\nbeta"})
    tool.call({"command": "str_replace", "path": "/memories/notes.md", "old_str": "beta", "new_str": "gamma"})
    tool.call({"command": "insert", "path": "/memories/notes.md", "insert_line": 1, "insert_text": "middle\n"})
    assert content(memory_agent, "notes.md") == "alpha\nmiddle\ngamma"
    viewed = tool.call({"command": "view", "path": "/memories/notes.md"})
    assert "     2\tmiddle" in viewed
    assert "     1\talpha" not in tool.call({"command": "view", "path": "/memories/notes.md", "view_range": [2, -1]})
    tool.call({"command": "rename", "old_path": "/memories/notes.md", "new_path": "/memories/archive/notes.md"})
    listing = tool.call({"command": "view", "path": "/memories"})
    assert "/memories/archive/notes.md" in listing and "/memories/notes.md" not in listing
    tool.call({"command": "delete", "path": "/memories/archive"})
    assert "archive" not in tool.call({"command": "view", "path": "/memories"})
    old = MemoryFile.objects.get(path="notes.md")
    assert [v.operation for v in old.versions.order_by("number")] == ["create", "str_replace", "insert", "rename"]
    assert [v.content for v in old.versions.order_by("number")][:2] == ["alpha\nbeta", "alpha\ngamma"]
    assert old.versions.order_by("number").last().content is None
    assert {v.written_by for v in MemoryVersion.objects.all()} == {MemoryWriter.OPERATOR}


def test_paths_are_case_sensitive_on_every_database(memory_agent):
    """SQLite's LIKE (Django's `__startswith`) ignores ASCII case: `Notes` named the folder
    `notes/` for delete, view and rename, and a file `Notes` clashed with that folder."""
    tool = tool_for(memory_agent)
    tool.call({"command": "create", "path": "/memories/notes/a.md", "file_text": "a"})
    tool.call({"command": "create", "path": "/memories/notes/b.md", "file_text": "b"})

    for command in (
        {"command": "delete", "path": "/memories/Notes"},
        {"command": "view", "path": "/memories/Notes"},
        {"command": "rename", "old_path": "/memories/Notes", "new_path": "/memories/moved"},
    ):
        result = tool_result(tool, {"id": "t", "input": command})
        assert result["is_error"] and "does not exist" in result["content"], (command, result)
    assert sorted(MemoryFile.objects.filter(deleted=False).values_list("path", flat=True)) == [
        "notes/a.md",
        "notes/b.md",
    ]

    tool.call({"command": "create", "path": "/memories/Notes", "file_text": "a file beside the folder"})
    tool.call({"command": "create", "path": "/memories/NOTES/c.md", "file_text": "another folder"})
    assert "notes/a.md" in tool.call({"command": "view", "path": "/memories/notes"})
    assert "NOTES" not in tool.call({"command": "view", "path": "/memories/notes"})
    tool.call({"command": "delete", "path": "/memories/NOTES"})
    assert sorted(MemoryFile.objects.filter(deleted=False).values_list("path", flat=True)) == [
        "Notes",
        "notes/a.md",
        "notes/b.md",
    ]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ({"command": "view", "path": "/memories/team/gone.md"}, "The path /memories/team/gone.md does not exist."),
        ({"command": "view", "path": "/memories/spare/gone.md"}, "The path /memories/spare/gone.md does not exist."),
        ({"command": "create", "path": "/memories/team", "file_text": "x"}, "/memories/team is a directory;"),
        (
            {"command": "create", "path": "/memories/team/notes", "file_text": "x"},
            "/memories/team/notes is a directory",
        ),
        (
            {"command": "create", "path": "/memories/team/b.md/c.md", "file_text": "x"},
            "/memories/team/b.md/c.md is a directory or lies inside a file.",
        ),
        (
            {"command": "create", "path": "/memories/team/big.md", "file_text": "x" * 101},
            "/memories/team/big.md would be 101 bytes",
        ),
        (
            {"command": "str_replace", "path": "/memories/team/b.md", "old_str": "b", "new_str": "x" * 101},
            "/memories/team/b.md would be 101 bytes",
        ),
        (
            {"command": "str_replace", "path": "/memories/team/b.md", "old_str": "z", "new_str": "y"},
            "did not appear verbatim in /memories/team/b.md.",
        ),
        (
            {"command": "insert", "path": "/memories/team/gone.md", "insert_line": 0, "insert_text": "x"},
            "The path /memories/team/gone.md does not exist.",
        ),
        (
            {"command": "insert", "path": "/memories/team", "insert_line": 0, "insert_text": "x"},
            "/memories/team is a directory;",
        ),
        ({"command": "delete", "path": "/memories/team/gone.md"}, "The path /memories/team/gone.md does not exist."),
        ({"command": "delete", "path": "/memories/spare/gone.md"}, "The path /memories/spare/gone.md does not exist."),
        ({"command": "delete", "path": "/memories/team"}, "Cannot delete the /memories/team directory itself."),
        (
            {"command": "rename", "old_path": "/memories/team/gone.md", "new_path": "/memories/team/c.md"},
            "The path /memories/team/gone.md does not exist.",
        ),
        (
            {"command": "rename", "old_path": "/memories/spare/gone.md", "new_path": "/memories/spare/c.md"},
            "The path /memories/spare/gone.md does not exist.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team", "new_path": "/memories/team/c"},
            "Cannot rename the /memories/team directory itself.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/b.md", "new_path": "/memories/team"},
            "The destination /memories/team already exists.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/b.md", "new_path": "/memories/team/notes/a.md"},
            "The destination /memories/team/notes/a.md already exists.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/old", "new_path": "/memories/team/notes"},
            "The destination /memories/team/notes/a.md already exists.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/b.md", "new_path": "/memories/team/notes"},
            "/memories/team/notes is a directory or lies inside a file.",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/notes", "new_path": "/memories/team/notes/deeper"},
            "Cannot rename /memories/team/notes to /memories/team/notes/deeper:",
        ),
        (
            {"command": "rename", "old_path": "/memories/team/b.md", "new_path": "/memories/b.md"},
            "Cannot rename /memories/team/b.md to /memories/b.md: they are in different memory stores",
        ),
    ],
)
def test_a_tool_error_in_a_named_store_names_the_path_with_its_folder(memory_agent, settings, command, message):
    """Each refusal names the path as the model wrote it. Before: a named store's file was
    named by its path inside the store, as if in the default one (`/memories/gone.md` for
    /memories/team/gone.md), and the store's own folder as /memories."""
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 100
    memory_agent.adapter_config = {"memory": ["team", "spare"]}  # spare: no write has made it
    memory_agent.save()
    tool = tool_for(memory_agent)
    for path in ("team/notes/a.md", "team/old/a.md", "team/b.md"):
        tool.call({"command": "create", "path": f"/memories/{path}", "file_text": path[-4]})
    versions = MemoryVersion.objects.count()

    result = tool_result(tool, {"id": "t", "input": command})

    assert result["is_error"] and message in result["content"], result
    assert MemoryVersion.objects.count() == versions
    assert list(MemoryStore.objects.values_list("name", flat=True)) == ["team"]


def test_a_rename_that_would_build_a_path_over_the_limit_is_a_tool_error(memory_agent):
    """Each path named is within 512 characters, but a folder's file moved below a longer
    name is not: on PostgreSQL the column refused it (DataError: the run failed
    internal_error); SQLite stored a file nobody could name again to read or delete."""
    tool = tool_for(memory_agent)
    deep = "/memories/d/" + "f" * 490
    tool.call({"command": "create", "path": deep, "file_text": "deep"})
    versions = MemoryVersion.objects.count()

    result = tool_result(
        tool,
        {"id": "t", "input": {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/" + "e" * 30}},
    )

    assert result["is_error"] and "512" in result["content"], result
    assert list(MemoryFile.objects.filter(deleted=False).values_list("path", flat=True)) == ["d/" + "f" * 490]
    assert MemoryVersion.objects.count() == versions
    assert tool.call({"command": "view", "path": deep}).endswith("deep")


def test_a_deleted_file_created_again_continues_its_versions_and_can_be_reverted(memory_agent):
    tool = tool_for(memory_agent)
    tool.call({"command": "create", "path": "/memories/a.md", "file_text": "one"})
    tool.call({"command": "delete", "path": "/memories/a.md"})
    tool.call({"command": "create", "path": "/memories/a.md", "file_text": "two"})
    found = MemoryFile.objects.get(path="a.md")
    assert found.version == 3
    first = found.versions.get(number=1)
    version_revert(mounts_for(memory_agent)[0], first, writer=Writer(operator="ops"))
    found.refresh_from_db()
    assert (found.content, found.version) == ("one", 4)
    assert found.versions.get(number=4).operation == "revert"


def test_a_file_over_the_size_limit_is_a_tool_error(memory_agent, settings):
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 100
    tool = tool_for(memory_agent)
    result = tool_result(
        tool, {"id": "t", "input": {"command": "create", "path": "/memories/big.md", "file_text": "é" * 51}}
    )
    assert result["is_error"] and "102 bytes" in result["content"] and "100" in result["content"]
    tool.call({"command": "create", "path": "/memories/big.md", "file_text": "x" * 100})
    grown = tool_result(
        tool,
        {"id": "t", "input": {"command": "insert", "path": "/memories/big.md", "insert_line": 0, "insert_text": "y"}},
    )
    assert grown["is_error"]
    assert content(memory_agent, "big.md") == "x" * 100


def test_a_store_over_its_limit_refuses_growth_but_not_shrinking(memory_agent, settings):
    settings.PAPERCLIP_MEMORY_MAX_STORE_BYTES = 150
    tool = tool_for(memory_agent)
    tool.call({"command": "create", "path": "/memories/a.md", "file_text": "a" * 100})
    full = tool_result(
        tool, {"id": "t", "input": {"command": "create", "path": "/memories/b.md", "file_text": "b" * 60}}
    )
    assert full["is_error"] and "PAPERCLIP_MEMORY_MAX_STORE_BYTES" in full["content"]
    tool.call({"command": "create", "path": "/memories/a.md", "file_text": "a" * 10})
    tool.call({"command": "create", "path": "/memories/b.md", "file_text": "b" * 60})
    assert MemoryStore.objects.get(agent=memory_agent).bytes_used == 70
    tool.call({"command": "delete", "path": "/memories/b.md"})
    assert MemoryStore.objects.get(agent=memory_agent).bytes_used == 10


def test_old_versions_are_pruned_past_the_setting(memory_agent, settings):
    settings.PAPERCLIP_MEMORY_VERSIONS_KEPT = 3
    tool = tool_for(memory_agent)
    for n in range(6):
        tool.call({"command": "create", "path": "/memories/a.md", "file_text": f"v{n}"})
    assert list(MemoryVersion.objects.order_by("number").values_list("number", flat=True)) == [4, 5, 6]


def test_the_versions_of_deleted_files_are_pruned_past_the_setting(memory_agent, settings):
    """Create/delete cycles over new paths: each deleted file keeps its row and versions
    (the store's byte limit counts live files only), so they grew without bound."""
    settings.PAPERCLIP_MEMORY_DELETED_FILES_KEPT = 3
    tool = tool_for(memory_agent)
    for n in range(10):
        tool.call({"command": "create", "path": f"/memories/scratch-{n}.md", "file_text": f"note {n}"})
        tool.call({"command": "delete", "path": f"/memories/scratch-{n}.md"})
    tool.call({"command": "create", "path": "/memories/kept.md", "file_text": "live"})
    tool.call({"command": "rename", "old_path": "/memories/kept.md", "new_path": "/memories/moved.md"})

    deleted = MemoryFile.objects.filter(deleted=True).order_by("path")
    assert list(deleted.values_list("path", flat=True)) == ["kept.md", "scratch-8.md", "scratch-9.md"]
    assert MemoryVersion.objects.filter(file__deleted=True).count() == 6  # each: its content, its deletion
    assert content(memory_agent, "moved.md") == "live"
    # The newest deleted ones can still be restored from their versions.
    tool.call({"command": "create", "path": "/memories/scratch-9.md", "file_text": "back"})
    assert MemoryFile.objects.get(path="scratch-9.md").version == 3
    # 0: a deleted file is forgotten at once, versions and all.
    settings.PAPERCLIP_MEMORY_DELETED_FILES_KEPT = 0
    assert tool.call({"command": "delete", "path": "/memories/scratch-9.md"}).startswith("Successfully deleted")
    assert not MemoryFile.objects.filter(deleted=True).exists()
    assert not MemoryVersion.objects.filter(file__path__startswith="scratch").exists()


def test_a_shared_store_is_mounted_by_name_read_only_or_read_write(company, memory_agent):
    team = MemoryStore.objects.create(company=company, agent=memory_agent, name="team")
    reader = Agent.objects.create(company=company, name="Reader", adapter_config={"memory": ["team"]})
    writer = Agent.objects.create(company=company, name="Writer", adapter_config={"memory": ["team"]})
    MemoryStoreShare.objects.create(store=team, agent=reader, access=MemoryAccess.READ)
    MemoryStoreShare.objects.create(store=team, agent=writer, access=MemoryAccess.WRITE)
    tool_for(writer).call({"command": "create", "path": "/memories/team/plan.md", "file_text": "ship it"})
    assert content(memory_agent, "plan.md", store="team") == "ship it"
    assert "ship it" in tool_for(reader).call({"command": "view", "path": "/memories/team/plan.md"})
    refused = tool_result(
        tool_for(reader), {"id": "t", "input": {"command": "delete", "path": "/memories/team/plan.md"}}
    )
    assert refused["is_error"] and "read-only" in refused["content"]
    # The reader's own default store is beside it, writable.
    tool_for(reader).call({"command": "create", "path": "/memories/mine.md", "file_text": "x"})
    assert "/memories/team/" in tool_for(reader).call({"command": "view", "path": "/memories"})


def test_another_companys_store_is_never_mounted(company, other_company, memory_agent):
    foreign = Agent.objects.create(company=other_company, name="Foreign", adapter_config={"memory": ["team"]})
    team = MemoryStore.objects.create(company=company, agent=memory_agent, name="team")
    MemoryStoreShare.objects.create(store=team, agent=foreign, access=MemoryAccess.WRITE)
    mounts = mounts_for(foreign)
    assert all(mount.store.company_id == other_company.id for mount in mounts)


def test_retiring_an_agent_deletes_its_memory(memory_agent):
    tool_for(memory_agent).call({"command": "create", "path": "/memories/a.md", "file_text": "x"})
    agent_delete(agent=memory_agent, now=timezone.now())
    assert not MemoryStore.objects.exists() and not MemoryFile.objects.exists() and not MemoryVersion.objects.exists()


@pytest.mark.parametrize("how", ["queryset", "service"])
def test_deleting_agents_deletes_their_memory(company, memory_agent, how):
    other = Agent.objects.create(company=company, name="Keeper", adapter_config={"memory": True})
    tool_for(memory_agent).call({"command": "create", "path": "/memories/a.md", "file_text": "x"})
    tool_for(other).call({"command": "create", "path": "/memories/b.md", "file_text": "y"})
    if how == "queryset":  # the admin's bulk action ends in QuerySet.delete()
        Agent.objects.filter(pk=memory_agent.pk).delete()
    else:
        agents_hard_delete(agents=Agent.objects.filter(pk=memory_agent.pk), now=timezone.now())
    assert list(MemoryFile.objects.values_list("path", flat=True)) == ["b.md"]


def test_an_operator_edit_of_a_version_that_moved_on_is_refused(memory_agent):
    mount = mounts_for(memory_agent)[0]
    file_write(mount, "a.md", lambda current: "one", operation="edit", writer=Writer(operator="a"))
    file_write(mount, "a.md", lambda current: "two", operation="edit", writer=Writer(operator="b"), expected_version=1)
    with pytest.raises(MemoryFault) as refused:
        file_write(mount, "a.md", lambda c: "three", operation="edit", writer=Writer(operator="a"), expected_version=1)
    assert refused.value.code == "memory_version_conflict"
    assert content(memory_agent, "a.md") == "two"


def test_a_tool_error_inside_a_write_leaves_nothing_written(memory_agent):
    tool = tool_for(memory_agent)
    tool.call({"command": "create", "path": "/memories/a.md", "file_text": "one one"})
    with pytest.raises(ToolError):
        tool.call({"command": "str_replace", "path": "/memories/a.md", "old_str": "one", "new_str": "two"})
    assert MemoryFile.objects.get(path="a.md").version == 1


@pytest.mark.django_db(transaction=True)
def test_a_writer_waits_for_the_one_holding_the_store_and_then_sees_its_write(postgres_only, company):
    """The worst moment: writer B arrives while A has read the file and not yet committed.
    B must wait for A's commit and then change A's content, never the content A replaced."""
    agent = Agent.objects.create(company=company, name="Shared", adapter_config={"memory": True})
    mount = mounts_for(agent)[0]
    file_write(mount, "log.md", lambda current: "start", operation="create", writer=Writer(operator="setup"))
    a_inside, release_a, b_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def writer_a():
        def change(current):
            a_inside.set()
            release_a.wait(10)
            return current + "\nfrom A"

        try:
            file_write(mount, "log.md", change, operation="insert", writer=Writer(operator="a"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    def writer_b():
        try:
            file_write(mount, "log.md", lambda current: current + "\nfrom B", operation="insert", writer=Writer())
            b_done.set()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    a = threading.Thread(target=writer_a)
    a.start()
    assert a_inside.wait(10)
    b = threading.Thread(target=writer_b)
    b.start()
    assert not b_done.wait(0.5), "B wrote while A held the store"
    release_a.set()
    a.join(10)
    b.join(10)
    assert errors == []
    assert content(agent, "log.md") == "start\nfrom A\nfrom B"
    assert MemoryFile.objects.get(path="log.md").version == 3


@pytest.mark.django_db(transaction=True)
def test_first_writes_at_once_make_one_store_and_both_land(postgres_only, company):
    # Each writer's mount holds the store not made yet; the first write makes it, in its own
    # transaction, and the other, waiting for the agent's row, then writes into that one.
    agent = Agent.objects.create(company=company, name="Fresh", adapter_config={"memory": True})
    start = threading.Barrier(2)
    errors = []

    def writer(name):
        try:
            mount = mounts_for(agent)[0]
            start.wait(10)
            file_write(mount, f"{name}.md", lambda current: name, operation="create", writer=Writer(operator=name))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("ab", "cde")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    store = MemoryStore.objects.get(agent=agent)
    assert sorted(store.files.values_list("path", flat=True)) == ["ab.md", "cde.md"]
    assert store.bytes_used == 5


@pytest.mark.django_db(transaction=True)
def test_many_concurrent_writers_lose_no_write(postgres_only, company, settings):
    agent = Agent.objects.create(company=company, name="Busy", adapter_config={"memory": True})
    mount = mounts_for(agent)[0]
    file_write(mount, "log.md", lambda current: "", operation="create", writer=Writer(operator="setup"))
    start = threading.Barrier(4)
    errors = []

    def writer(name):
        try:
            start.wait(10)
            for n in range(10):
                tool = StoreMemoryTool(mounts_for(agent), writer=Writer(operator=name))
                tool.call(
                    {"command": "insert", "path": "/memories/log.md", "insert_line": 0, "insert_text": f"{name}{n}"}
                )
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(name,)) for name in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    lines = set(content(agent, "log.md").split("\n")) - {""}
    assert lines == {f"{name}{n}" for name in "abcd" for n in range(10)}
    assert MemoryFile.objects.get(path="log.md").version == 41
