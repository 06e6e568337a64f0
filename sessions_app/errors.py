"""The failures of a heartbeat, one family: every one is a `RunFailure(code, message)`.

- `HeartbeatRefused`: the heartbeat is not queued (bad input, agent state, full queue);
  its code maps to an API status in `sessions_app.views`.
- `RunRemoved`: the run's row is gone, with its agent removed entirely (the admin).
- `QueueUnavailable`: the run is queued but could not be handed to the task queue.
- `HistoryUnavailable`: a session's history cannot be read or written (`stores`).
- `StepFailed`: a compaction or handoff step failed (`compaction`); `SummaryFailed` when
  it was the summary call.
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
    "RunRemoved",
    "StepFailed",
    "SummaryFailed",
]


class HeartbeatRefused(RunFailure):
    """The heartbeat cannot be queued. `code` maps to an API status."""


class RunRemoved(HeartbeatRefused):
    """The run's row is gone: its agent was removed entirely (the admin's delete), which
    takes its runs with it, while the run waited or ran. The calls it made are in the
    ledger, which keeps no link to the run that is enforced. Answers as a refusal would:
    `agent_deleted`."""

    def __init__(self, run_id) -> None:
        super().__init__(
            "agent_deleted",
            f"Run {run_id} is gone: its agent was removed while the run waited or ran; "
            "the calls it made are in the ledger.",
        )


class QueueUnavailable(RunFailure):
    """The run is recorded but the task queue (Redis, or the database queue) refused it."""


class HistoryUnavailable(RunFailure):
    """A session's history cannot be read or written. `code` is stored on the failed run."""


class StepFailed(RunFailure):
    """A compaction or handoff step failed; the session is as it was before the step."""


class SummaryFailed(StepFailed):
    """The summary call of a compaction failed (the Messages API, or a `process` agent's
    command): `compaction_<the call's code>`. Compact now answers it as a dependency's
    failure (503), whatever the runtime, not as a conflict with the session."""


class RunAbandoned(RunFailure):
    """The run stopped being ours while the model answered (reaped, or session gone)."""
