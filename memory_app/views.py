"""The memory API: an agent's memory files as the agent sees them under /memories.

    GET    /api/companies/{id}/agents/{id}/memory           the files (listing)
    GET    /api/companies/{id}/agents/{id}/memory/{path}    a file, its versions (?version=N: that one)
    PUT    /api/companies/{id}/agents/{id}/memory/{path}    write it (an operator's version)
    DELETE /api/companies/{id}/agents/{id}/memory/{path}    delete it (a version too)

Company-scoped like every endpoint: the agent is looked up in the URL's company, which the
key must be limited to, and only stores of that company are ever mounted.
"""

from __future__ import annotations

from uuid import UUID

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from memory_app.models import MemoryFile, MemoryStore
from memory_app.stores import (
    DEFAULT_STORE,
    ROOT,
    MemoryFault,
    Mount,
    Writer,
    clean_path,
    file_write,
    files_under,
    memory_store_names,
    mounts_for,
    resolve,
    shown,
    tree_delete,
)
from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import BadRequest, Conflict, NotFound
from sessions_app.models import Agent

MAX_LISTED = 1000
FAULT_ERRORS = {
    "memory_not_found": NotFound,
    "memory_not_configured": NotFound,
    "agent_deleted": NotFound,  # deleted while the write was on its way
    "memory_store_full": Conflict,
    "memory_version_conflict": Conflict,
    "memory_exists": Conflict,
    "memory_read_only": Conflict,
}


# The request field each 400 fault is about (docs/api.md, "Memory"): a client fixes that one.
FAULT_FIELDS = {
    "memory_path_invalid": "path",
    "memory_content_invalid": "content",
    "memory_file_too_large": "content",
}


def fault_error(fault: MemoryFault) -> Exception:
    error = FAULT_ERRORS.get(fault.code)
    if error is None:
        field = FAULT_FIELDS.get(fault.code)
        return BadRequest(fault.message, code=fault.code, fields={field: fault.message} if field else None)
    return error(fault.message, code=fault.code)


def operator_mounts(agent: Agent) -> list[Mount]:
    """The agent's mounts as its runs see them, plus its own stores no longer configured
    (an operator still sees and edits them). A store of its own not written yet is an
    unsaved placeholder (`_state.adding`), made by the first write that succeeds."""
    own = MemoryStore.objects.filter(agent=agent).values_list("name", flat=True)
    names = list(dict.fromkeys([DEFAULT_STORE, *memory_store_names(agent), *sorted(own)]))
    return mounts_for(agent, names)


class MemoryFileSerializer(serializers.Serializer):
    path = serializers.CharField(help_text="Under /memories, as the agent's memory tool sees it.")
    store = serializers.CharField(help_text="The store it lives in (`default`, or a named or shared store).")
    size = serializers.IntegerField(help_text="UTF-8 bytes.")
    version = serializers.IntegerField()
    updated_at = serializers.DateTimeField()
    writable = serializers.BooleanField(help_text="False for a store shared with this agent read-only.")


class MemoryListSerializer(serializers.Serializer):
    files = MemoryFileSerializer(many=True)
    truncated = serializers.BooleanField(help_text=f"More than {MAX_LISTED} files: the first ones only.")


class MemoryVersionSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    operation = serializers.CharField()
    written_by = serializers.ChoiceField(choices=["run", "operator"])
    run_id = serializers.UUIDField(allow_null=True)
    operator = serializers.CharField()
    created_at = serializers.DateTimeField()
    deleted = serializers.BooleanField(help_text="This write deleted the file.")


class MemoryFileDetailSerializer(MemoryFileSerializer):
    content = serializers.CharField(allow_blank=True)
    versions = MemoryVersionSerializer(many=True, help_text="Newest first (PAPERCLIP_MEMORY_VERSIONS_KEPT kept).")


class MemoryWriteSerializer(serializers.Serializer):
    content = serializers.CharField(allow_blank=True, trim_whitespace=False)
    version = serializers.IntegerField(
        required=False,
        min_value=0,
        help_text="The version you read (0: the file must not exist); refused 409 when it moved on.",
    )


def file_row(mount: Mount, found: MemoryFile) -> dict:
    return {
        "path": f"{ROOT}/{mount.prefix}{found.path}",
        "store": mount.store.name,
        "size": found.size,
        "version": found.version,
        "updated_at": found.updated_at,
        "writable": mount.writable,
    }


MEMORY_PATH = OpenApiParameter(
    "memory_path", str, OpenApiParameter.PATH, description="The file's path below /memories, e.g. `notes/todo.md`."
)


class MemoryListView(ApiView):
    @extend_schema(
        operation_id="memory_list",
        responses={200: MemoryListSerializer, **error_responses()},
        description="The agent's memory files: its default store at /memories, named and shared stores below it.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        rows = []
        for mount in operator_mounts(agent):
            if mount.store._state.adding:
                continue
            rows += [file_row(mount, found) for found in files_under(mount.store, "")[: MAX_LISTED + 1]]
        rows.sort(key=lambda row: row["path"])
        return Response({"files": rows[:MAX_LISTED], "truncated": len(rows) > MAX_LISTED})


class MemoryFileView(ApiView):
    def locate(self, agent: Agent, memory_path: str, *, folder_ok: bool = False) -> tuple[Mount, str]:
        """The mount and the path inside its store; "" for the store's own folder (/memories, or a
        named store's /memories/<name>) only when `folder_ok`."""
        try:
            relative = clean_path(f"{ROOT}/{memory_path}")
            mount, inside = resolve(operator_mounts(agent), relative)
        except MemoryFault as fault:
            raise fault_error(fault) from None
        if not inside and not folder_ok:
            message = f"{shown(mount, inside)} is a directory; name a file below it."
            raise BadRequest(message, code="memory_path_invalid", fields={"path": message})
        return mount, inside

    @extend_schema(
        operation_id="memory_retrieve",
        parameters=[MEMORY_PATH, OpenApiParameter("version", int, required=False)],
        responses={200: MemoryFileDetailSerializer, **error_responses(400)},
        description="A memory file, with its versions; `?version=N` answers with that version's content.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID, memory_path: str):
        agent = self.get_agent(company_id, agent_id)
        mount, inside = self.locate(agent, memory_path)
        found = MemoryFile.objects.filter(store_id=mount.store.pk, path=inside).first()
        if found is None or mount.store._state.adding:
            raise NotFound(f"No memory file {ROOT}/{memory_path}.", code="memory_not_found")
        versions = list(found.versions.order_by("-number"))
        # Versions are numbered from 1: `?version=0` named none, and answered the current content.
        wanted = self.query_int("version", default=0, minimum=1, maximum=2**31 - 1)
        content = found.content
        if wanted:
            chosen = next((v for v in versions if v.number == wanted), None)
            if chosen is None:
                raise NotFound(f"No version {wanted} of {ROOT}/{memory_path}.", code="memory_not_found")
            content = chosen.content or ""
        elif found.deleted:
            raise NotFound(f"No memory file {ROOT}/{memory_path} (deleted).", code="memory_not_found")
        return Response(
            {
                **file_row(mount, found),
                "content": content,
                "versions": [
                    {
                        "number": v.number,
                        "operation": v.operation,
                        "written_by": v.written_by,
                        "run_id": v.run_id,
                        "operator": v.operator,
                        "created_at": v.created_at,
                        "deleted": v.content is None,
                    }
                    for v in versions
                ],
            }
        )

    @extend_schema(
        operation_id="memory_write",
        parameters=[MEMORY_PATH],
        request=MemoryWriteSerializer,
        responses={200: MemoryFileSerializer, **error_responses(400, 409)},
        description="Write a memory file (a new version by an operator). Over PAPERCLIP_MEMORY_MAX_FILE_BYTES: 400 "
        "`memory_file_too_large`; over the store's limit: 409 `memory_store_full`; `version` not current: 409 "
        "`memory_version_conflict`; a store shared read-only: 409 `memory_read_only`.",
    )
    def put(self, request, company_id: UUID, agent_id: UUID, memory_path: str):
        agent = self.get_agent(company_id, agent_id)
        if not isinstance(request.data, dict):
            raise BadRequest("The body must be a JSON object.", code="invalid")
        body = MemoryWriteSerializer(data=request.data)
        if not isinstance(request.data.get("content"), str):
            raise BadRequest("content must be text.", code="invalid", fields={"content": "must be a string"})
        if "version" in request.data and (
            isinstance(request.data["version"], bool) or not isinstance(request.data["version"], int)
        ):
            raise BadRequest("version must be a whole number.", code="invalid", fields={"version": "not a number"})
        unknown = sorted(set(request.data) - {"content", "version"})
        if unknown:
            raise BadRequest(f"Unknown field {unknown[0]!r}.", code="invalid", fields={unknown[0]: "unknown"})
        if not body.is_valid():
            field, problems = next(iter(body.errors.items()))
            raise BadRequest(f"{field}: {problems[0]}", code="invalid", fields={field: str(problems[0])})
        mount, inside = self.locate(agent, memory_path)
        content = body.validated_data["content"]
        try:
            found = file_write(
                mount,
                inside,
                lambda current: content,
                operation="edit",
                writer=Writer(operator=operator_name(request)),
                expected_version=body.validated_data.get("version"),
            )
        except MemoryFault as fault:
            raise fault_error(fault) from None
        return Response(file_row(mount, found))

    @extend_schema(
        operation_id="memory_delete",
        parameters=[MEMORY_PATH],
        responses={204: None, **error_responses(400, 409)},
        description="Delete a memory file, or every file below a folder (each deletion is a version).",
    )
    def delete(self, request, company_id: UUID, agent_id: UUID, memory_path: str):
        agent = self.get_agent(company_id, agent_id)
        # A store's folder reaches `tree_delete`, which refuses it by name.
        mount, inside = self.locate(agent, memory_path, folder_ok=True)
        if inside and mount.store._state.adding:
            raise NotFound(f"No memory file {ROOT}/{memory_path}.", code="memory_not_found")
        try:
            tree_delete(mount, inside, writer=Writer(operator=operator_name(request)))
        except MemoryFault as fault:
            raise fault_error(fault) from None
        return Response(status=status.HTTP_204_NO_CONTENT)


def operator_name(request) -> str:
    """Who wrote, as versions record it: the API key's name and prefix, never the key."""
    key = request.auth
    if key is not None and hasattr(key, "prefix"):
        return f"api key {key.name or ''} {key.prefix}".replace("  ", " ")
    return "api"
