"""RELIABILITY.md names the test that proves each promise: each named test exists, in the
file the table names for it, so that a renamed or moved test cannot leave a promise resting
on a test that no longer runs."""

from __future__ import annotations

import re

from tests.conftest import ROOT

# In a row, `tests/a.py::test_x` names a test and its file; `tests/a.py` alone names the file
# of the bare `test_y` names after it, as does a named test.
REFERENCE = re.compile(r"`(?P<path>tests/[\w/]+\.py)(?:::(?P<named>test_\w+))?`|`(?P<bare>test_\w+)`")


def named_tests() -> list[tuple[str, str, str]]:
    """(scenario, file, test) for every test the table names."""
    names = []
    for row in (ROOT / "RELIABILITY.md").read_text().splitlines():
        if not row.startswith("| ") or row.startswith("| scenario "):
            continue
        scenario, path = row.split("|")[1].strip(), None
        for reference in REFERENCE.finditer(row):
            path = reference["path"] or path
            if name := reference["named"] or reference["bare"]:
                names.append((scenario, path, name))
    return names


def test_every_test_reliability_names_is_in_the_file_it_names():
    names = named_tests()
    assert len(names) > 100  # the table was read
    defined: dict[str, set[str]] = {}
    missing = []
    for scenario, path, name in names:
        if path not in defined:
            source = ROOT / path if path else None
            text = source.read_text() if source is not None and source.exists() else ""
            defined[path] = set(re.findall(r"^(?:async )?def (test_\w+)", text, re.M))
        if name not in defined[path]:
            missing.append(f"{scenario}: {path}::{name}")
    assert not missing, "RELIABILITY.md names tests that are not where it says:\n" + "\n".join(missing)
