"""`manage.py serve` (what `scripts/run` runs): a restart does only what changed. The whole
command, with its forked web server and cluster, runs in tests/live/test_documented_commands.py."""

from __future__ import annotations

import os
from io import StringIO

import pytest

from sessions_app.management.commands.serve import Command, serving_line


def preparation() -> tuple[Command, StringIO]:
    out = StringIO()
    return Command(stdout=out), out


@pytest.fixture
def static_sources(settings, tmp_path):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "console.css").write_text("body { color: black; }")
    settings.STATICFILES_DIRS = [sources]
    settings.STATIC_ROOT = tmp_path / "static"
    settings.STATIC_ROOT.mkdir()
    return sources


def test_static_files_are_collected_again_only_when_a_source_changed(static_sources, settings):
    command, out = preparation()
    command.collect_static()
    assert "collecting static files" in out.getvalue()
    assert (settings.STATIC_ROOT / "console.css").exists()
    assert (settings.STATIC_ROOT / "admin" / "css" / "base.css").exists()

    command, out = preparation()
    command.collect_static()
    assert out.getvalue() == ""  # a restart: nothing changed, nothing copied

    css = static_sources / "console.css"
    css.write_text("body { color: navy; }")
    os.utime(css, ns=(css.stat().st_atime_ns, css.stat().st_mtime_ns + 1_000_000_000))
    command, out = preparation()
    command.collect_static()
    assert "collecting static files" in out.getvalue()
    assert "navy" in (settings.STATIC_ROOT / "console.css").read_text()


def test_a_migrated_database_is_not_migrated_again(db):
    command, out = preparation()
    command.migrate()
    command.create_cache_table()
    assert out.getvalue() == ""


def test_the_cache_table_is_created_when_it_is_missing(transactional_db, settings):
    from django.db import connection

    with connection.schema_editor() as editor:
        editor.execute(f"DROP TABLE {connection.ops.quote_name(settings.CACHES['default']['LOCATION'])}")
    command, out = preparation()
    command.create_cache_table()
    assert "creating the cache table" in out.getvalue()
    assert settings.CACHES["default"]["LOCATION"] in connection.introspection.table_names()


def test_the_serving_line_names_what_ctrl_c_stops():
    assert serving_line("http://localhost:3100", cluster_workers=None, seconds=1.24) == (
        "serving http://localhost:3100, started in 1.2 s; Ctrl-C stops it"
    )
    assert serving_line("http://localhost:3100", cluster_workers=4, seconds=3.0) == (
        "serving http://localhost:3100 and the task cluster (4 workers), started in 3.0 s; Ctrl-C stops both"
    )
