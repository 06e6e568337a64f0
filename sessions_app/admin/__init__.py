"""The operator admin: companies, agents, sessions, runs and API keys.

Every operation that spans models or leaves the process goes through `sessions_app.services`
(or the heartbeat engine), exactly as the API does: the admin's deletes, including the bulk
action that bypasses `Model.delete()`, remove history files too.

Lists of sessions and runs grow without bound, so their changelists never load `history`,
join what they display in the one page query, and never COUNT(*) the whole table.

Django's autodiscovery imports this package only: importing each ModelAdmin here is what
registers it. The helpers are re-exported for `costs_app.admin` and the tests.
"""

from sessions_app.admin.agents import AgentAdmin
from sessions_app.admin.api_keys import ApiKeyAdmin
from sessions_app.admin.common import (
    CappedCountPaginator,
    LargeTableAdmin,
    ModelNameFilter,
    admin_link,
    humane_expiry,
    is_changelist,
    money_column,
)
from sessions_app.admin.companies import CompanyAdmin
from sessions_app.admin.managed import ManagedOutputAdmin, ManagedSessionEndAdmin
from sessions_app.admin.quota import CredentialHoldAdmin
from sessions_app.admin.runs import HeartbeatRunAdmin
from sessions_app.admin.sessions import AgentSessionAdmin
from sessions_app.admin.task_queue import ScheduleAdmin

__all__ = [
    "AgentAdmin",
    "AgentSessionAdmin",
    "ApiKeyAdmin",
    "CappedCountPaginator",
    "CompanyAdmin",
    "CredentialHoldAdmin",
    "HeartbeatRunAdmin",
    "LargeTableAdmin",
    "ManagedOutputAdmin",
    "ManagedSessionEndAdmin",
    "ModelNameFilter",
    "ScheduleAdmin",
    "admin_link",
    "humane_expiry",
    "is_changelist",
    "money_column",
]
