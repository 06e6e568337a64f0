"""`claude-managed` configuration: what `adapter_config` may say (validated on save and
again, for `authenticated` mode, at run time) and the remote agent and environment it
becomes at Anthropic (created on first use, a new agent version when the config changes)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from pathlib import PurePosixPath
from typing import Any

from django.conf import settings

from sessions_app.adapters.base import AdapterRequest, is_int, is_number, validate_model, validate_timeout
from sessions_app.text import holds_control_character

TOOLSET = "agent_toolset_20260401"
# The agent toolset's tools (`BetaManagedAgentsAgentToolConfigParams`).
TOOL_NAMES = ("bash", "edit", "read", "write", "glob", "grep", "web_fetch", "web_search")
DEFAULT_TOOLS = ["bash", "edit", "read", "write", "glob", "grep"]
PERMISSIONS = ("always_allow", "always_ask")
PACKAGE_MANAGERS = ("apt", "cargo", "gem", "go", "npm", "pip")
DEFAULT_TIMEOUT_SECONDS = 600
MAX_BUDGET_USD = 1000
CONFIG_KEYS = {
    "model",
    "tools",
    "environment",
    "resources",
    "max_budget_usd",
    "timeout_seconds",
    "approval_timeout_minutes",
}
# A Files API id, as the API spells them.
FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_RESOURCES = 100
MAX_APPROVAL_TIMEOUT_MINUTES = 7 * 24 * 60

# --- configuration ------------------------------------------------------------------------


def _tools(config: dict, errors: dict[str, str]) -> list[dict]:
    """`tools`: names of the agent toolset's tools, or `{"name": ..., "permission":
    "always_allow" | "always_ask"}`; a name alone is always allowed."""
    raw = config.get("tools", DEFAULT_TOOLS)
    tools: list[dict] = []
    if isinstance(raw, list):
        for entry in raw:
            tool = {"name": entry, "permission": "always_allow"} if isinstance(entry, str) else entry
            if (
                not isinstance(tool, dict)
                or set(tool) - {"name", "permission"}
                or tool.get("name") not in TOOL_NAMES
                or tool.get("permission", "always_allow") not in PERMISSIONS
            ):
                tools = []
                break
            tools.append({"name": tool["name"], "permission": tool.get("permission", "always_allow")})
        else:
            if len({tool["name"] for tool in tools}) == len(tools):
                return tools
    errors["tools"] = (
        f"must be a list of tool names ({', '.join(TOOL_NAMES)}), each once, or objects "
        f"{{'name': ..., 'permission': 'always_allow' | 'always_ask'}}; got {raw!r}"
    )
    return tools


def _environment(config: dict, errors: dict[str, str]) -> dict:
    """`environment`: `networking` ("unrestricted", or `{"allowed_hosts": [...],
    "allow_package_managers": bool}` for limited) and `packages` by manager."""
    raw = config.get("environment", {})
    problem = None
    if not isinstance(raw, dict) or set(raw) - {"networking", "packages"}:
        problem = "must be an object with 'networking' and 'packages'"
    else:
        networking = raw.get("networking", {"allowed_hosts": []})
        packages = raw.get("packages", {})
        if networking != "unrestricted" and not (
            isinstance(networking, dict)
            and not set(networking) - {"allowed_hosts", "allow_package_managers"}
            and _strings(networking.get("allowed_hosts", []), longest=253)
            and isinstance(networking.get("allow_package_managers", False), bool)
        ):
            problem = (
                "networking must be 'unrestricted' or {'allowed_hosts': [host, ...], 'allow_package_managers': bool}"
            )
        elif not (isinstance(packages, dict) and set(packages) <= set(PACKAGE_MANAGERS)) or not all(
            _strings(names, longest=200) for names in packages.values()
        ):
            problem = f"packages must map {', '.join(PACKAGE_MANAGERS)} to lists of package names"
        elif packages and isinstance(networking, dict) and not networking.get("allow_package_managers"):
            problem = "packages need networking 'unrestricted' or allow_package_managers: true"
        else:
            return {"networking": networking, "packages": packages}
    errors["environment"] = f"{problem}; got {raw!r}"
    return {}  # nothing of a refused environment is read further (the authenticated check)


def _resources(config: dict, errors: dict[str, str]) -> list[dict]:
    """`resources`: the files (uploaded through the Files API) mounted into each new remote
    session's container: `{"file_id": ..., "mount_path": "/absolute/path"}`, the path
    optional (the service's default is /mnt/session/uploads/<file_id>)."""
    raw = config.get("resources", [])
    problem = ""
    if not isinstance(raw, list) or len(raw) > MAX_RESOURCES:
        problem = f"must be a list of at most {MAX_RESOURCES} files"
    else:
        for entry in raw:
            if problem := _resource_problem(entry):
                break
        else:
            ids = [entry["file_id"] for entry in raw]
            paths = [entry["mount_path"] for entry in raw if entry.get("mount_path")]
            if len(set(ids)) < len(ids) or len(set(paths)) < len(paths):
                problem = "names a file or a mount path twice"
    if problem:
        errors["resources"] = (
            f"{problem}; each entry is {{'file_id': 'file_...', 'mount_path': '/absolute/path'}}; got {raw!r}"
        )
        return []
    return [{key: entry[key] for key in ("file_id", "mount_path") if entry.get(key)} for entry in raw]


def _resource_problem(entry: Any) -> str:
    if not isinstance(entry, dict) or set(entry) - {"file_id", "mount_path"}:
        return "each entry must be an object with 'file_id' and an optional 'mount_path'"
    if not isinstance(entry.get("file_id"), str) or not FILE_ID.fullmatch(entry["file_id"]):
        return f"{entry.get('file_id')!r} is not a file id"
    path = entry.get("mount_path")
    if path is None:
        return ""
    if (
        not isinstance(path, str)
        or len(path) > 1024
        or not path.startswith("/")
        or holds_control_character(path)
        or ".." in PurePosixPath(path).parts
    ):
        return f"mount_path {path!r} must be an absolute path without '..' or control characters"
    return ""


def _strings(value: Any, *, longest: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, str) and item.strip() and len(item) <= longest for item in value
    )


def validate_managed_config(config: dict, errors: dict[str, str]) -> dict:
    clean: dict[str, Any] = {}
    validate_model(config, errors, clean)
    clean["tools"] = _tools(config, errors)
    clean["environment"] = _environment(config, errors)
    if "resources" in config:
        clean["resources"] = _resources(config, errors)
    if "max_budget_usd" in config:
        cap = config["max_budget_usd"]
        if cap is not None and (not is_number(cap) or not Decimal("0.01") <= Decimal(str(cap)) <= MAX_BUDGET_USD):
            errors["max_budget_usd"] = f"must be a number of dollars in [0.01, {MAX_BUDGET_USD}] or null, got {cap!r}"
        clean["max_budget_usd"] = cap
    validate_timeout(config, errors, clean, default=DEFAULT_TIMEOUT_SECONDS)
    if "approval_timeout_minutes" in config:
        minutes = config["approval_timeout_minutes"]
        if not is_int(minutes) or not 1 <= minutes <= MAX_APPROVAL_TIMEOUT_MINUTES:
            errors["approval_timeout_minutes"] = (
                f"must be a whole number of minutes in 1..{MAX_APPROVAL_TIMEOUT_MINUTES}, got {minutes!r}"
            )
        clean["approval_timeout_minutes"] = minutes
    if config.get("context_strategy") not in (None, "none"):
        errors["context_strategy"] = "a Managed Agents session manages its own context: leave it unset or 'none'"
    for field, problem in problems_here(clean).items():
        errors.setdefault(field, problem)  # a setting's own shape is said first
    return clean


def problems_here(config: dict) -> dict[str, str]:
    """`authenticated_problems` with this process's mode and the operator's lists: on save,
    when a run starts, and in `manage.py check`."""
    return authenticated_problems(
        config,
        mode=settings.PAPERCLIP_DEPLOYMENT_MODE,
        tools=settings.PAPERCLIP_MANAGED_TOOLS,
        hosts=settings.PAPERCLIP_MANAGED_HOSTS,
        files=settings.PAPERCLIP_MANAGED_FILES,
    )


def authenticated_problems(config: dict, *, mode: str, tools: tuple, hosts: tuple, files: tuple) -> dict[str, str]:
    """What an API key may not give a Managed Agents agent in `authenticated` mode: the
    tools, the hosts its container reaches and the files mounted in it are the operator's
    to grant (PAPERCLIP_MANAGED_TOOLS, PAPERCLIP_MANAGED_HOSTS, PAPERCLIP_MANAGED_FILES;
    `*` among the hosts permits unrestricted networking, among the files any file)."""
    if mode != "authenticated":
        return {}
    problems = {}
    mounted = [resource["file_id"] for resource in config.get("resources") or []]
    if "*" not in files and (refused := [file_id for file_id in mounted if file_id not in files]):
        listed = ", ".join(files) if files else "none: the operator lists them"
        problems["resources"] = (
            f"files {', '.join(map(repr, refused))} may not be mounted in authenticated mode; "
            f"PAPERCLIP_MANAGED_FILES permits {listed}"
        )
    names = [tool["name"] for tool in config.get("tools") or []]
    if refused := [name for name in names if name not in tools]:
        listed = ", ".join(tools) if tools else "none: the operator lists them"
        problems["tools"] = (
            f"{', '.join(map(repr, refused))} may not be used in authenticated mode; "
            f"PAPERCLIP_MANAGED_TOOLS permits {listed}"
        )
    environment = config.get("environment") or {}
    networking = environment.get("networking")
    if networking == "unrestricted" and "*" not in hosts:
        problems["environment"] = "unrestricted networking needs '*' in PAPERCLIP_MANAGED_HOSTS in authenticated mode"
    elif isinstance(networking, dict) and (
        refused := [host for host in networking.get("allowed_hosts") or [] if host not in hosts and "*" not in hosts]
    ):
        listed = ", ".join(hosts) if hosts else "none: the operator lists them"
        problems["environment"] = (
            f"hosts {', '.join(map(repr, refused))} may not be reached in authenticated mode; "
            f"PAPERCLIP_MANAGED_HOSTS permits {listed}"
        )
    elif "*" not in hosts and (
        (isinstance(networking, dict) and networking.get("allow_package_managers")) or environment.get("packages")
    ):
        # The registries (PyPI, npm, ...) are hosts the operator did not list, and the
        # packages installed from them run in the container. `packages` is looked at on its
        # own: a row written around validation may name some without allow_package_managers,
        # and they are sent to the provider to install all the same.
        problems["environment"] = (
            "allow_package_managers (and packages) reach the package registries: in authenticated mode "
            "only with '*' in PAPERCLIP_MANAGED_HOSTS"
        )
    return problems


def session_resources(config: dict) -> list[dict]:
    """The `resources` a new remote session is created with."""
    return [{"type": "file", **resource} for resource in config.get("resources") or []]


def budget_cents(config: dict) -> int | None:
    """The session's enforced budget in cents, never above what the agent allows."""
    cap = config.get("max_budget_usd")
    if cap is None:
        return None
    return int((Decimal(str(cap)) * 100).to_integral_value(rounding=ROUND_DOWN))


# --- the remote agent and environment ------------------------------------------------------


@dataclass(frozen=True)
class RemoteAgent:
    """The agent and environment at Anthropic that an agent runs as, and the digests of
    the configuration each was last made from."""

    agent_id: str
    version: int
    environment_id: str
    agent_digest: str
    environment_digest: str

    def as_json(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def of(cls, stored: dict | None) -> RemoteAgent | None:
        try:
            return cls(**stored) if stored else None
        except TypeError:
            return None  # stored by another version of this module: made again


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


def agent_params(request: AdapterRequest) -> dict:
    tools = request.config.get("tools", [])
    return {
        "model": request.model,
        "system": request.system or None,
        "tools": [
            {
                "type": TOOLSET,
                "default_config": {"enabled": False},
                "configs": [
                    {"name": tool["name"], "enabled": True, "permission_policy": {"type": tool["permission"]}}
                    for tool in tools
                ],
            }
        ],
    }


def environment_config(config: dict) -> dict:
    environment = config.get("environment") or {}
    networking = environment.get("networking", {"allowed_hosts": []})
    cloud: dict[str, Any] = {"type": "cloud"}
    if networking == "unrestricted":
        cloud["networking"] = {"type": "unrestricted"}
    else:
        cloud["networking"] = {
            "type": "limited",
            "allowed_hosts": list(networking.get("allowed_hosts", [])),
            "allow_package_managers": bool(networking.get("allow_package_managers", False)),
        }
    if environment.get("packages"):
        cloud["packages"] = {"type": "packages", **environment["packages"]}
    return cloud


def remote_sync(client, request: AdapterRequest, stored: RemoteAgent | None, *, name: str) -> RemoteAgent:
    """The remote agent and environment for this request's configuration: made on first use,
    updated when the configuration changed (a changed agent is a new version)."""
    params = agent_params(request)
    environment = environment_config(request.config)
    agent_digest, environment_digest = digest(params), digest(environment)
    metadata = {"paperclip_agent": request.metadata.get("agent_id", "")}
    beta = client.beta
    if stored is None:
        created = beta.agents.create(name=name, metadata=metadata, **params)
        env = beta.environments.create(name=name, config=environment, metadata=metadata)
        return RemoteAgent(created.id, created.version, env.id, agent_digest, environment_digest)
    version = stored.version
    if stored.agent_digest != agent_digest:
        version = beta.agents.update(stored.agent_id, version=stored.version, **params).version
    if stored.environment_digest != environment_digest:
        beta.environments.update(stored.environment_id, config=environment)
    return RemoteAgent(stored.agent_id, version, stored.environment_id, agent_digest, environment_digest)
