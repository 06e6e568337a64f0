"""System checks for deployment configuration."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Warning, register
from django.db import DatabaseError


@register("paperclip", deploy=True)
def check_deployment(app_configs, **kwargs):
    errors = []
    if settings.PAPERCLIP_DEPLOYMENT_MODE == "authenticated" and settings.DEBUG:
        errors.append(Error("DJANGO_DEBUG must be off in authenticated mode.", id="paperclip.E001"))
    if settings.DATABASE_VENDOR == "sqlite" and settings.REDIS_URL:
        errors.append(
            Warning(
                "REDIS_URL is set with the SQLite database; sessions are local to this machine.",
                id="paperclip.W002",
            )
        )
    if not settings.PAPERCLIP_HTTPS:
        errors.append(
            Warning(
                f"PAPERCLIP_PUBLIC_URL ({settings.PAPERCLIP_PUBLIC_URL}) is not https://: no HTTPS redirect, "
                "cookies are not Secure and no HSTS header is sent.",
                hint="Fine on a private network served over HTTP. When users reach the service over TLS, set "
                "PAPERCLIP_PUBLIC_URL=https://...; behind a proxy that terminates TLS, also "
                "PAPERCLIP_TRUST_X_FORWARDED_PROTO=true.",
                id="paperclip.W003",
            )
        )
    return errors


@register("paperclip")
def check_session_store(app_configs, **kwargs):
    if settings.PAPERCLIP_SESSION_STORE == "file":
        home = settings.PAPERCLIP_HOME
        if not home.exists() or not home.is_dir():
            return [Error(f"PAPERCLIP_HOME {home} is not a directory.", id="paperclip.E002")]
    return []


def agents_that_may_not_run(queryset, problems_of, *, what: str, hint: str, id: str) -> list[Warning]:
    """A warning per live agent of `queryset` whose configuration `problems_of` refuses here
    (saved before the allow-list or the mode changed, or written around validation): its
    runs fail until an operator acts."""
    from sessions_app.models import AgentStatus

    try:
        agents = list(queryset.exclude(status=AgentStatus.DELETED).values_list("id", "name", "adapter_config"))
    except DatabaseError:
        return []  # before migrate, or database down: other checks and commands report that
    warnings = []
    for agent_id, name, config in agents:
        problems = problems_of(config if isinstance(config, dict) else {})
        if problems:
            detail = "; ".join(f"adapter_config.{key}: {message}" for key, message in problems.items())
            warnings.append(Warning(f"Agent {name!r} ({agent_id}) may not {what} here: {detail}", hint=hint, id=id))
    return warnings


@register("paperclip")
def check_process_commands(app_configs, **kwargs):
    """Agents saved before PAPERCLIP_PROCESS_COMMANDS (or the mode) changed: their runs fail."""
    from sessions_app.adapters.process import command_problems
    from sessions_app.models import Agent

    mode, commands = settings.PAPERCLIP_DEPLOYMENT_MODE, settings.PAPERCLIP_PROCESS_COMMANDS
    return agents_that_may_not_run(
        Agent.objects.filter(adapter_type="process"),
        lambda config: command_problems(config, mode=mode, commands=commands),
        what="run its command",
        hint="List the command in PAPERCLIP_PROCESS_COMMANDS, or point the agent at a listed one; "
        "until then its runs fail process_command_not_allowed.",
        id="paperclip.W004",
    )


@register("paperclip")
def check_work_checks(app_configs, **kwargs):
    """Agents whose work check may no longer run here (the allow-list, the listed hosts or
    the mode changed since they were saved): their runs fail work_check_not_allowed."""
    from sessions_app.models import Agent
    from sessions_app.work_checks import check_problems

    def problems_of(config: dict) -> dict:
        check = config.get("work_check")
        return {f"work_check{key}": message for key, message in check_problems(check).items()} if check else {}

    return agents_that_may_not_run(
        Agent.objects.filter(adapter_config__has_key="work_check"),
        problems_of,
        what="run its work check",
        hint="List its command in PAPERCLIP_PROCESS_COMMANDS or its host in PAPERCLIP_WORK_CHECK_HOSTS, "
        "or change the agent's work_check; until then its runs fail work_check_not_allowed.",
        id="paperclip.W005",
    )


@register("paperclip")
def check_cli_tools(app_configs, **kwargs):
    """Claude Code agents whose tools, permission mode or workspace authenticated mode no
    longer allows (PAPERCLIP_CLI_TOOLS or the mode changed): their runs fail cli_not_allowed."""
    from sessions_app.adapters.claude_cli import RUNTIME, authenticated_problems
    from sessions_app.models import Agent

    mode, permitted = settings.PAPERCLIP_DEPLOYMENT_MODE, settings.PAPERCLIP_CLI_TOOLS
    if mode != "authenticated":
        return []
    return agents_that_may_not_run(
        Agent.objects.filter(adapter_type="claude-code", adapter_config__runtime=RUNTIME),
        lambda config: authenticated_problems(config, mode=mode, permitted=permitted),
        what="run Claude Code as configured",
        hint="List its tools in PAPERCLIP_CLI_TOOLS, or narrow the agent's allowed_tools; "
        "until then its runs fail cli_not_allowed.",
        id="paperclip.W006",
    )


@register("paperclip")
def check_cli_sandbox(app_configs, **kwargs):
    """Claude Code agents on a host where their sandbox cannot be made: with `auto` they run
    without it, with `bwrap` not at all (cli_sandbox_unavailable)."""
    from sessions_app.adapters.claude_cli import RUNTIME
    from sessions_app.adapters.cli_sandbox import sandbox_unavailable
    from sessions_app.models import Agent, AgentStatus

    mode = settings.PAPERCLIP_CLI_SANDBOX
    if mode == "off":
        return []
    try:
        agents = Agent.objects.filter(adapter_type="claude-code", adapter_config__runtime=RUNTIME)
        if not agents.exclude(status=AgentStatus.DELETED).exists():
            return []
    except DatabaseError:
        return []  # before migrate, or database down: other checks and commands report that
    if (why := sandbox_unavailable()) is None:
        return []
    outcome = "without their sandbox" if mode == "auto" else "not at all (cli_sandbox_unavailable)"
    return [
        Warning(
            f"Claude Code agents run {outcome} on this host: bubblewrap {why}.",
            hint="Install bubblewrap (apt-get install bubblewrap) and allow unprivileged user namespaces; "
            "PAPERCLIP_CLI_SANDBOX=off runs them unsandboxed without this warning.",
            id="paperclip.W008",
        )
    ]


@register("paperclip")
def check_managed_rules(app_configs, **kwargs):
    """Managed Agents agents whose tools, hosts, package registries or mounted files
    authenticated mode no longer allows (PAPERCLIP_MANAGED_TOOLS, _HOSTS, _FILES or the mode
    changed): their runs fail managed_not_allowed."""
    from sessions_app.adapters.claude_managed_config import problems_here
    from sessions_app.models import Agent

    if settings.PAPERCLIP_DEPLOYMENT_MODE != "authenticated":
        return []
    return agents_that_may_not_run(
        Agent.objects.filter(adapter_type="claude-managed"),
        problems_here,
        what="run on Managed Agents as configured",
        hint="List what it needs in PAPERCLIP_MANAGED_TOOLS, PAPERCLIP_MANAGED_HOSTS or PAPERCLIP_MANAGED_FILES, "
        "or narrow the agent's configuration; until then its runs fail managed_not_allowed.",
        id="paperclip.W007",
    )


@register("paperclip")
def check_agent_models(app_configs, **kwargs):
    """A model the catalogue lists as deprecated, with a retirement date, or retired, with
    the agents on it (as `model` or `summary_model`): act before their runs fail."""
    from sessions_app.model_checks import CHECKED_KEYS, CLAUDE_ADAPTERS, catalogue
    from sessions_app.models import Agent, AgentStatus

    try:
        agents = list(
            Agent.objects.filter(adapter_type__in=CLAUDE_ADAPTERS)
            .exclude(status=AgentStatus.DELETED)
            .order_by("name")
            .values_list("name", "adapter_config")
        )
        models = catalogue()
    except DatabaseError:
        return []  # before migrate, or database down: other checks and commands report that
    named: dict = {}
    for name, config in agents:
        for key in CHECKED_KEYS:
            entry = models.get(config.get(key) or "") if isinstance(config, dict) else None
            if entry is not None and entry.warning:
                named.setdefault(entry, []).append(name)
    return [
        Warning(
            f"{entry.warning} Agents on it: {', '.join(repr(name) for name in dict.fromkeys(names))}.",
            hint="Set their adapter_config.model (or summary_model) to an active model (manage.py prices lists them).",
            id="paperclip.W020",
        )
        for entry, names in sorted(named.items(), key=lambda item: item[0].id)
    ]
