#!/bin/sh
# Starts the Claude Code CLI for sessions_app/adapters/claude_cli.py.
# The SDK hands its child the worker's whole environment; the CLI gets only the variables
# named in PAPERCLIP_CLI_ENV. It runs in a session (so a process group) of its own, whose
# id is written to PAPERCLIP_CLI_PIDFILE: a timeout kills the CLI with all it started.
set -f
echo $$ > "$PAPERCLIP_CLI_PIDFILE" || exit 70
if [ ! -x "$PAPERCLIP_CLI_BIN" ]; then
    echo "Claude Code is not an executable file: $PAPERCLIP_CLI_BIN" >&2
    exit 127
fi
set -- "$PAPERCLIP_CLI_BIN" "$@"
for name in $PAPERCLIP_CLI_ENV; do
    case $name in
        '' | [0-9]* | *[!A-Za-z0-9_]*) echo "bad variable name: $name" >&2; exit 64 ;;
    esac
    if eval "[ -n \"\${$name+set}\" ]"; then
        eval "set -- \"$name=\${$name}\" \"\$@\""
    fi
done
# This shell is not a process group leader (the SDK does not start one), so setsid makes
# the new session in place and the recorded pid is the group's id.
exec setsid env -i "$@"
