"""Keep this process's environment from the commands its agents run.

An agent allowed `Bash` (Claude Code) or any `process` agent runs commands as the worker's
user, and a process can read the environment of any other process of its user in
`/proc/{pid}/environ`: the worker's holds `DATABASE_URL`, `DJANGO_SECRET_KEY`, `REDIS_URL`
and the API key. A process that is not dumpable (`prctl(PR_SET_DUMPABLE, 0)`, as ssh-agent
and gpg-agent make themselves) has its `/proc` files owned by root, and only a process with
`CAP_SYS_PTRACE` reads them or attaches to it. Every process that loads Django marks itself
so at start (`SessionsAppConfig.ready`); the children it forks without exec (gunicorn's
workers, the task cluster's) stay so, and what it executes (Claude Code, a command) starts
dumpable with the environment built for it.

The cost: no core dumps, and a debugger or `py-spy` needs root. Root reads any process's
environment whatever this says: run the workers as a user of their own.
"""

from __future__ import annotations

import ctypes
import sys

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4


def environment_hide() -> bool:
    """Make this process not dumpable; False where the system has no such switch."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


def environment_hidden() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
