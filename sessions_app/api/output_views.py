"""The files an agent's Managed Agents sessions produced, copied here as each ended
(`sessions_app.managed_outputs`).

    GET    /api/companies/{id}/agents/{id}/outputs             the list (?session_id=, newest first, paged)
    GET    /api/companies/{id}/agents/{id}/outputs/{id}        the file's bytes
    DELETE /api/companies/{id}/agents/{id}/outputs/{id}        delete the copy
"""

from __future__ import annotations

from uuid import UUID

from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import NotFound
from sessions_app.api.pagination import Keyset, parse_limit
from sessions_app.managed_outputs import output_delete, output_path
from sessions_app.models import Agent, ManagedOutput, session_public_id

OUTPUT_ORDER = Keyset("created_at", descending=True)  # managed_outputs_agent_idx


class OutputSerializer(serializers.ModelSerializer):
    session_id = serializers.SerializerMethodField(help_text="`sess_` + 32 hex digits, as the session was shown.")
    stored = serializers.BooleanField(read_only=True, help_text="False when a size limit kept the copy out.")

    class Meta:
        model = ManagedOutput
        fields = [
            "id",
            "session_id",
            "remote_session_id",
            "file_id",
            "filename",
            "media_type",
            "size_bytes",
            "sha256",
            "stored",
            "skipped",
            "created_at",
        ]

    def get_session_id(self, output: ManagedOutput) -> str | None:
        return session_public_id(output.session_id)


class OutputListSerializer(serializers.Serializer):
    outputs = OutputSerializer(many=True)
    next = serializers.CharField(allow_null=True)


class OutputListView(ApiView):
    @extend_schema(
        operation_id="agent_outputs_list",
        parameters=[
            OpenApiParameter(
                "session_id", str, description="Only the outputs of this session (`sess_…`, or the plain UUID)."
            ),
            OpenApiParameter("limit", int),
            OpenApiParameter("next", str),
        ],
        responses={200: OutputListSerializer, **error_responses(400)},
        description="The files the agent's Managed Agents sessions produced, copied when each session ended "
        "(TTL, deletion, rotation, a stateless run's end), newest first. A file over a size limit is listed with "
        "`stored: false` and why in `skipped`.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        outputs = ManagedOutput.objects.filter(agent=agent)
        if (session_id := self.query_session_id("session_id")) is not None:
            outputs = outputs.filter(session_id=session_id)
        limit = parse_limit(request.query_params.get("limit"))
        rows, cursor = OUTPUT_ORDER.page(outputs, limit=limit, cursor=request.query_params.get("next"))
        return Response({"outputs": OutputSerializer(rows, many=True).data, "next": cursor})


class OutputDetailView(ApiView):
    def output(self, agent: Agent, output_id: int) -> ManagedOutput:
        output = ManagedOutput.objects.filter(pk=output_id, agent=agent).first()
        if output is None:
            raise NotFound("No such output.")
        return output

    @extend_schema(
        operation_id="agent_output_download",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **error_responses()},
        description="The file's bytes, as the session produced them, always as `application/octet-stream` "
        "with `Content-Disposition: attachment` (its own type is `media_type` in the list). "
        "404 `output_not_stored` for a file a size limit kept out.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID, output_id: int):
        output = self.output(self.get_agent(company_id, agent_id), output_id)
        if not output.stored:
            raise NotFound(f"This file was not copied: {output.skipped}", code="output_not_stored")
        try:
            handle = output_path(output).open("rb")
        except FileNotFoundError:
            raise NotFound("The copy of this file is missing from this host.", code="output_missing") from None
        return FileResponse(
            handle,
            as_attachment=True,
            filename=output.filename,
            # Never the file's own type: what an agent wrote is not rendered from this origin.
            content_type="application/octet-stream",
        )

    @extend_schema(operation_id="agent_output_delete", responses={204: None, **error_responses()})
    def delete(self, request, company_id: UUID, agent_id: UUID, output_id: int):
        output_delete(self.output(self.get_agent(company_id, agent_id), output_id))
        return Response(status=status.HTTP_204_NO_CONTENT)
