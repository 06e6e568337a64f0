"""The `memory_20250818` tool over the memory stores, on the SDK's `BetaAbstractMemoryTool`.

The model asks to view, create, str_replace, insert, delete or rename files under
/memories; this carries it out on the agent's mounts (`memory_app.stores`). Everything
the model can get wrong (a path escaping /memories, a missing file, an oversized write, a
malformed command) is a `ToolError`: the loop sends it back as an `is_error` tool result
the model reads, and the run goes on.
"""

from __future__ import annotations

from anthropic.lib.tools import BetaAbstractMemoryTool, ToolError
from django.db import DatabaseError

from memory_app.models import MemoryFile
from memory_app.stores import (
    ROOT,
    MemoryFault,
    Mount,
    Writer,
    check_content,
    clean_path,
    file_write,
    files_under,
    mounted_store,
    resolve,
    shown,
    tree_delete,
    tree_rename,
)

LINE_NUMBER_WIDTH = 6
# A directory view lists at most this many entries: a store's file count is bounded only
# by its byte limit, and the listing goes into the model's context.
MAX_LISTED = 500


def size_text(size: int) -> str:
    for unit in ("B", "K", "M"):
        if size < 1024 or unit == "M":
            return f"{size}{unit}" if unit == "B" or size == int(size) else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size}B"


def numbered(content: str, start: int = 1) -> str:
    return "\n".join(f"{str(start + i).rjust(LINE_NUMBER_WIDTH)}\t{line}" for i, line in enumerate(content.split("\n")))


class StoreMemoryTool(BetaAbstractMemoryTool):
    """One run's memory tool: the agent's mounts, and the run as the writer of versions."""

    def __init__(self, mounts: list[Mount], *, writer: Writer) -> None:
        super().__init__()
        self.mounts = mounts
        self.writer = writer

    def call(self, input: object):
        """The tool's result for one tool_use input. Raises `ToolError` for anything the
        model did wrong; database failures propagate (they fail the run, not the model)."""
        if not isinstance(input, dict) or not isinstance(input.get("command"), str):
            raise ToolError("The memory tool needs an object with a `command`.")
        try:
            return super().call(input)
        except MemoryFault as fault:
            raise ToolError(fault.message) from None
        except (ToolError, DatabaseError):
            raise
        except NotImplementedError:
            raise ToolError(
                f"Unknown command {input['command']!r}: use view, create, str_replace, insert, delete or rename."
            ) from None
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise ToolError(f"Malformed {input['command']} command: {exc}") from None

    def _at(self, path) -> tuple[Mount, str, str]:
        relative = clean_path(path)
        mount, inside = resolve(self.mounts, relative)
        return mount, inside, relative

    # --- commands ---------------------------------------------------------------------

    def view(self, command):
        mount, inside, relative = self._at(command.path)
        store = mounted_store(mount) if inside else None
        found = MemoryFile.objects.filter(store=store, path=inside, deleted=False).first() if store else None
        if found is not None:
            return self._view_file(command, found)
        return self._view_directory(relative)

    def _view_file(self, command, found: MemoryFile) -> str:
        lines = found.content.split("\n")
        start, end = 1, len(lines)
        view_range = command.view_range
        if view_range:
            if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
                raise ToolError("view_range must be two line numbers, [start, end] (end -1: to the end).")
            start = max(1, view_range[0])
            end = len(lines) if view_range[1] == -1 else min(view_range[1], len(lines))
        body = numbered("\n".join(lines[start - 1 : end]), start)
        return f"Here's the content of {command.path} with line numbers:\n{body}"

    def _view_directory(self, relative: str) -> str:
        entries: list[tuple[int, str]] = []
        if not relative:
            for mount in self.mounts:
                if mount.prefix:
                    entries.append((0, mount.prefix))
                entries += [(f.size, mount.prefix + f.path) for f in self._files(mount, "")]
        else:
            mount, inside = resolve(self.mounts, relative)
            entries = [(f.size, mount.prefix + f.path) for f in self._files(mount, inside)]
            if not entries and inside:
                raise ToolError(f"The path {ROOT}/{relative} does not exist. Please provide a valid path.")
        entries.sort(key=lambda entry: entry[1])
        directory = f"{ROOT}/{relative}" if relative else ROOT
        lines = [f"{size_text(size)}\t{ROOT}/{path}" for size, path in entries[:MAX_LISTED]]
        if len(entries) > MAX_LISTED:
            lines.append(f"... and {len(entries) - MAX_LISTED} more")
        return "\n".join([f"Here're the files and directories in {directory}, excluding hidden items:", *lines])

    @staticmethod
    def _files(mount: Mount, directory: str) -> list:
        store = mounted_store(mount)
        return list(files_under(store, directory)[:MAX_LISTED]) if store is not None else []

    def create(self, command):
        mount, inside, _ = self._at(command.path)
        text = check_content(command.file_text, "file_text")
        file_write(mount, inside, lambda current: text, operation="create", writer=self.writer)
        return f"File created successfully at: {shown(mount, inside)}"

    def str_replace(self, command):
        mount, inside, _ = self._at(command.path)
        old, new = check_content(command.old_str, "old_str"), check_content(command.new_str, "new_str")
        if not old:
            raise ToolError("old_str must not be empty.")

        def replace(current: str | None) -> str:
            if current is None:
                raise ToolError(f"The path {command.path} does not exist. Please provide a valid path.")
            count = current.count(old)
            if count != 1:
                where = "did not appear verbatim in" if count == 0 else f"appears {count} times in"
                raise ToolError(f"No replacement was performed: old_str `{old}` {where} {command.path}.")
            return current.replace(old, new)

        found = file_write(mount, inside, replace, operation="str_replace", writer=self.writer)
        return f"The memory file has been edited (version {found.version})."

    def insert(self, command):
        mount, inside, _ = self._at(command.path)
        text = check_content(command.insert_text, "insert_text")
        line = command.insert_line
        if not isinstance(line, int) or isinstance(line, bool):
            raise ToolError("insert_line must be a line number.")

        def insert(current: str | None) -> str:
            if current is None:
                raise ToolError(f"The path {command.path} does not exist. Please provide a valid path.")
            lines = current.split("\n") if current else []
            if not 0 <= line <= len(lines):
                raise ToolError(f"Invalid `insert_line` parameter: {line}. It should be within [0, {len(lines)}].")
            lines.insert(line, text.rstrip("\n"))
            return "\n".join(lines)

        file_write(mount, inside, insert, operation="insert", writer=self.writer)
        return f"The file {command.path} has been edited."

    def delete(self, command):
        mount, inside, _ = self._at(command.path)
        count = tree_delete(mount, inside, writer=self.writer)
        return f"Successfully deleted {command.path}" + (f" ({count} files)" if count > 1 else "")

    def rename(self, command):
        source, old, _ = self._at(command.old_path)
        target, new, _ = self._at(command.new_path)
        if source is not target:
            raise ToolError(
                f"Cannot rename {command.old_path} to {command.new_path}: they are in different memory stores, and "
                f"files can be renamed only within one. Create {command.new_path} and delete {command.old_path} instead."
            )
        tree_rename(source, old, new, writer=self.writer)
        return f"Successfully renamed {command.old_path} to {command.new_path}"


def tool_result(tool: StoreMemoryTool, block: dict) -> dict:
    """The tool_result block answering one tool_use block."""
    result = {"type": "tool_result", "tool_use_id": block.get("id", "")}
    try:
        content = tool.call(block.get("input"))
    except ToolError as error:
        content = error.content if isinstance(error.content, str) else str(error.content)
        result["is_error"] = True
    result["content"] = content if isinstance(content, str) else str(content)
    return result
