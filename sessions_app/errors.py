"""The failures of a heartbeat, one family: every one is a `RunFailure(code, message)`.

- `HeartbeatRefused`: the heartbeat is not queued (bad input, agent state, full queue);
  its code maps to an API status in `sessions_app.views`.
- `QueueUnavailable`: the run is queued but could not be handed to the task queue.
- `HistoryUnavailable`: a session's history cannot be read or written (`stores`).
- `StepFailed`: a compaction or handoff step failed (`compaction`).
- `RunAbandoned`: the run stopped being ours while the model answered.
- `AdapterError` (`adapters.base`) and `BudgetExceeded`/`ModelUnpriced`
  (`costs_app.budgets`) subclass the same base.
"""

from __future__ import annotations

from paperclip.errors import RunFailure

__all__ = [
    "HeartbeatRefused",
    "HistoryUnavailable",
    "QueueUnavailable",
    "RunAbandoned",
    "RunFailure",
    "StepFailed",
]


class HeartbeatRefused(RunFailure):
    """The heartbeat cannot be queued. `code` maps to an API status."""


class QueueUnavailable(RunFailure):
    """The run is recorded but the task queue (Redis, or the database queue) refused it."""


class HistoryUnavailable(RunFailure):
    """A session's history cannot be read or written. `code` is stored on the failed run."""


class StepFailed(RunFailure):
    """A compaction or handoff step failed; the session is as it was before the step."""


class RunAbandoned(RunFailure):
    """The run stopped being ours while the model answered (reaped, or session gone)."""
