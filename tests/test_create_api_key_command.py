"""`manage.py create_api_key --company ID [--name N]`: a name the key row cannot store is
refused as the other commands refuse bad arguments, before any key is made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command

from sessions_app.api_keys import api_key_authenticate
from sessions_app.models import ApiKey
from tests.conftest import ROOT, database_environment


def test_a_key_is_created_with_its_name_and_printed_once(company, capsys):
    call_command("create_api_key", "--company", str(company.pk), "--name", "ci-" + "é" * 197)

    plaintext = capsys.readouterr().out.strip()
    key = ApiKey.objects.get()
    assert (key.company_id, key.name) == (company.pk, "ci-" + "é" * 197)
    assert api_key_authenticate(plaintext=plaintext, now=key.created_at).pk == key.pk


@pytest.mark.parametrize(
    ("name", "message"),
    [
        # Command-line bytes that are not UTF-8 arrive as lone surrogates (surrogateescape).
        ("\udcff\udcfe", "--name must be valid UTF-8 text without NUL characters."),
        ("ci\x00", "--name must be valid UTF-8 text without NUL characters."),
        # SQLite does not enforce the column's length: it would be stored whole.
        ("x" * 201, "--name is 201 characters; the limit is 200."),
    ],
    ids=["not-utf-8", "nul", "too-long"],
)
def test_a_name_the_row_cannot_store_is_a_command_error(company, name, message):
    with pytest.raises(CommandError) as refused:
        call_command("create_api_key", "--company", str(company.pk), "--name", name)
    assert str(refused.value) == message
    assert not ApiKey.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_name_in_bytes_that_are_not_utf_8_is_one_line_on_stderr_not_a_traceback(company, settings):
    done = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "--company", str(company.pk), "--name", b"\xff\xfe"],
        cwd=ROOT,
        env={**os.environ, **database_environment(settings)},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "CommandError: --name must be valid UTF-8 text without NUL characters.\n"
    assert not ApiKey.objects.exists()
