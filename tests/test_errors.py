"""Every failure of a heartbeat's steps is one type: the engine catches `RunFailure` alone."""

from __future__ import annotations

import pytest

from costs_app.budgets import BudgetExceeded, ModelUnpriced
from sessions_app.adapters import AdapterError
from sessions_app.errors import (
    HeartbeatRefused,
    HistoryUnavailable,
    QueueUnavailable,
    RunAbandoned,
    RunFailure,
    StepFailed,
)


@pytest.mark.parametrize(
    "failure, code",
    [
        (HeartbeatRefused("agent_paused", "paused"), "agent_paused"),
        (QueueUnavailable("queue_unavailable", "down"), "queue_unavailable"),
        (HistoryUnavailable("history_missing", "gone"), "history_missing"),
        (StepFailed("compaction_model_timeout", "slow"), "compaction_model_timeout"),
        (RunAbandoned("run_timeout", "reaped"), "run_timeout"),
        (AdapterError("process_command_not_allowed", "no", retryable=False), "process_command_not_allowed"),
        (BudgetExceeded("over"), "budget_exceeded"),
        (ModelUnpriced("no price"), "model_unpriced"),
    ],
)
def test_every_step_failure_is_a_run_failure_with_a_code_and_a_message(failure, code):
    assert isinstance(failure, RunFailure)
    assert (failure.code, failure.message, str(failure)) == (code, str(failure), failure.message)
