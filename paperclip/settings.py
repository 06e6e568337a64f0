"""Settings for Paperclip Sessions, read from the environment (see README, Configuration)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from paperclip.env import (
    env_bool,
    env_choice,
    env_database,
    env_decimal,
    env_hosts,
    env_int,
    env_list,
    env_multipliers,
    env_str,
    env_url,
    parse_process_commands,
    secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent

PAPERCLIP_HOME = Path(env_str("PAPERCLIP_HOME", ".paperclip"))
if not PAPERCLIP_HOME.is_absolute():
    PAPERCLIP_HOME = BASE_DIR / PAPERCLIP_HOME
PAPERCLIP_HOME.mkdir(parents=True, exist_ok=True)

PAPERCLIP_PORT = env_int("PAPERCLIP_PORT", 3100, minimum=1, maximum=65535)
PAPERCLIP_HOST = env_str("PAPERCLIP_HOST", "127.0.0.1")
# `manage.py serve` (scripts/run): gunicorn's worker processes and threads per worker.
PAPERCLIP_WEB_WORKERS = env_int("PAPERCLIP_WEB_WORKERS", 2, minimum=1, maximum=256)
PAPERCLIP_WEB_THREADS = env_int("PAPERCLIP_WEB_THREADS", 8, minimum=1, maximum=1024)
PAPERCLIP_DEPLOYMENT_MODE = env_choice("PAPERCLIP_DEPLOYMENT_MODE", "local_trusted", ("local_trusted", "authenticated"))

DATABASES = {
    "default": env_database("DATABASE_URL", f"sqlite:///{PAPERCLIP_HOME / 'paperclip.sqlite3'}", base_dir=BASE_DIR)
}
DATABASE_VENDOR = "sqlite" if DATABASES["default"]["ENGINE"].endswith("sqlite3") else "postgresql"
if DATABASE_VENDOR == "sqlite":
    DATABASES["default"]["TEST"] = {"NAME": str(PAPERCLIP_HOME / "test.sqlite3")}
# Off by default, as in Django: a connection pooler in transaction mode older than PgBouncer
# 1.21 (or without its max_prepared_statements) cannot carry prepared statements. On a direct
# connection they take about 2 ms off each heartbeat (bench/RESULTS.md).
if env_bool("PAPERCLIP_PG_PREPARED_STATEMENTS", False) and DATABASE_VENDOR == "postgresql":
    DATABASES["default"].setdefault("OPTIONS", {}).update({"server_side_binding": True, "prepare_threshold": 5})

PAPERCLIP_SESSION_STORE = env_choice(
    "PAPERCLIP_SESSION_STORE", "file" if DATABASE_VENDOR == "sqlite" else "database", ("file", "database")
)
# Sessions whose history each process keeps between heartbeats (`sessions_app.history_cache`).
PAPERCLIP_HISTORY_CACHE_SESSIONS = env_int("PAPERCLIP_HISTORY_CACHE_SESSIONS", 16, minimum=0, maximum=10_000)
PAPERCLIP_RETENTION_DAYS = env_int("PAPERCLIP_RETENTION_DAYS", 30, minimum=1)
PAPERCLIP_RUN_TIMEOUT_SECONDS = env_int("PAPERCLIP_RUN_TIMEOUT_SECONDS", 600, minimum=1)
PAPERCLIP_MAX_TASK_CHARS = env_int("PAPERCLIP_MAX_TASK_CHARS", 100_000, minimum=1)
PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES = env_int("PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES", 16 * 1024 * 1024, minimum=1024)
# The only commands `process` agents may run in authenticated mode (README, "process agents").
PAPERCLIP_PROCESS_COMMANDS = parse_process_commands(env_str("PAPERCLIP_PROCESS_COMMANDS", ""))
PAPERCLIP_SESSION_HOUR_USD = env_decimal("PAPERCLIP_SESSION_HOUR_USD", "0.08")
# Prices (costs_app.pricing): the factor each `inference_geo` multiplies a call's price by
# (Anthropic's pricing: US-only inference bills 1.1x every rate, models from Opus 4.6 on).
PAPERCLIP_INFERENCE_GEO_MULTIPLIERS = env_multipliers("PAPERCLIP_INFERENCE_GEO_MULTIPLIERS", '{"us": "1.1"}')
# The model catalogue (costs_app.catalogue): how often the maintenance pass asks the Models
# API for it (0: never; `manage.py prices --refresh` asks now), and the model of an agent
# configured without one (empty: the newest active Sonnet-line model of the catalogue).
PAPERCLIP_MODELS_REFRESH_MINUTES = env_int("PAPERCLIP_MODELS_REFRESH_MINUTES", 360, minimum=0)
PAPERCLIP_DEFAULT_MODEL = env_str("PAPERCLIP_DEFAULT_MODEL", "")
# Claude Code (`runtime: "cli"`): the cap on one heartbeat's spend when the agent sets no
# max_budget_usd and no budget applies, and the CLI to run (default: the SDK's bundled one).
PAPERCLIP_CLI_DEFAULT_BUDGET_USD = env_decimal("PAPERCLIP_CLI_DEFAULT_BUDGET_USD", "5")
PAPERCLIP_CLAUDE_CLI = env_str("PAPERCLIP_CLAUDE_CLI", "")
# The Claude Code tools API keys may give an agent in authenticated mode (README, "Claude
# Code agents"): none unless the operator lists them, as for process commands.
PAPERCLIP_CLI_TOOLS = env_list("PAPERCLIP_CLI_TOOLS", "")
# Each Claude Code run in a bubblewrap sandbox (sessions_app/adapters/cli_sandbox.py): `auto`
# where bubblewrap works on this host, `bwrap` always (a run fails without it), or `off`. In
# `authenticated` mode, where API keys configure agents, nothing runs unsandboxed by default.
PAPERCLIP_CLI_SANDBOX = env_choice(
    "PAPERCLIP_CLI_SANDBOX",
    "bwrap" if PAPERCLIP_DEPLOYMENT_MODE == "authenticated" else "auto",
    ("auto", "bwrap", "off"),
)
# The same for Managed Agents agents (README, "Managed Agents"): the agent toolset's tools,
# and the hosts their containers may reach (`*`: any, unrestricted networking).
PAPERCLIP_MANAGED_TOOLS = env_list("PAPERCLIP_MANAGED_TOOLS", "")
PAPERCLIP_MANAGED_HOSTS = env_list("PAPERCLIP_MANAGED_HOSTS", "")
# The Files API files an API key may mount into such an agent's sessions (`*`: any).
PAPERCLIP_MANAGED_FILES = env_list("PAPERCLIP_MANAGED_FILES", "")
# The files a Managed Agents session produced, copied here before it ends: per file, per session.
PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES = env_int("PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES", 25 * 1024 * 1024, minimum=0)
PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES = env_int(
    "PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES", 200 * 1024 * 1024, minimum=0
)
# How often the maintenance pass reads each live remote session's status (docs/runtimes.md, "Health").
PAPERCLIP_MANAGED_HEALTH_INTERVAL_SECONDS = env_int("PAPERCLIP_MANAGED_HEALTH_INTERVAL_SECONDS", 300, minimum=1)
PAPERCLIP_IDLE_PAUSE_MINUTES = env_int("PAPERCLIP_IDLE_PAUSE_MINUTES", 30, minimum=1)
# A generous ceiling on heartbeats that queue work, per API key, in authenticated mode only
# ("N/s|min|hour|day"); what needs a bound is one agent's queue (below).
PAPERCLIP_HEARTBEAT_RATE = env_str("PAPERCLIP_HEARTBEAT_RATE", "1000/min")
if not re.fullmatch(r"[1-9][0-9]*/(s|sec|second|m|min|minute|h|hour|d|day)", PAPERCLIP_HEARTBEAT_RATE):
    raise ImproperlyConfigured(f"PAPERCLIP_HEARTBEAT_RATE must look like 60/min, got {PAPERCLIP_HEARTBEAT_RATE!r}")
# Queued runs one agent may have; another heartbeat is refused 429 `queue_full`.
PAPERCLIP_MAX_QUEUED_RUNS = env_int("PAPERCLIP_MAX_QUEUED_RUNS", 100, minimum=1)
# Runs in progress across the whole deployment (every host; the database decides); 0 = no cap.
# The rest wait queued and start oldest first as runs finish.
PAPERCLIP_MAX_CONCURRENT_RUNS = env_int("PAPERCLIP_MAX_CONCURRENT_RUNS", 0, minimum=0)
# Agent memory (README, "Memory"): UTF-8 bytes one file and one store may hold, checked on
# every write, and the versions kept per file (older ones are pruned as new ones are written).
PAPERCLIP_MEMORY_MAX_FILE_BYTES = env_int("PAPERCLIP_MEMORY_MAX_FILE_BYTES", 64 * 1024, minimum=1)
PAPERCLIP_MEMORY_MAX_STORE_BYTES = env_int("PAPERCLIP_MEMORY_MAX_STORE_BYTES", 1024 * 1024, minimum=1)
PAPERCLIP_MEMORY_VERSIONS_KEPT = env_int("PAPERCLIP_MEMORY_VERSIONS_KEPT", 50, minimum=1)
# Deleted files a store keeps with their versions (to revert or re-create), newest deletions first.
PAPERCLIP_MEMORY_DELETED_FILES_KEPT = env_int("PAPERCLIP_MEMORY_DELETED_FILES_KEPT", 100, minimum=0)
# Budget alert webhooks (costs_app.alerts): attempts per delivery, the first retry's wait
# (each later one waits four times longer), and each request's timeout.
PAPERCLIP_ALERT_MAX_ATTEMPTS = env_int("PAPERCLIP_ALERT_MAX_ATTEMPTS", 5, minimum=1, maximum=20)
PAPERCLIP_ALERT_RETRY_SECONDS = env_int("PAPERCLIP_ALERT_RETRY_SECONDS", 60, minimum=1, maximum=86_400)
PAPERCLIP_ALERT_TIMEOUT_SECONDS = env_int("PAPERCLIP_ALERT_TIMEOUT_SECONDS", 10, minimum=1, maximum=120)
# The hosts an alert target may name in authenticated mode: each attempt's status code,
# error and duration are shown to the API, which would otherwise map the worker's network.
PAPERCLIP_ALERT_HOSTS = env_hosts("PAPERCLIP_ALERT_HOSTS")
# No-work heartbeats (README: "Heartbeats without work"): what a work check may append to
# the task, the hosts its URL may name in authenticated mode, and the schedule back-off.
PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES = env_int(
    "PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES", 16 * 1024, minimum=1, maximum=1024 * 1024
)
PAPERCLIP_WORK_CHECK_HOSTS = env_hosts("PAPERCLIP_WORK_CHECK_HOSTS")
PAPERCLIP_BACKOFF_AFTER_RUNS = env_int("PAPERCLIP_BACKOFF_AFTER_RUNS", 3, minimum=0, maximum=1000)
PAPERCLIP_BACKOFF_MAX_FACTOR = env_int("PAPERCLIP_BACKOFF_MAX_FACTOR", 8, minimum=1, maximum=1024)
# Provider quotas (sessions_app.quota): the longest wait the SDK may sleep through to retry
# a 429 (a reset further away holds the credential instead), how long a hold lasts when the
# refusal names no reset (a credit refusal), and below what share of a rate limit left
# claims are paced (0: never).
PAPERCLIP_QUOTA_RETRY_WINDOW_SECONDS = env_int("PAPERCLIP_QUOTA_RETRY_WINDOW_SECONDS", 10, minimum=0, maximum=600)
PAPERCLIP_QUOTA_HOLD_SECONDS = env_int("PAPERCLIP_QUOTA_HOLD_SECONDS", 300, minimum=1, maximum=7 * 86_400)
# Agent health (sessions_app.agent_health): how many failed runs in a row make an agent `failing`
# (an agent's `health_failing_after_runs` overrides it).
PAPERCLIP_HEALTH_FAILING_AFTER_RUNS = env_int("PAPERCLIP_HEALTH_FAILING_AFTER_RUNS", 3, minimum=1, maximum=1000)
PAPERCLIP_QUOTA_PACE_BELOW_PERCENT = env_int("PAPERCLIP_QUOTA_PACE_BELOW_PERCENT", 10, minimum=0, maximum=100)

SECRET_KEY = secret_key(deployment_mode=PAPERCLIP_DEPLOYMENT_MODE, home=PAPERCLIP_HOME)
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [
    h.strip() for h in env_str("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h.strip()
]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env_str("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

INSTALLED_APPS = [
    # Django's admin with the console as its front page (paperclip/admin_site.py).
    "paperclip.admin_site.PaperclipAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_q",
    "sessions_app",
    "costs_app",
    "memory_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "sessions_app.admin.bad_filters.AdminBadFilterMiddleware",
]

ROOT_URLCONF = "paperclip.urls"
WSGI_APPLICATION = "paperclip.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
# One date format with its zone on every admin page (paperclip/formats/en/formats.py).
FORMAT_MODULE_PATH = ["paperclip.formats"]
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = PAPERCLIP_HOME / "static"
STATIC_ROOT.mkdir(exist_ok=True)
# Without a collected manifest (tests, a fresh checkout) fall back to unhashed names.
WHITENOISE_MANIFEST_STRICT = False
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Request bodies larger than this are refused with 413 before they reach a view.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("PAPERCLIP_MAX_BODY_BYTES", 1_048_576, minimum=1024)

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DATETIME_FORMAT": "iso-8601",
    "COERCE_DECIMAL_TO_STRING": True,
    # One error shape for the whole API: {"error": {"code", "message", "fields"?}}.
    "EXCEPTION_HANDLER": "sessions_app.api.exceptions.api_exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Paperclip Sessions API",
    "DESCRIPTION": "Persistent sessions, heartbeats and costs for LLM agents.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "sessions_app.models.RunStatus",
        "SessionStatusEnum": "sessions_app.models.SessionStatus",
        "AgentStatusEnum": ["active", "paused"],
    },
}

REDIS_URL = env_str("REDIS_URL", "")

# django-q2 keeps cluster statistics in the cache; it must be shared by every process so
# that the web's health probe sees the qcluster's heartbeat.
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.db.DatabaseCache", "LOCATION": "paperclip_cache"}}
# A run's deadline moves before each of its requests to that request's own limit
# (run_queue.run_deadline): at most 3600 s on each of 11 attempts with a 60 s wait between
# them (validation's bounds), plus PAPERCLIP_RUN_TIMEOUT_SECONDS. A run makes at most a
# handoff note, 3 summaries, the answer and the token counts that size them: under 32; a
# tool loop adds up to 50 more answers (max_tool_rounds), each with its token count.
LONGEST_CALL_SECONDS = 3600 * 11 + 60 * 10
LONGEST_RUN_SECONDS = (32 + 2 * 50) * (LONGEST_CALL_SECONDS + PAPERCLIP_RUN_TIMEOUT_SECONDS)
# The task queue's name: its key in the broker (the ORM queue's rows, Redis's list). Two
# deployments sharing one Redis database must have different names, or each takes the
# other's tasks (signed with another secret key, they fail there).
PAPERCLIP_CLUSTER_NAME = env_str("PAPERCLIP_CLUSTER_NAME", "paperclip")
# The deployment's own cluster, the same in every process of the deployment: a host's cluster
# under a name of its own (an agent pinned to it, docs/deployment.md) reads the tasks the
# others send it only under that name (django-q2 signs them with it), reports under it to the
# health probe, and leaves the schedules to the deployment's cluster (django-q2's scheduler
# fires those only in the cluster the deployment is named after).
PAPERCLIP_DEPLOYMENT_CLUSTER_NAME = env_str("PAPERCLIP_DEPLOYMENT_CLUSTER_NAME", PAPERCLIP_CLUSTER_NAME)
for _variable, _name in (
    ("PAPERCLIP_CLUSTER_NAME", PAPERCLIP_CLUSTER_NAME),
    ("PAPERCLIP_DEPLOYMENT_CLUSTER_NAME", PAPERCLIP_DEPLOYMENT_CLUSTER_NAME),
):
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", _name):
        raise ImproperlyConfigured(f"{_variable} must be letters, digits, '.', '_' or '-' (at most 64), got {_name!r}")
Q_CLUSTER = {
    "name": PAPERCLIP_DEPLOYMENT_CLUSTER_NAME,
    "cluster_name": PAPERCLIP_CLUSTER_NAME,
    "workers": env_int("PAPERCLIP_Q_WORKERS", 2, minimum=1),
    # The engine's deadline, not the cluster, decides when a run has failed; the task
    # timeout sits above the longest run any valid agent can make. `retry` must exceed
    # `timeout`, or a slow task is handed to a second worker while it runs (a task lost
    # with a killed worker needs no redelivery: maintenance re-dispatches stuck queues).
    "timeout": LONGEST_RUN_SECONDS,
    "retry": LONGEST_RUN_SECONDS + 60,
    "max_attempts": 1,
    # A restarted cluster must not replay every heartbeat it missed while it was down.
    "catch_up": False,
    "save_limit": 1000,
    "ack_failures": True,
    "label": "Task queue",
}
if REDIS_URL:
    Q_CLUSTER["redis"] = REDIS_URL
else:
    Q_CLUSTER["orm"] = "default"
    # How soon a queued heartbeat is picked up: an agent works its queue one run at a time,
    # so a backlog drains at one poll per run. 100 ms halved a 50-run backlog against 500 ms
    # (RELIABILITY.md); idle, it is ten tiny queries a second.
    Q_CLUSTER["poll"] = env_int("PAPERCLIP_Q_POLL_MS", 100, minimum=10, maximum=10_000) / 1000

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("PAPERCLIP_LOG_LEVEL", "INFO")},
    "loggers": {
        # httpx logs every request line; the SDK's own logger can include headers at DEBUG.
        "httpx": {"level": "WARNING"},
        "httpx2": {"level": "WARNING"},
        "anthropic": {"level": "WARNING"},
    },
}

# HTTPS is on when (and only when) the URL users reach the service at is https://: then plain
# HTTP is redirected (not the load balancer's health probe), cookies are Secure and browsers
# are told to stay on HTTPS. Authenticated mode is often served over HTTP on a private
# network, where a redirect to an HTTPS port nothing serves would break every call.
PAPERCLIP_PUBLIC_URL = env_url("PAPERCLIP_PUBLIC_URL", f"http://localhost:{PAPERCLIP_PORT}")
PAPERCLIP_HTTPS = PAPERCLIP_PUBLIC_URL.startswith("https://")
if urlsplit(PAPERCLIP_PUBLIC_URL).hostname not in ALLOWED_HOSTS:
    ALLOWED_HOSTS.append(urlsplit(PAPERCLIP_PUBLIC_URL).hostname)
if PAPERCLIP_HTTPS:
    CSRF_TRUSTED_ORIGINS.append(PAPERCLIP_PUBLIC_URL)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = PAPERCLIP_HTTPS
# Behind a proxy that terminates TLS, requests arrive as HTTP and only the proxy's
# X-Forwarded-Proto says they were HTTPS (without it the redirect would loop). Trusted only
# when configured: any client can send that header to a server it reaches directly.
if env_bool("PAPERCLIP_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = PAPERCLIP_HTTPS and env_bool("DJANGO_SECURE_SSL_REDIRECT", True)
SECURE_REDIRECT_EXEMPT = [r"^api/health$"]
SECURE_HSTS_SECONDS = env_int("DJANGO_HSTS_SECONDS", 31_536_000, minimum=0) if PAPERCLIP_HTTPS else 0
# Both reach beyond this service (every subdomain; a browser list that is slow to leave),
# so they are never on unless asked for, and Django's checks advising them stay quiet.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_HSTS_PRELOAD", False)
SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]
if not PAPERCLIP_HTTPS:
    # Served over plain HTTP on purpose: paperclip.W003 says so once, instead of Django's
    # four warnings advising HTTPS settings this deployment cannot use.
    SILENCED_SYSTEM_CHECKS += ["security.W004", "security.W008", "security.W012", "security.W016"]

if PAPERCLIP_DEPLOYMENT_MODE == "local_trusted" and PAPERCLIP_HOST not in ("127.0.0.1", "localhost", "::1"):
    raise ImproperlyConfigured(
        f"PAPERCLIP_HOST={PAPERCLIP_HOST} is not a loopback address; local_trusted mode serves an open API "
        "and binds loopback only. Use PAPERCLIP_DEPLOYMENT_MODE=authenticated to listen elsewhere."
    )
