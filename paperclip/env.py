"""Strict readers for configuration from the environment.

Each reader raises ImproperlyConfigured naming the variable, so a typo in a deployment
stops start-up with one clear line instead of running with a silently wrong value.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum}, got {value}")
    return value


def env_decimal(name: str, default: str):
    from decimal import Decimal, InvalidOperation

    raw = env_str(name, default)
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ImproperlyConfigured(f"{name} must be a decimal number, got {raw!r}") from None
    if not value.is_finite() or value < 0:
        raise ImproperlyConfigured(f"{name} must be zero or a positive number, got {raw!r}")
    return value


def env_list(name: str, default: str) -> tuple[str, ...]:
    """A comma-separated list; blanks around items are dropped, an empty item is an error."""
    raw = env_str(name, default)
    if not raw.strip():
        return ()
    items = tuple(item.strip() for item in raw.split(","))
    if not all(items):
        raise ImproperlyConfigured(f"{name} must be a comma-separated list without empty items, got {raw!r}")
    return items


def env_multipliers(name: str, default: str) -> dict:
    """A JSON object of names to positive decimal factors, such as {"us": "1.1"}."""
    from decimal import Decimal, InvalidOperation

    raw = env_str(name, default)
    try:
        parsed = json.loads(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a JSON object such as {default}, got {raw!r}") from None
    if not isinstance(parsed, dict):
        raise ImproperlyConfigured(f"{name} must be a JSON object such as {default}, got {raw!r}")
    factors = {}
    for key, value in parsed.items():
        try:
            factor = (
                Decimal(str(value)) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
            )
        except InvalidOperation:
            factor = None
        if factor is None or not factor.is_finite() or factor <= 0:
            raise ImproperlyConfigured(f"{name}: the factor of {key!r} must be a positive number, got {value!r}")
        factors[key] = factor
    return factors


def env_hosts(name: str) -> frozenset[str]:
    """A comma-separated list of `host` or `host:port` entries, compared as lower case (as
    URLs' hosts are)."""
    from paperclip.hosts import host_entry

    entries = frozenset(host.strip().lower() for host in env_str(name, "").split(",") if host.strip())
    for entry in entries:
        try:
            host_entry(entry)
        except ValueError:
            raise ImproperlyConfigured(
                f"{name} must list hosts or host:port entries (port 1..65535), comma-separated; got {entry!r}"
            ) from None
    return entries


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {raw!r}")


def env_database(name: str, default: str, *, base_dir: Path) -> dict:
    import dj_database_url

    url = env_str(name, default)
    try:
        config = dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except (ValueError, KeyError) as exc:
        raise ImproperlyConfigured(f"{name} is not a usable database URL ({exc})") from None
    engine = config.get("ENGINE", "")
    if not engine or not config.get("NAME"):
        raise ImproperlyConfigured(f"{name} is not a usable database URL: {without_password(url)!r}")
    if engine.endswith("sqlite3"):
        path = Path(config["NAME"])
        if str(path) != ":memory:" and not path.is_absolute():
            path = base_dir / path
        config["NAME"] = str(path)
        # Several processes (gunicorn workers, qcluster workers) share one SQLite file:
        # WAL lets readers run beside the writer, the busy timeout waits for the lock
        # instead of failing, and IMMEDIATE takes the write lock at BEGIN so two
        # transactions never deadlock upgrading a read lock.
        config["CONN_MAX_AGE"] = 0
        config["CONN_HEALTH_CHECKS"] = False
        config["OPTIONS"] = {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
        }
    elif "postgresql" in engine:
        config["ENGINE"] = "django.db.backends.postgresql"
    return config


def without_password(url: str) -> str:
    """`url` as it may be printed: the message reaches the console, and so the logs."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "(unparsable URL)"
    if password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{password}@", ":***@", 1)).geturl()


def secret_key(*, deployment_mode: str, home: Path) -> str:
    """The secret key: from DJANGO_SECRET_KEY, or generated once into PAPERCLIP_HOME.

    Only local_trusted mode may generate one; an authenticated deployment must say which
    key it uses, so that several web processes on several hosts sign with the same key.
    """
    configured = os.environ.get("DJANGO_SECRET_KEY", "").strip()
    if configured:
        return configured
    if deployment_mode == "authenticated":
        raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set when PAPERCLIP_DEPLOYMENT_MODE=authenticated")
    key_file = home / "secret_key"
    try:
        return key_file.read_text().strip()
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # O_EXCL: when two processes start at once, one writes and the other reads its key.
    try:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return key_file.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


PROCESS_COMMAND_KEYS = ("argv", "allowed_args", "allowed_arg_patterns", "env", "cwd")
PROCESS_COMMAND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_process_commands(raw: str, *, name: str = "PAPERCLIP_PROCESS_COMMANDS") -> dict[str, dict]:
    """The commands `process` agents may run: a JSON object mapping a name to its entry.

    An entry is its argv (a list) or an object with `argv` and optionally `allowed_args`
    (literal arguments an agent may add), `allowed_arg_patterns` (regular expressions an
    added argument may match in full), `env` (variables passed from this environment) and
    `cwd` (an absolute directory). Returned with every key filled in.
    """
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise ImproperlyConfigured(f'{name} must be a JSON object like {{"my-agent": ["/opt/agent/run"]}}')
    commands = {}
    for command, entry in value.items():
        if not PROCESS_COMMAND_NAME.fullmatch(command):
            raise ImproperlyConfigured(f"{name}: {command!r} is not a usable name (letters, digits, '.', '_', '-')")
        commands[command] = _process_command(entry, where=f"{name}[{command!r}]")
    return commands


def _process_command(entry: object, *, where: str) -> dict:
    if isinstance(entry, list):
        entry = {"argv": entry}
    if not isinstance(entry, dict):
        raise ImproperlyConfigured(f"{where} must be an argv list or an object with an `argv` list")
    if unknown := sorted(set(entry) - set(PROCESS_COMMAND_KEYS)):
        raise ImproperlyConfigured(f"{where} has unknown keys {unknown}; expected {', '.join(PROCESS_COMMAND_KEYS)}")
    argv = _strings(entry.get("argv"), where=f"{where}.argv")
    if not argv or not all(argv):
        raise ImproperlyConfigured(f"{where}.argv must be a non-empty list of non-empty strings")
    patterns = _strings(entry.get("allowed_arg_patterns", []), where=f"{where}.allowed_arg_patterns")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ImproperlyConfigured(
                f"{where}.allowed_arg_patterns: {pattern!r} is not a regular expression ({exc})"
            ) from None
    env = _strings(entry.get("env", []), where=f"{where}.env")
    if bad := [variable for variable in env if not ENV_NAME.fullmatch(variable)]:
        raise ImproperlyConfigured(f"{where}.env: {bad[0]!r} is not an environment variable name")
    cwd = entry.get("cwd")
    if cwd is not None and not (isinstance(cwd, str) and "\x00" not in cwd and Path(cwd).is_absolute()):
        raise ImproperlyConfigured(f"{where}.cwd must be an absolute directory path, got {cwd!r}")
    return {
        "argv": argv,
        "allowed_args": _strings(entry.get("allowed_args", []), where=f"{where}.allowed_args"),
        "allowed_arg_patterns": patterns,
        "env": env,
        "cwd": cwd,
    }


def _strings(value: object, *, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and "\x00" not in item for item in value):
        raise ImproperlyConfigured(f"{where} must be a list of strings")
    return value


def env_url(name: str, default: str) -> str:
    """An absolute http:// or https:// URL with a host (and no trailing slash)."""
    from urllib.parse import urlsplit

    value = env_str(name, default).rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImproperlyConfigured(f"{name} must be an http:// or https:// URL with a host name, got {value!r}")
    return value
