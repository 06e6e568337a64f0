"""The reference pages users deploy from agree with the code: the error codes and their
statuses (docs/api.md, docs/operations.md), the settings' defaults (docs/configuration.md),
the API's routes and methods (docs/api.md) and the management commands' options
(docs/operations.md). Each test reads the page and compares it with what the code declares,
both ways: nothing the code does is left out, nothing the page offers is missing."""

from __future__ import annotations

import ast
import re

from django.core.management import BaseCommand, get_commands, load_command_class
from django.urls import URLResolver, get_resolver
from rest_framework.exceptions import APIException

from memory_app import views as memory_views
from memory_app.stores import MemoryFault
from paperclip.errors import RunFailure
from sessions_app import views as session_views
from sessions_app.api import exceptions as api_exceptions
from tests.conftest import ROOT

APP_SOURCES = [
    path
    for package in ("paperclip", "sessions_app", "costs_app", "memory_app")
    for path in sorted((ROOT / package).rglob("*.py"))
    if "migrations" not in path.parts
]


def app_source() -> str:
    return "\n".join(path.read_text() for path in APP_SOURCES)


def section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    assert heading in text, f"docs/{page} has no {heading!r} section"
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the one table in `text`, as cells."""
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and its rule


# --- error codes ------------------------------------------------------------------------

# What is in parentheses explains a code (`fields`, a setting, an example): not a code.
ASIDE = re.compile(r"\([^()]*\)")


def without_asides(text: str) -> str:
    while ASIDE.search(text):  # inner parentheses first, such as a link's target
        text = ASIDE.sub("", text)
    return text


CODE = re.compile(r"`([a-z][a-z0-9_]*(?:<[a-z ]+>)?)`")


def api_error_table() -> dict[str, set[int]]:
    """code -> the statuses the Errors table of docs/api.md lists it under."""
    statuses: dict[str, set[int]] = {}
    for status_cell, codes_cell in table_rows(section("api.md", "## Errors")):
        row_statuses = {int(number) for number in re.findall(r"\d{3}", status_cell)}
        for code in CODE.findall(without_asides(codes_cell)):
            statuses.setdefault(code, set()).update(row_statuses)
    return statuses


def run_error_table() -> set[str]:
    """The codes the error-code table of docs/operations.md explains."""
    rows = table_rows(section("operations.md", "## Run statuses and error codes"))
    return {code for cells in rows for code in CODE.findall(cells[0])}


def failure_classes() -> set[str]:
    """Every class whose first argument is an error code: the run's failures, the memory
    store's faults, and the API's exceptions."""
    roots = [RunFailure, APIException, MemoryFault]
    found, pending = set(), list(roots)
    while pending:
        cls = pending.pop()
        if cls.__module__.split(".")[0] in ("paperclip", "sessions_app", "costs_app", "memory_app"):
            found.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return found


def raised_codes() -> set[str]:
    """The codes the sources give an error: `SomeFailure("code", ...)`, `code="code"`,
    `error_body("code", ...)`, a class's `code = "..."`, an HTTP status's code in the
    Messages API's table and a `("code", "Message.")` pair of a stop reason's table."""
    names = "|".join(sorted(failure_classes() | {"error_body"}))
    patterns = [
        rf'\b(?:{names})\(\s*"([a-z][a-z0-9_]+)"',
        r'\b(?:default_)?code\s*=\s*"([a-z][a-z0-9_]+)"',
        r'^\s+\d{3}: "([a-z][a-z0-9_]+)",$',
        r'\(\s*"([a-z]+_[a-z0-9_]+)",\s*f?"[A-Z]',
    ]
    source = app_source()
    return {code for pattern in patterns for code in re.findall(pattern, source, re.M)}


# Codes the sources name that neither the API nor a run ever ends with.
NEVER_ANSWERED = {
    # Each answers 400 `invalid` naming its field (`FIELD_REFUSALS`, the pin serializer).
    *session_views.FIELD_REFUSALS,
    "invalid_pin",
    # The serializer and the JSON parser refuse such a key first (400 `invalid`).
    "invalid_idempotency_key",
    # An operator's view of memory always has the default store; only a run's tool meets it.
    "memory_not_configured",
    # Fallbacks of classes every raise gives a code of its own.
    "conflict",
    "too_many_requests",
    "service_unavailable",
    # Not failures: the run waits (for a batch, an approval, a summary) or ends skipped.
    "batch_parked",
    "approval_needed",
    "summary_awaited",
    "session_changed",
    # A 429 is a quota refusal (the credential is held, the run waits), never this failure.
    "model_rate_limited",
}


def test_every_error_code_the_code_gives_is_documented():
    documented = set(api_error_table()) | run_error_table()
    raised = raised_codes()
    assert len(raised) > 80, "the scan found few codes: are errors still raised as it expects?"
    undocumented = raised - documented - NEVER_ANSWERED
    assert not undocumented, f"codes in neither docs/api.md's Errors nor docs/operations.md: {sorted(undocumented)}"


def test_every_documented_error_code_is_in_the_code():
    source = app_source()

    def exists(code: str) -> bool:
        if "<" in code:  # `compaction_<model code>`: the prefix, in an f-string
            return f'f"{code.split("_", 1)[0]}_{{' in source
        return f'"{code}"' in source

    documented = set(api_error_table()) | run_error_table()
    never_given = sorted(code for code in documented if not exists(code))
    assert not never_given, f"documented codes the code never gives: {never_given}"


API_ERRORS = (
    api_exceptions.BadRequest,
    api_exceptions.NotFound,
    api_exceptions.Conflict,
    api_exceptions.PayloadTooLarge,
    api_exceptions.TooManyRequests,
    api_exceptions.ServiceUnavailable,
)


def declared_statuses() -> dict[str, int]:
    """code -> status, as the API's raises, the views' tables and DRF_CODES declare it."""
    status_of = {cls.__name__: cls.status_code for cls in API_ERRORS}
    # `Conflict("...", code="no_budget")`, its message holding at most one level of parentheses.
    raise_with_code = rf'\b({"|".join(status_of)})\((?:[^()]|\([^()]*\))*?\bcode="(\w+)"'
    statuses = {code: status_of[name] for name, code in re.findall(raise_with_code, app_source())}
    statuses.update({cls.default_code: cls.status_code for cls in API_ERRORS})
    by_class = {
        **session_views.REFUSALS,
        **session_views.COMPACT_STATUSES,
        **memory_views.FAULT_ERRORS,
        **dict.fromkeys(memory_views.FAULT_FIELDS, api_exceptions.BadRequest),
    }
    statuses.update({code: cls.status_code for code, cls in by_class.items()})
    statuses.update(session_views.HISTORY_STATUSES)
    statuses.update({code: cls.status_code for cls, code in api_exceptions.DRF_CODES.items()})
    return {code: status for code, status in statuses.items() if code not in NEVER_ANSWERED}


def test_each_api_error_code_is_documented_under_the_status_it_answers():
    documented = api_error_table()
    wrong = {
        code: f"answers {status}, documented {sorted(documented.get(code, ()))}"
        for code, status in declared_statuses().items()
        if status not in documented.get(code, ())
    }
    assert not wrong, f"docs/api.md, Errors: {wrong}"


# --- settings -----------------------------------------------------------------------------

# A row of docs/configuration.md: the variables in its first cell, their defaults in its second.
CONFIGURATION_ROW = re.compile(r"^\| ((?:`[A-Z][A-Z0-9_]+`(?:, )?)+) \| ([^|]+) \|", re.M)


def constant(node: ast.expr) -> object:
    """A literal, or a product of literals (`16 * 1024`); ValueError for anything computed."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return constant(node.left) * constant(node.right)
    return ast.literal_eval(node)


def code_defaults() -> dict[str, object]:
    """NAME -> the default of each `env_*("NAME", default, ...)` in paperclip/settings.py whose
    default is a constant (one computed from other settings, as DATABASE_URL's, is left out)."""
    defaults = {}
    for call in ast.walk(ast.parse((ROOT / "paperclip" / "settings.py").read_text())):
        if isinstance(call, ast.Call) and getattr(call.func, "id", "").startswith("env_") and len(call.args) > 1:
            try:
                defaults[call.args[0].value] = constant(call.args[1])
            except ValueError:
                continue
    return defaults


def documented_defaults() -> dict[str, str]:
    """NAME -> its default cell; a row of several variables lists one backticked default each."""
    defaults = {}
    for names_cell, default_cell in CONFIGURATION_ROW.findall((ROOT / "docs" / "configuration.md").read_text()):
        names = re.findall(r"`([A-Z0-9_]+)`", names_cell)
        values = re.findall(r"`([^`]*)`", default_cell)
        if len(values) != len(names):
            values = [default_cell.strip()] * len(names)
        defaults.update(zip(names, values, strict=True))
    return defaults


def as_documented(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_each_setting_has_the_default_the_code_uses():
    documented = documented_defaults()
    read = code_defaults()
    assert len(read) > 50, "few defaults found: do settings still read env_*(NAME, default)?"
    wrong = {}
    for name, value in read.items():
        cell = documented.get(name, "not documented")
        # An empty default is said in words ("empty", "empty: the SDK's bundled CLI", "unset").
        matches = cell.startswith(("empty", "unset")) if value == "" else cell == as_documented(value)
        if not matches:
            wrong[name] = f"code {value!r}, docs/configuration.md {cell!r}"
    assert not wrong, wrong


# --- endpoints ----------------------------------------------------------------------------

# The page's shorthands for the paths it repeats (`{agent}` first: it is written with
# `{company}`), and its name for a path parameter.
PATH_SHORTHANDS = {"{agent}": "{company}/agents/{agent_id}", "{company}": "/api/companies/{company_id}"}
PARAMETER_NAMES = {"memory_path": "path"}
ROUTE_PARAMETER = re.compile(r"<(?:\w+:)?(\w+)>")
# A view that is a function (the health probe) answers GET only: anything else is a 405.
FUNCTION_VIEW_METHODS = {"GET"}


def routes(patterns, prefix: str = ""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from routes(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern.callback


def view_methods(callback) -> set[str]:
    view = getattr(callback, "view_class", None)
    if view is None:
        return FUNCTION_VIEW_METHODS
    return {name.upper() for name in view.http_method_names if hasattr(view, name)} - {"HEAD", "OPTIONS"}


def api_endpoints() -> set[tuple[str, str]]:
    """(method, path) for every route under /api/, its parameters written `{name}`."""
    endpoints = set()
    for route, callback in routes(get_resolver().url_patterns):
        if route.startswith("api"):
            path = "/" + ROUTE_PARAMETER.sub(lambda match: "{" + PARAMETER_NAMES.get(match[1], match[1]) + "}", route)
            endpoints.update((method, path) for method in view_methods(callback))
    return endpoints


def expanded(path: str) -> str:
    for shorthand, meaning in PATH_SHORTHANDS.items():
        path = path.replace(shorthand, meaning)
    return path


def documented_endpoints() -> set[tuple[str, str]]:
    """(method, path) for each row of the Endpoints table: `GET, PUT {company}/budget`,
    then paths sharing its methods (`{agent}/budget`) or a sibling of the last (`.../deny`)."""
    endpoints = set()
    for cells in table_rows(section("api.md", "## Endpoints")):
        first, *others = re.findall(r"`([^`]+)`", cells[0])
        methods, path = re.fullmatch(r"([A-Z, ]+) (\S+)", first).groups()
        paths = [path]
        for other in others:
            paths.append(paths[-1].rsplit("/", 1)[0] + other[3:] if other.startswith(".../") else other)
        endpoints.update((method, expanded(path)) for method in methods.split(", ") for path in paths)
    return endpoints


def test_every_route_and_method_is_in_the_endpoints_table():
    code, documented = api_endpoints(), documented_endpoints()
    assert len(code) > 40, "few routes found under /api/: is the resolver walked as the URLconf nests them?"
    assert sorted(code - documented) == [], "answered but not in docs/api.md, Endpoints"
    assert sorted(documented - code) == [], "documented in docs/api.md, Endpoints, but not answered"


# --- management commands --------------------------------------------------------------------

PROJECT_APPS = ("sessions_app", "costs_app", "memory_app")


def long_options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


def command_options() -> dict[str, set[str]]:
    """command -> its own options, as `manage.py <command> --help` lists them (Django's
    options common to every command left out)."""
    common = long_options(BaseCommand().create_parser("manage.py", "any"))
    return {
        name: long_options(load_command_class(app, name).create_parser("manage.py", name)) - common
        for name, app in get_commands().items()
        if app in PROJECT_APPS
    }


def documented_command_options() -> dict[str, set[str]]:
    """command -> the options its line in the Management commands block shows."""
    block = section("operations.md", "## Management commands").split("```sh\n", 1)[1].split("```", 1)[0]
    documented = {}
    for line in block.splitlines():
        usage = line.split("#", 1)[0]
        name = re.search(r"manage\.py (\w+)", usage)[1]
        documented[name] = set(re.findall(r"--[a-z][a-z-]*", usage))
    return documented


def test_every_command_and_option_is_in_the_commands_block():
    assert command_options() == documented_command_options(), (
        "docs/operations.md, Management commands, and --help differ"
    )
