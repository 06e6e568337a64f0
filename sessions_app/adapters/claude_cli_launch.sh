#!/bin/sh
# Starts the Claude Code CLI for sessions_app/adapters/claude_cli.py.
# The SDK hands its child the worker's whole environment; the CLI gets only the variables
# named in PAPERCLIP_CLI_ENV. Before anything else it enters the run's cgroup, when it has
# one (PAPERCLIP_CLI_CGROUP: every process it starts is born there, whatever it does to its
# environment or session), and writes its pid to PAPERCLIP_CLI_PIDFILE. The CLI runs in a
# session (so a process group) of its own and adopts the orphans of what it starts (a child
# subreaper), so that without a cgroup they are still found under it
# (sessions_app/adapters/cli_processes.py). With PAPERCLIP_CLI_SANDBOX (bubblewrap's command
# line, as JSON), the CLI runs in that sandbox (sessions_app/adapters/cli_sandbox.py).
set -f
if [ -n "$PAPERCLIP_CLI_CGROUP" ]; then
    if ! echo $$ > "$PAPERCLIP_CLI_CGROUP/cgroup.procs"; then
        echo "Could not enter the run's cgroup $PAPERCLIP_CLI_CGROUP" >&2
        exit 71
    fi
fi
echo $$ > "$PAPERCLIP_CLI_PIDFILE" || exit 70
if [ ! -x "$PAPERCLIP_CLI_BIN" ]; then
    echo "Claude Code is not an executable file: $PAPERCLIP_CLI_BIN" >&2
    exit 127
fi
for name in $PAPERCLIP_CLI_ENV; do
    case $name in
        '' | [0-9]* | *[!A-Za-z0-9_]*) echo "bad variable name: $name" >&2; exit 64 ;;
    esac
done
if [ ! -x "$PAPERCLIP_CLI_PYTHON" ]; then
    echo "No Python to start Claude Code with: $PAPERCLIP_CLI_PYTHON" >&2
    exit 127
fi
# The CLI's environment is built by the exec itself, never passed as NAME=value arguments:
# a command line is readable by every local user (/proc/<pid>/cmdline, ps), and these
# values hold the API key. This shell is not a process group leader (the SDK does not start
# one), so setsid makes the new session in place and the recorded pid is the group's id.
# The subreaper flag (prctl PR_SET_CHILD_SUBREAPER) survives the exec into the CLI.
exec "$PAPERCLIP_CLI_PYTHON" -I -S -c '
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
except (OSError, AttributeError):
    pass
os.setsid()
import json
kept = {name: os.environ[name] for name in os.environ["PAPERCLIP_CLI_ENV"].split() if name in os.environ}
cli = os.environ["PAPERCLIP_CLI_BIN"]
sandbox = json.loads(os.environ.get("PAPERCLIP_CLI_SANDBOX") or "[]")
if sandbox:
    # The config directory the SDK made to resume a session, writable in the sandbox too.
    config = kept.get("CLAUDE_CONFIG_DIR")
    if config and os.path.isdir(config):
        sandbox += ["--bind", config, config]
    os.execve(sandbox[0], [*sandbox, "--chdir", os.getcwd(), "--", cli, *sys.argv[1:]], kept)
os.execve(cli, [cli, *sys.argv[1:]], kept)
' "$@"
