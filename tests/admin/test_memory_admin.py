"""Memory in the admin: files with versions and diffs, operator edits as versions, revert,
deletes as versions, refusals as messages; stores added for an agent of their company."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from memory_app.admin import MemoryStoreForm
from memory_app.models import MemoryFile, MemoryStore, MemoryStoreShare, MemoryWriter
from memory_app.stores import Writer, mounts_for
from memory_app.tool import StoreMemoryTool
from sessions_app.models import Agent, AgentStatus
from sessions_app.services import agent_delete
from tests.conftest import Actor, wait_until_blocked


@pytest.fixture
def memory_agent(company):
    return Agent.objects.create(company=company, name="Rememberer", adapter_config={"memory": True})


def write(agent, path: str, text: str, **writer) -> MemoryFile:
    StoreMemoryTool(mounts_for(agent), writer=Writer(**(writer or {"operator": "setup"}))).call(
        {"command": "create", "path": f"/memories/{path}", "file_text": text}
    )
    return MemoryFile.objects.get(store__agent=agent, path=path)


def change_url(found: MemoryFile) -> str:
    return reverse("admin:memory_app_memoryfile_change", args=[found.pk])


def test_the_file_page_shows_versions_with_diffs_and_revert_buttons(admin_client, memory_agent):
    write(memory_agent, "notes.md", "alpha\nbeta")
    found = write(memory_agent, "notes.md", "alpha\ngamma <b>")
    page = admin_client.get(change_url(found)).content.decode()
    assert "Revert to this version" in page and page.count('class="memory-revert"') == 2
    assert "-beta" in page and "+gamma &lt;b&gt;" in page  # escaped, never markup


def test_the_changelist_lists_files_in_a_bounded_number_of_queries(admin_client, memory_agent):
    for n in range(25):
        write(memory_agent, f"f{n}.md", "x")
    url = reverse("admin:memory_app_memoryfile_changelist")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(url).content.decode()
    assert "f24.md" in page and "Rememberer" in page
    assert len(queries) <= 12


def test_an_operator_edit_is_a_version_and_a_stale_form_is_refused(admin_client, admin_user, memory_agent):
    found = write(memory_agent, "notes.md", "one")
    form = {"content": "two", "loaded_version": "1", "_save": "Save"}
    response = admin_client.post(change_url(found), form)
    assert response.status_code == 302
    found.refresh_from_db()
    assert (found.content, found.version) == ("two", 2)
    version = found.versions.get(number=2)
    assert (version.written_by, version.operator) == (MemoryWriter.OPERATOR, f"admin {admin_user.username}")
    # The same stale form again: refused with a message, nothing written.
    response = admin_client.post(change_url(found), {**form, "content": "three"}, follow=True)
    assert "changed meanwhile" in response.content.decode()
    found.refresh_from_db()
    assert (found.content, found.version) == ("two", 2)


def test_revert_to_a_version_writes_it_back_as_a_new_version(admin_client, memory_agent):
    write(memory_agent, "notes.md", "first")
    found = write(memory_agent, "notes.md", "second")
    url = reverse("admin:memory_app_memoryfile_revert", args=[found.pk, 1])
    assert admin_client.get(url).status_code == 404  # only the button's POST reverts
    response = admin_client.post(url, follow=True)
    assert "Reverted notes.md to version 1" in response.content.decode()
    found.refresh_from_db()
    assert (found.content, found.version) == ("first", 3)
    assert found.versions.get(number=3).operation == "revert"


def test_an_operator_adds_a_file_to_a_store(admin_client, memory_agent):
    store = MemoryStore.objects.create(company=memory_agent.company, agent=memory_agent, name="default")
    add = reverse("admin:memory_app_memoryfile_add")
    bad = admin_client.post(add, {"store": str(store.pk), "path": "../etc/passwd", "content": "x"})
    assert bad.status_code == 200 and "escape" in bad.content.decode()
    response = admin_client.post(add, {"store": str(store.pk), "path": "plans/q3.md", "content": "grow"})
    assert response.status_code == 302
    found = MemoryFile.objects.get(path="plans/q3.md")
    assert found.versions.get().written_by == MemoryWriter.OPERATOR


def test_an_oversized_edit_is_a_message_not_an_error(admin_client, memory_agent, settings):
    found = write(memory_agent, "notes.md", "short")
    settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES = 10
    response = admin_client.post(
        change_url(found), {"content": "x" * 11, "loaded_version": "1", "_save": "Save"}, follow=True
    )
    assert response.status_code == 200 and "PAPERCLIP_MEMORY_MAX_FILE_BYTES" in response.content.decode()
    found.refresh_from_db()
    assert found.content == "short"


def test_the_bulk_delete_deletes_as_versions(admin_client, memory_agent):
    files = [write(memory_agent, f"f{n}.md", "x") for n in range(3)]
    url = reverse("admin:memory_app_memoryfile_changelist")
    response = admin_client.post(
        url, {"action": "delete_selected", "_selected_action": [f.pk for f in files], "post": "yes"}
    )
    assert response.status_code == 302
    assert set(MemoryFile.objects.values_list("deleted", flat=True)) == {True}
    assert all(f.versions.order_by("-number").first().operation == "delete" for f in files)
    assert MemoryStore.objects.get(agent=memory_agent).bytes_used == 0


STORE_ADD = "admin:memory_app_memorystore_add"


def store_form(company, agent, name: str = "team", *, share_with=None) -> dict:
    data = {"company": str(company.pk), "agent": str(agent.pk), "name": name}
    shares = [share_with] if share_with is not None else []
    data.update({"shares-TOTAL_FORMS": str(len(shares)), "shares-INITIAL_FORMS": "0"})
    for n, reader in enumerate(shares):
        data.update({f"shares-{n}-agent": str(reader.pk), f"shares-{n}-access": "read"})
    return data


def test_a_new_store_belongs_to_its_agents_company(admin_client, memory_agent, other_company, other_agent):
    # Filed under the other company, the store would have been listed there, and a share
    # with that company's agent accepted: a share of another company's memory.
    response = admin_client.post(reverse(STORE_ADD), store_form(other_company, memory_agent, share_with=other_agent))

    assert response.status_code == 200
    assert "company" in response.context["adminform"].form.errors
    assert not MemoryStore.objects.exists() and not MemoryStoreShare.objects.exists()

    response = admin_client.post(reverse(STORE_ADD), store_form(memory_agent.company, memory_agent))
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert MemoryStore.objects.get(agent=memory_agent).company_id == memory_agent.company_id


@pytest.mark.parametrize("name", ["../../x y", "Team", "team/notes", "-team", "team notes", "équipe"])
def test_a_new_store_has_a_name_an_agents_configuration_can_list(admin_client, memory_agent, name):
    response = admin_client.post(reverse(STORE_ADD), store_form(memory_agent.company, memory_agent, name))

    assert response.status_code == 200
    assert "name" in response.context["adminform"].form.errors
    assert not MemoryStore.objects.exists()


def test_a_store_added_by_name_is_the_one_the_configuration_mounts(admin_client, memory_agent):
    response = admin_client.post(reverse(STORE_ADD), store_form(memory_agent.company, memory_agent, "team-notes_2"))
    assert response.status_code == 302, response.context["adminform"].form.errors

    memory_agent.adapter_config = {"memory": ["team-notes_2"]}
    memory_agent.save()

    assert mounts_for(memory_agent)[1].store == MemoryStore.objects.get(name="team-notes_2")


def test_no_store_is_added_for_a_deleted_agent(admin_client, memory_agent):
    agent_delete(agent=memory_agent, now=timezone.now())

    response = admin_client.post(reverse(STORE_ADD), store_form(memory_agent.company, memory_agent))

    assert response.status_code == 200
    assert "agent" in response.context["adminform"].form.errors
    assert not MemoryStore.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_retiring_the_agent_while_a_store_is_added_deletes_that_store_too(memory_agent):
    """The form checked the agent; its retirement, arriving before the store is saved, must
    not leave a store behind for a deleted agent."""
    retire = Actor(lambda: agent_delete(agent=Agent.objects.get(pk=memory_agent.pk), now=timezone.now()))
    with transaction.atomic():  # as the admin's add view: validation and save in one transaction
        form = MemoryStoreForm(data=store_form(memory_agent.company, memory_agent))
        assert form.is_valid(), form.errors
        retire.start()
        wait_until_blocked(retire)
        form.save()
    retire.result()

    assert Agent.objects.get(pk=memory_agent.pk).status == AgentStatus.DELETED
    assert not MemoryStore.objects.exists()


def test_the_store_page_costs_the_same_queries_however_many_shares(admin_client, memory_agent, other_agent):
    store = MemoryStore.objects.create(company=memory_agent.company, agent=memory_agent)
    url = reverse("admin:memory_app_memorystore_change", args=[store.pk])

    def share_with(count: int) -> None:
        start = MemoryStoreShare.objects.count()
        for n in range(start, start + count):
            reader = Agent.objects.create(company=memory_agent.company, name=f"reader {n}")
            MemoryStoreShare.objects.create(store=store, agent=reader)

    def queries() -> tuple[int, str]:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(url)
        assert response.status_code == 200
        return len(captured), response.content.decode()

    share_with(2)
    queries()  # warm the per-process caches (content types)
    few, _ = queries()
    share_with(10)
    many, page = queries()
    assert many == few
    assert page.count("selected>reader ") == 12
    # Each share's agent is chosen among the store's company's agents only.
    assert "reader 11" in page and other_agent.name not in page


def page_queries(client, url: str) -> tuple[list[str], str]:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200
    return [query["sql"] for query in captured], response.content.decode()


def test_the_store_delete_page_counts_files_and_versions_without_reading_them(admin_client, memory_agent):
    for n in range(2):
        write(memory_agent, f"f{n}.md", "x" * 1000)
    store = mounts_for(memory_agent)[0].store
    url = reverse("admin:memory_app_memorystore_delete", args=[store.pk])
    page_queries(admin_client, url)  # warm the per-process caches (content types)
    few, _ = page_queries(admin_client, url)
    for n in range(2, 12):
        write(memory_agent, f"f{n}.md", "x" * 1000)
    many, page = page_queries(admin_client, url)
    assert len(many) == len(few)
    assert not [sql for sql in many if '"content"' in sql.split(" FROM ")[0]]
    assert "12 memory files" in page and "12 memory versions" in page


def test_the_file_delete_page_reads_no_version_it_keeps(admin_client, memory_agent):
    found = write(memory_agent, "notes.md", "one")
    for text in ("two", "three", "four"):
        found = write(memory_agent, "notes.md", text)
    queries, page = page_queries(admin_client, reverse("admin:memory_app_memoryfile_delete", args=[found.pk]))
    # A deletion is a version: the file's versions stay, so they are neither read nor listed.
    assert not [sql for sql in queries if 'FROM "memory_versions"' in sql]
    assert "version 1" not in page and "notes.md" in page


def test_the_file_list_reads_no_content_and_the_file_page_no_run(admin_client, memory_agent):
    from sessions_app.models import HeartbeatRun, RunStatus
    from tests.admin.conftest import make_run

    run = make_run(memory_agent, status=RunStatus.RUNNING, task="t" * 5000)
    found = write(memory_agent, "notes.md", "x" * 5000, run_id=run.id)
    HeartbeatRun.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, output="o" * 5000)
    _, page = page_queries(admin_client, reverse("admin:memory_app_memoryfile_changelist"))
    listing, _ = page_queries(admin_client, reverse("admin:memory_app_memoryfile_changelist"))
    assert "notes.md" in page
    assert not [sql for sql in listing if '"content"' in sql.split(" FROM ")[0]]
    file_page, page = page_queries(admin_client, change_url(found))
    assert f"run {run.id}" in page
    # The versions name their run by id: its task and output are never read.
    assert not [
        sql for sql in file_page if 'FROM "heartbeat_runs"' in sql or "heartbeat_runs" in sql.split(" FROM ")[0]
    ]


def test_the_store_list_reads_its_agents_names_not_their_prompts(admin_client, memory_agent):
    memory_agent.system_prompt = "You are thorough. " * 500
    memory_agent.save()
    write(memory_agent, "notes.md", "x")
    queries, page = page_queries(admin_client, reverse("admin:memory_app_memorystore_changelist"))
    assert memory_agent.name in page
    assert not [sql for sql in queries if '"system_prompt"' in sql.split(" FROM ")[0]]
