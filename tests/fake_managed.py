"""A fake of the Claude Managed Agents endpoints, served over real HTTP on 127.0.0.1.

So far the versioned agents (`/v1/agents`: create, retrieve, update) and sessions
(`/v1/sessions`: create, retrieve, archive, delete) are served; a session snapshots the
agent's version it was created with, as the service does. Every
answer is shaped so that the SDK's own typed beta models validate it, not merely construct it.
An update names the version it expects, as the API's optimistic concurrency asks; a stale
version is refused with 409.
"""

from __future__ import annotations

import itertools
import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class FakeManaged:
    def __init__(self) -> None:
        self.agents: dict[str, dict] = {}
        self.sessions: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeManaged:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def create_agent(self, body: dict) -> dict:
        stamp = now_iso()
        agent = {
            "id": f"agent_{next(self._ids):04d}",
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

    def create_session(self, body: dict) -> tuple[int, dict]:
        ref = body["agent"]
        agent_id = ref if isinstance(ref, str) else ref["id"]
        agent = self.agents.get(agent_id)
        if agent is None:
            return 404, error_body("not_found_error", f"no agent {agent_id}")
        stamp = now_iso()
        snapshot = {k: v for k, v in agent.items() if k not in ("created_at", "updated_at", "archived_at", "metadata")}
        session = {
            "id": f"sesn_{next(self._ids):04d}",
            "type": "session",
            "agent": snapshot,
            "archived_at": None,
            "budget": None,
            "created_at": stamp,
            "updated_at": stamp,
            "environment_id": body["environment_id"],
            "metadata": body.get("metadata", {}),
            "outcome_evaluations": [],
            "resources": [],
            "stats": {"active_seconds": 0.0, "duration_seconds": 0.0},
            "status": "idle",
            "title": body.get("title"),
            "usage": {"active_seconds": 0.0, "input_tokens": 0, "output_tokens": 0},
            "vault_ids": [],
        }
        self.sessions[session["id"]] = session
        return 200, session

    def session_route(self, method: str, parts: list[str], body: dict) -> tuple[int, dict]:
        if len(parts) == 2 and method == "POST":
            return self.create_session(body)
        session = self.sessions.get(parts[2]) if len(parts) > 2 else None
        if session is None:
            return 404, error_body("not_found_error", "no such session")
        if len(parts) == 3 and method == "GET":
            return 200, session
        if len(parts) == 3 and method == "DELETE":
            del self.sessions[parts[2]]
            return 200, {"id": parts[2], "type": "session_deleted"}
        if parts[3:] == ["archive"] and method == "POST":
            session["archived_at"] = session["archived_at"] or now_iso()
            return 200, session
        return 404, error_body("not_found_error", f"{method} {'/'.join(parts)}")

    def route(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        parts = path.split("?")[0].strip("/").split("/")
        with self._lock:
            self.requests.append((method, path))
            if parts[:2] == ["v1", "agents"]:
                if len(parts) == 2 and method == "POST":
                    return 200, self.create_agent(body)
                if len(parts) == 3 and method == "GET":
                    agent = self.agents.get(parts[2])
                    if agent is None:
                        return 404, error_body("not_found_error", f"no agent {parts[2]}")
                    return 200, agent
                if len(parts) == 3 and method == "POST":
                    return self.update_agent(parts[2], body)
            if parts[:2] == ["v1", "sessions"]:
                return self.session_route(method, parts, body)
        return 404, error_body("not_found_error", f"{method} {path}")

    def _handler_class(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                status, payload = fake.route(method, self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_DELETE(self) -> None:
                self._answer("DELETE")

        return Handler


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}
