"""The one failure type of a heartbeat's steps, shared by both apps.

It lives in the project package so that `costs_app` (budgets refuse calls) and
`sessions_app` (the engine, stores, adapters) can both raise it without `costs_app`
importing anything of `sessions_app`. `sessions_app.errors` re-exports it with the
engine's own subclasses.
"""

from __future__ import annotations


class RunFailure(Exception):
    """A step of a heartbeat that failed, as operators see it: `code` is stable and stored
    on the run (`error_code`), `message` says what happened (`error`). The engine catches
    this one class; anything else is a bug and fails the run `internal_error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
