"""A fake of the Claude Managed Agents endpoints, served over real HTTP on 127.0.0.1.

Served: versioned agents (`/v1/agents`: create, retrieve, update), environments
(`/v1/environments`: create, list, retrieve, update, archive, delete), sessions
(`/v1/sessions`: create, retrieve, archive, delete; file resources: add, list, retrieve,
delete), session events (send, list, SSE
stream; see `tests/fake_managed_events.py`) and the session-scoped Files API (`/v1/files`:
list with `scope_id`, metadata, content, delete). Every answer is shaped so that the SDK's
own typed beta models validate it, not merely construct it. A session snapshots the agent
version it was created with; an agent update names the version it expects and a stale one
is refused with 409, as the API's optimistic concurrency asks.

Test controls on a `FakeManaged`:

- `fake.script(session_id_or_None, steps)`: the turn run for the next `user.message` of that
  session (None: of any session). Steps are tuples:
    - `("message", text[, usage])`: one model request answering `text`, billing `usage`
      (a dict of input/output/cache_creation_input/cache_read_input tokens);
    - `("tool", name, input, "always_allow" | "always_ask"[, result_text])`: a model request
      emitting `agent.tool_use`; `always_allow` is followed by `agent.tool_result`,
      `always_ask` idles the session with `requires_action` until a `user.tool_confirmation`
      for that event id (allow: the result; deny: an error result carrying deny_message),
      then the remaining steps run;
    - `("budget_reached",)`, `("retries_exhausted",)`, `("refusal",)`: idle with that stop
      reason, dropping the remaining steps;
    - `("reschedule", seconds)`: `session.status_rescheduled`, status `rescheduling` for that
      long, then `session.status_running` again;
    - `("terminate", message)`: `session.error` then `session.status_terminated`; later sends
      are refused with 400 `invalid_request_error`;
    - `("file", filename, data_bytes)`: the agent writes an output file, which the Files API
      then lists under `scope_id=<session id>` (the service's model of session outputs);
    - `("sleep", seconds)`: a pause inside the turn (a `user.interrupt` cuts it short).
  Without a script a turn answers `f"reply {n}: {text}"`, n being the session's count of
  user messages so far, billing 100 * n input and 20 output tokens.
- `fake.latency` (seconds slept per model request, default 0.0),
  `fake.active_seconds_per_turn` (added to usage and stats at each run's end, default 10.0),
  `fake.list_price` (None, the default: sessions report no list cost; else USD Decimal per
  token for input/output/cache_read/cache_write: from the next model request on, a
  session's `usage.list_cost` is priced with it and shown, as the API shows it, in whole cents;
  `fake.list_costs[session_id]` keeps it exact).
- `fake.fail_next(status, times=1, path_prefix=None)`: the next matching requests answer
  that status with the API's error body (and `retry-after` on 429).
- `fake.upload(filename, data)`: a file uploaded through the Files API (what an agent's
  `resources` mount); a session created naming a file the fake does not hold is refused 404.
- `fake.terminate(session_id)`: the service ends the session between turns (its status
  becomes `terminated`), as a container lost to the provider would.
- `fake.before_next(method, path_prefix, action)`: `action()` runs on the fake's thread
  once, when the next matching request arrives and before it is answered (a second actor
  at the moment the service is being read).
- `python -m tests.fake_managed` serves it alone (`serve_forever`).
- Logs: `fake.requests` [(method, path)], `fake.beta_headers` [anthropic-beta or None],
  `fake.user_messages[session_id]` [texts sent], `fake.events[session_id]` [event dicts],
  `fake.charged_seconds[session_id]` (the active seconds the provider charges, kept after a
  deletion: a session deleted while a turn runs is charged that turn's
  `active_seconds_per_turn`, though no one can read it any more).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from tests.fake_anthropic import SHUTDOWN_POLL_SECONDS
from tests.fake_managed_events import EventsMixin, error_body, first, now_iso, paginate

ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def not_found(what: str) -> tuple[int, dict]:
    return 404, error_body("not_found_error", f"no such {what}")


@dataclass
class Raw:
    """A non-JSON answer (a file's content)."""

    data: bytes
    content_type: str


@dataclass
class Failure:
    status: int
    times: int
    path_prefix: str | None


def cloud_config(given: dict | None, current: dict | None = None) -> dict:
    """The environment config the API answers: omitted fields keep their current value (or
    the service's default), as the update params document."""
    given = given or {"type": "cloud"}
    if given.get("type") == "self_hosted":
        return {"type": "self_hosted"}
    current = current if current and current.get("type") == "cloud" else {}
    networking = given.get("networking") or current.get("networking") or {"type": "unrestricted"}
    if networking["type"] == "limited":
        networking = {
            "type": "limited",
            "allow_mcp_servers": bool(networking.get("allow_mcp_servers")),
            "allow_package_managers": bool(networking.get("allow_package_managers")),
            "allowed_hosts": list(networking.get("allowed_hosts") or []),
        }
    packages = dict(current.get("packages") or {}, **(given.get("packages") or {}))
    packages = {k: list(packages.get(k) or []) for k in ("apt", "cargo", "gem", "go", "npm", "pip")}
    return {"type": "cloud", "networking": networking, "packages": {**packages, "type": "packages"}}


class FakeManaged(EventsMixin):
    def __init__(self) -> None:
        self.agents: dict[str, dict] = {}
        self.environments: dict[str, dict] = {}
        self.sessions: dict[str, dict] = {}
        self.files: dict[str, dict] = {}
        self.file_contents: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.beta_headers: list[str | None] = []
        self.user_messages: defaultdict[str, list[str]] = defaultdict(list)
        self.charged_seconds: defaultdict[str, float] = defaultdict(float)
        self.latency = 0.0
        self.active_seconds_per_turn = 10.0
        # None: the session reports no list cost (the API's "absent until cost tracking is available").
        self.list_price: dict[str, Decimal] | None = None
        self.list_costs: dict[str, Decimal] = {}  # each session's list cost, exact (shown in cents)
        self.ping_interval = 1.0
        self._failures: list[Failure] = []
        self._before: list[tuple] = []
        self._ids = itertools.count(1)
        # Re-entrant, because a turn run and a request route share helpers that both lock.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stopping = False
        self._init_events()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeManaged:
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def fail_next(self, status: int, times: int = 1, path_prefix: str | None = None) -> None:
        with self._lock:
            self._failures.append(Failure(status, times, path_prefix))

    def recover(self) -> None:
        """Drop the failures still queued: the service answers again."""
        with self._lock:
            self._failures.clear()

    def upload(self, filename: str, data: bytes) -> str:
        with self._lock:
            return self.add_file(None, filename, data, "text/plain")["id"]

    def terminate(self, session_id: str) -> None:
        with self._lock:
            self.sessions[session_id]["status"] = "terminated"
            self.sessions[session_id]["updated_at"] = now_iso()

    def before_next(self, method: str, path_prefix: str, action) -> None:
        with self._lock:
            self._before.append((method, path_prefix, action))

    def take_before(self, method: str, path: str):
        with self._lock:
            for hook in self._before:
                if hook[0] == method and path.startswith(hook[1]):
                    self._before.remove(hook)
                    return hook[2]
        return None

    def take_failure(self, path: str) -> int | None:
        with self._lock:
            for failure in self._failures:
                if failure.path_prefix is None or path.startswith(failure.path_prefix):
                    failure.times -= 1
                    if failure.times <= 0:
                        self._failures.remove(failure)
                    return failure.status
        return None

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):04d}"

    # Agents

    def create_agent(self, body: dict) -> dict:
        stamp = now_iso()
        agent = {
            "id": self.new_id("agent"),
            "type": "agent",
            "created_at": stamp,
            "updated_at": stamp,
            "archived_at": None,
            "version": 1,
            "name": body["name"],
            "description": body.get("description"),
            "system": body.get("system"),
            "model": {"id": body["model"]} if isinstance(body["model"], str) else body["model"],
            "tools": body.get("tools", []),
            "mcp_servers": [],
            "skills": [],
            "metadata": body.get("metadata", {}),
            "execution_identity": {"type": "service_account"},
        }
        self.agents[agent["id"]] = agent
        return agent

    def update_agent(self, agent_id: str, body: dict) -> tuple[int, dict]:
        agent = self.agents.get(agent_id)
        if agent is None:
            return 404, error_body("not_found_error", f"no agent {agent_id}")
        if body.get("version") not in (None, agent["version"]):
            return 409, error_body("conflict_error", "stale agent version")
        for key in ("name", "description", "system", "tools", "metadata"):
            if key in body:
                agent[key] = body[key]
        if "model" in body:
            model = body["model"]
            agent["model"] = {"id": model} if isinstance(model, str) else model
        agent["version"] += 1
        agent["updated_at"] = now_iso()
        return 200, agent

    def agent_route(self, method: str, parts: list[str], body: dict) -> tuple[int, dict]:
        if len(parts) == 2 and method == "POST":
            return 200, self.create_agent(body)
        if len(parts) == 3 and method == "GET":
            agent = self.agents.get(parts[2])
            if agent is None:
                return 404, error_body("not_found_error", f"no agent {parts[2]}")
            return 200, agent
        if len(parts) == 3 and method == "POST":
            return self.update_agent(parts[2], body)
        return not_found("agent route")

    # Environments

    def create_environment(self, body: dict) -> dict:
        stamp = now_iso()
        environment = {
            "id": self.new_id("env"),
            "type": "environment",
            "archived_at": None,
            "config": cloud_config(body.get("config")),
            "created_at": stamp,
            "updated_at": stamp,
            "description": body.get("description"),
            "metadata": dict(body.get("metadata") or {}),
            "name": body["name"],
            "scope": body.get("scope"),
        }
        self.environments[environment["id"]] = environment
        return environment

    def update_environment(self, environment: dict, body: dict) -> dict:
        for key in ("name", "description", "scope"):
            if body.get(key) is not None:
                environment[key] = body[key]
        if "config" in body:
            environment["config"] = cloud_config(body["config"], environment["config"])
        # Metadata merges; an empty value removes the key, as the update params document.
        for key, value in (body.get("metadata") or {}).items():
            if value in (None, ""):
                environment["metadata"].pop(key, None)
            else:
                environment["metadata"][key] = value
        environment["updated_at"] = now_iso()
        return environment

    def environment_route(self, method: str, parts: list[str], body: dict, query: dict) -> tuple[int, dict]:
        if len(parts) == 2:
            if method == "POST":
                return 200, self.create_environment(body)
            return 200, paginate(list(self.environments.values()), query)
        environment = self.environments.get(parts[2])
        if environment is None:
            return not_found("environment")
        if len(parts) == 3 and method == "GET":
            return 200, environment
        if len(parts) == 3 and method == "POST":
            return 200, self.update_environment(environment, body)
        if len(parts) == 3 and method == "DELETE":
            del self.environments[parts[2]]
            return 200, {"id": parts[2], "type": "environment_deleted"}
        if parts[3:] == ["archive"] and method == "POST":
            environment["archived_at"] = environment["archived_at"] or now_iso()
            return 200, environment
        return not_found("environment route")

    # Sessions

    def create_session(self, body: dict) -> tuple[int, dict]:
        ref = body["agent"]
        agent_id = ref if isinstance(ref, str) else ref["id"]
        agent = self.agents.get(agent_id)
        if agent is None:
            return 404, error_body("not_found_error", f"no agent {agent_id}")
        stamp = now_iso()
        snapshot = {k: v for k, v in agent.items() if k not in ("created_at", "updated_at", "archived_at", "metadata")}
        session = {
            "id": self.new_id("sesn"),
            "type": "session",
            "agent": snapshot,
            "archived_at": None,
            "budget": body.get("budget"),  # as sent: the enforced ceiling (never enforced here; scripts stop a turn)
            "created_at": stamp,
            "updated_at": stamp,
            "environment_id": body["environment_id"],
            "metadata": body.get("metadata", {}),
            "outcome_evaluations": [],
            "resources": [],
            "stats": {"active_seconds": 0.0, "duration_seconds": 0.0},
            "status": "idle",
            "title": body.get("title"),
            "usage": {
                "active_seconds": 0.0,
                "input_tokens": 0,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation": {"ephemeral_5m_input_tokens": 0},
                "list_cost": None if self.list_price is None else {"amount": "0", "currency": "USD"},
            },
            "vault_ids": [],
        }
        for resource in body.get("resources") or []:
            if resource.get("type") == "file" and resource["file_id"] not in self.files:
                return 404, error_body("not_found_error", f"no file {resource['file_id']} to mount")
        self.sessions[session["id"]] = session
        self.events[session["id"]] = []
        for resource in body.get("resources") or []:
            self.add_resource(session, resource)
        return 200, session

    def live_session(self, session: dict) -> dict:
        created = datetime.fromisoformat(session["created_at"].replace("Z", "+00:00"))
        session["stats"]["duration_seconds"] = (datetime.now(UTC) - created).total_seconds()
        return session

    def session_route(self, method: str, parts: list[str], body: dict, query: dict) -> tuple[int, dict]:
        if len(parts) == 2 and method == "POST":
            return self.create_session(body)
        session = self.sessions.get(parts[2]) if len(parts) > 2 else None
        if session is None:
            return not_found("session")
        if len(parts) == 3 and method == "GET":
            return 200, self.live_session(session)
        if len(parts) == 3 and method == "DELETE":
            if self._runs[parts[2]].active:  # the provider charges the time it ran
                self.charged_seconds[parts[2]] += self.active_seconds_per_turn
            del self.sessions[parts[2]]
            self._changed.notify_all()
            return 200, {"id": parts[2], "type": "session_deleted"}
        if parts[3:] == ["archive"] and method == "POST":
            session["archived_at"] = session["archived_at"] or now_iso()
            return 200, session
        if parts[3:] == ["events"] and method == "POST":
            return self.send_events(session, body)
        if parts[3:] == ["events"] and method == "GET":
            return 200, self.list_events(session["id"], query)
        if parts[3:4] == ["resources"]:
            return self.resource_route(session, method, parts[4:], body, query)
        return not_found("session route")

    def resource_route(self, session: dict, method: str, rest: list[str], body: dict, query: dict) -> tuple[int, dict]:
        """The session's mounted inputs; its outputs are Files scoped to it, not resources."""
        resources = session["resources"]
        if not rest:
            if method == "POST":
                return 200, self.add_resource(session, body)
            return 200, paginate(resources, query)
        resource = next((r for r in resources if r["id"] == rest[0]), None)
        if resource is None:
            return not_found("session resource")
        if method == "DELETE":
            resources.remove(resource)
            return 200, {"id": resource["id"], "type": "session_resource_deleted"}
        return 200, resource

    def add_resource(self, session: dict, body: dict) -> dict:
        stamp = now_iso()
        resource = {
            "id": self.new_id("sesrsc"),
            "type": "file",
            "file_id": body["file_id"],
            "mount_path": body.get("mount_path") or f"/mnt/session/uploads/{body['file_id']}",
            "created_at": stamp,
            "updated_at": stamp,
        }
        session["resources"].append(resource)
        return resource

    # Files (the session's outputs)

    def add_file(self, session_id: str | None, filename: str, data: bytes, mime_type: str) -> dict:
        """A file a session wrote (scoped to it), or one uploaded to mount (`session_id` None)."""
        metadata = {
            "id": self.new_id("file"),
            "type": "file",
            "created_at": now_iso(),
            "filename": filename,
            "mime_type": mime_type,
            "size_bytes": len(data),
            "downloadable": session_id is not None,
        }
        if session_id is not None:
            metadata["scope"] = {"type": "session", "id": session_id}
        self.files[metadata["id"]] = metadata
        self.file_contents[metadata["id"]] = data
        return metadata

    def file_route(self, method: str, parts: list[str], query: dict) -> tuple[int, dict | Raw]:
        if len(parts) == 2 and method == "GET":
            return 200, self.list_files(query)
        metadata = self.files.get(parts[2]) if len(parts) > 2 else None
        if metadata is None:
            return not_found("file")
        if len(parts) == 3 and method == "GET":
            return 200, metadata
        if len(parts) == 3 and method == "DELETE":
            del self.files[parts[2]], self.file_contents[parts[2]]
            return 200, {"id": parts[2], "type": "file_deleted"}
        if parts[3:] == ["content"] and method == "GET":
            return 200, Raw(self.file_contents[parts[2]], metadata["mime_type"])
        return not_found("file route")

    def list_files(self, query: dict) -> dict:
        files = sorted(self.files.values(), key=lambda f: f["created_at"], reverse=True)
        if scope_id := first(query, "scope_id"):
            files = [f for f in files if f.get("scope", {}).get("id") == scope_id]
        if ids := query.get("ids[]"):
            return {"data": [f for f in files if f["id"] in ids], "next_page": None}
        return paginate(files, query)

    # HTTP

    def route(self, method: str, path: str, body: dict, beta: str | None = None) -> tuple[int, dict | Raw]:
        url = urlsplit(path)
        # Each segment decoded after the split, as the API reads an id holding "/" (sent as %2F).
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        with self._lock:
            if parts == ["_fake", "stats"]:  # for a fake in another process (benchmarks); not logged
                return 200, {
                    "requests": len(self.requests),
                    "user_messages": sum(map(len, self.user_messages.values())),
                }
            self.requests.append((method, path))
            self.beta_headers.append(beta)
            if parts[:2] == ["v1", "agents"]:
                return self.agent_route(method, parts, body)
            if parts[:2] == ["v1", "environments"]:
                return self.environment_route(method, parts, body, query)
            if parts[:2] == ["v1", "sessions"]:
                return self.session_route(method, parts, body, query)
            if parts[:2] == ["v1", "files"]:
                return self.file_route(method, parts, query)
        return 404, error_body("not_found_error", f"{method} {path}")

    def _handler_class(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            # Headers and body go out in separate writes; Nagle would hold the body back
            # for the client's delayed ack, some 40 ms a request.
            disable_nagle_algorithm = True
            # Connections kept alive between answers, as the API's are (each answer says
            # its length; a stream closes its connection).
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                beta = self.headers.get("anthropic-beta")
                if action := fake.take_before(method, urlsplit(self.path).path):
                    action()
                status = fake.take_failure(urlsplit(self.path).path)
                if status is not None:
                    with fake._lock:
                        fake.requests.append((method, self.path))
                        fake.beta_headers.append(beta)
                    return self._fail(status)
                stream_of = fake.stream_session_id(method, self.path)
                if stream_of is not None:
                    return fake.serve_stream(self, stream_of, beta)
                status, payload = fake.route(method, self.path, body, beta)
                if isinstance(payload, Raw):
                    return self._send(status, payload.data, payload.content_type)
                self._send(status, json.dumps(payload).encode(), "application/json")

            def _fail(self, status: int) -> None:
                kind = ERROR_KINDS.get(status, "api_error")
                data = json.dumps(error_body(kind, f"injected {status}")).encode()
                extra = {"retry-after": "1"} if status == 429 else {}
                self._send(status, data, "application/json", extra)

            def _send(self, status: int, data: bytes, content_type: str, extra: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_DELETE(self) -> None:
                self._answer("DELETE")

        return Handler


def serve_forever() -> None:
    """`python -m tests.fake_managed`: run the fake alone (benchmarks). Prints its base URL
    on the first line; FAKE_LATENCY_MS delays every model request. `GET /_fake/stats`
    counts the requests served and the user messages received."""
    import os
    import signal

    fake = FakeManaged()
    fake.latency = float(os.environ.get("FAKE_LATENCY_MS", "0")) / 1000
    print(fake.base_url, flush=True)

    def stop(*args):
        raise KeyboardInterrupt  # shutdown() from the serving thread itself would deadlock

    signal.signal(signal.SIGTERM, stop)
    try:
        fake._server.serve_forever(poll_interval=SHUTDOWN_POLL_SECONDS)
    except KeyboardInterrupt:
        fake._server.server_close()


if __name__ == "__main__":
    serve_forever()
