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
