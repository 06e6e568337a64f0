"""Agent memory: stores of small text files that outlive sessions, with their versions.

A store belongs to one agent (deleting the agent deletes it) and may be shared with other
agents of its company, read-only or read-write. Every write of a file is a version: who
wrote it (a run, or an operator), when, and what it said, so the previous content of any
version is the one before it. Table names are public (docs/data-model.md).
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from sessions_app.models import Agent, Company, HeartbeatRun

DEFAULT_STORE = "default"


class MemoryStore(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="memory_stores")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="memory_stores", db_index=False)
    name = models.CharField(max_length=64, default=DEFAULT_STORE)
    # The sum of the sizes of its live files, kept under the store's row lock by every
    # write: the per-store limit is checked against it without reading every file.
    bytes_used = models.BigIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)

    class Meta:
        db_table = "memory_stores"
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="memory_stores_agent_name_uniq")]

    def __str__(self) -> str:
        return self.name


class MemoryAccess(models.TextChoices):
    READ = "read"
    WRITE = "write"


class MemoryStoreShare(models.Model):
    """Another agent of the store's company may use it, read-only or read-write."""

    store = models.ForeignKey(MemoryStore, on_delete=models.CASCADE, related_name="shares", db_index=False)
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="memory_shares")
    access = models.CharField(max_length=8, choices=MemoryAccess.choices, default=MemoryAccess.READ)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)

    class Meta:
        db_table = "memory_store_shares"
        constraints = [models.UniqueConstraint(fields=["store", "agent"], name="memory_shares_store_agent_uniq")]

    def __str__(self) -> str:
        return f"{self.store} ({self.access})"


class MemoryFile(models.Model):
    """A file's current state. A deleted file keeps its row (and versions), marked deleted,
    so that its history stays readable and a file created again continues its numbering."""

    id = models.BigAutoField(primary_key=True)
    store = models.ForeignKey(MemoryStore, on_delete=models.CASCADE, related_name="files", db_index=False)
    path = models.CharField(max_length=512)  # relative to the store's mount, no leading slash
    content = models.TextField(blank=True, default="")
    size = models.PositiveIntegerField(default=0)  # UTF-8 bytes of `content`
    version = models.PositiveIntegerField(default=0)
    deleted = models.BooleanField(default=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "memory_files"
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["store", "path"], name="memory_files_store_path_uniq")]

    def __str__(self) -> str:
        return self.path


class MemoryWriter(models.TextChoices):
    RUN = "run"
    OPERATOR = "operator"


class MemoryVersion(models.Model):
    id = models.BigAutoField(primary_key=True)
    file = models.ForeignKey(MemoryFile, on_delete=models.CASCADE, related_name="versions", db_index=False)
    number = models.PositiveIntegerField()
    # The file's content after this write; null when the write deleted it.
    content = models.TextField(null=True, blank=True)
    operation = models.CharField(max_length=32)  # create, str_replace, insert, delete, rename, edit, revert
    written_by = models.CharField(max_length=16, choices=MemoryWriter.choices)
    # The run whose tool call wrote it (kept when the run is deleted, as a dangling record).
    run = models.ForeignKey(HeartbeatRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    operator = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "memory_versions"
        ordering = ["file", "-number"]
        constraints = [models.UniqueConstraint(fields=["file", "number"], name="memory_versions_file_number_uniq")]

    def __str__(self) -> str:
        return f"version {self.number}"


class RunToolLoop(models.Model):
    """What a run's tool loop did: the model's rounds of tool calls, and what context
    editing cleared from its requests (`clear_tool_uses`)."""

    run = models.OneToOneField(HeartbeatRun, primary_key=True, on_delete=models.CASCADE, related_name="tool_loop")
    rounds = models.PositiveIntegerField(default=0)
    tool_calls = models.PositiveIntegerField(default=0)
    tool_errors = models.PositiveIntegerField(default=0)
    cleared_tool_uses = models.PositiveIntegerField(default=0)
    cleared_input_tokens = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "run_tool_loops"

    def __str__(self) -> str:
        return f"{self.rounds} tool rounds"
