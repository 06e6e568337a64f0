"""The usual cast: a company, its stateless and persistent agents, and another company."""

from __future__ import annotations

from importlib import import_module

import pytest
from django.db import connection

from sessions_app.models import Agent, Company
from tests.fake_anthropic import FakeAnthropic

FAKE_API_KEY = "sk-ant-test-0000-secret-never-logged"


@pytest.fixture(autouse=True)
def plain_static_files(settings):
    # The hashed manifest exists only after collectstatic (done by the run command).
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture(autouse=True)
def paperclip_home(settings, tmp_path):
    """Each test gets its own sandbox folder for history files."""
    home = tmp_path / "paperclip-home"
    home.mkdir()
    settings.PAPERCLIP_HOME = home
    return home


@pytest.fixture(autouse=True)
def seeded_list_prices(request):
    """A transactional test ends by emptying every table, rows of data migrations included;
    put the seeded list prices back before each one, so that none depends on running first."""
    marker = request.node.get_closest_marker("django_db")
    transactional = marker is not None and bool(marker.kwargs.get("transaction") or marker.args[:1] == (True,))
    if not (transactional or "live_server" in request.fixturenames):
        return
    request.getfixturevalue("transactional_db")
    from django.apps import apps

    import_module("costs_app.migrations.0002_seed_list_prices").seed_prices(apps, None)


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (run with DATABASE_URL=postgres://...)")


@pytest.fixture
def refuse_at_commit(transactional_db):
    """Make the COMMIT of a transaction fail when it made a chosen write.

    A deferred check runs only at COMMIT, after every statement succeeded: the failure a
    caller cannot see coming (a deferred constraint). On PostgreSQL a deferred constraint
    trigger raises; SQLite has none, so its trigger leaves a dangling deferred foreign key.
    Call it with a table and a WHEN condition; it is removed after the test (and by calling
    the returned function).
    """
    installed = []

    def install(table: str, *, when: str, event: str = "UPDATE"):
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "CREATE FUNCTION paperclip_test_refuse_commit() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'refused at commit by a test trigger'; END $$"
                )
                cursor.execute(
                    f"CREATE CONSTRAINT TRIGGER paperclip_test_refuse_commit AFTER {event} ON {table} "
                    f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ({when}) "
                    "EXECUTE FUNCTION paperclip_test_refuse_commit()"
                )
            else:
                cursor.execute("CREATE TABLE paperclip_test_parent (id INTEGER PRIMARY KEY)")
                cursor.execute(
                    "CREATE TABLE paperclip_test_dangling (parent_id INTEGER "
                    "REFERENCES paperclip_test_parent (id) DEFERRABLE INITIALLY DEFERRED)"
                )
                dangle = "INSERT INTO paperclip_test_dangling VALUES (-1);"
                cursor.execute(
                    f"CREATE TRIGGER paperclip_test_refuse_commit AFTER {event} ON {table} FOR EACH ROW "
                    f"WHEN {when} BEGIN {dangle} END"
                )
        installed.append(table)
        return lambda: remove(table)

    def remove(table: str) -> None:
        if table not in installed:
            return
        installed.remove(table)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER IF EXISTS paperclip_test_refuse_commit ON {table}")
                cursor.execute("DROP FUNCTION IF EXISTS paperclip_test_refuse_commit()")
            else:
                cursor.execute("DROP TRIGGER IF EXISTS paperclip_test_refuse_commit")
                cursor.execute("DROP TABLE IF EXISTS paperclip_test_dangling")
                cursor.execute("DROP TABLE IF EXISTS paperclip_test_parent")

    yield install
    for table in list(installed):
        remove(table)


@pytest.fixture
def company(db):
    return Company.objects.create(name="Acme")


@pytest.fixture
def other_company(db):
    return Company.objects.create(name="Globex")


@pytest.fixture
def stateless_agent(company):
    return Agent.objects.create(
        company=company,
        name="Stateless",
        system_prompt="You are terse.",
        adapter_type="claude-code",
        adapter_config={"model": "claude-opus-4-5"},
    )


@pytest.fixture
def persistent_agent(company):
    return Agent.objects.create(
        company=company,
        name="Persistent",
        system_prompt="You remember.",
        adapter_type="claude-code",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "session_ttl_hours": 24},
    )


@pytest.fixture
def other_agent(other_company):
    return Agent.objects.create(
        company=other_company,
        name="Foreign",
        adapter_type="claude-code",
        adapter_config={"model": "claude-haiku-4-5", "session_mode": "persistent"},
    )


@pytest.fixture
def fake_anthropic(monkeypatch):
    """A fake Messages API on 127.0.0.1 that the real SDK reaches through the environment."""
    fake = FakeAnthropic().start()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", FAKE_API_KEY)
    yield fake
    fake.stop()


def on_own_connection(action):
    """`action` for `Reply.during`: it runs on the fake's thread, with that thread's own
    database connection, closed afterwards (a second actor, as another process would be)."""

    def run():
        try:
            action()
        finally:
            connection.close()

    return run
