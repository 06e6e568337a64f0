"""Statements of the heartbeat's hot path that the ORM cannot write, each with the guarantee
it keeps. Every one runs on SQLite and PostgreSQL; where PostgreSQL needs a row lock that
SQLite's one-writer-at-a-time transactions make unnecessary, only PostgreSQL takes it.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

from django.db import DataError, connection, transaction
from django.db.models import BooleanField, Field, Model, QuerySet, sql
from django.db.models.expressions import RawSQL
from django.db.models.query import get_related_populators
from django.db.models.signals import post_save, pre_save
from django.db.models.sql.compiler import SQLCompiler
from psycopg.errors import DivisionByZero
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.types.json import Jsonb

from sessions_app.models import Agent, AgentStatus, RunStatus

logger = logging.getLogger(__name__)


def agent_not_deleted_locked(agent_id) -> RawSQL:
    """A condition for a single-statement UPDATE: the agent exists and is not deleted, its
    row locked (FOR NO KEY UPDATE) until the statement's implicit COMMIT.

    Guarantee: as in the heartbeat's commit transaction, a deletion (`agent_delete` updates
    the agent's row first) either commits before the statement, which then sees the deleted
    status once the lock is granted (PostgreSQL re-reads a locked row) and updates nothing,
    or waits for the statement's COMMIT. Without the lock, a statement that read the row
    while the deletion's transaction was open would succeed beside it."""
    table, pk = Agent._meta.db_table, Agent._meta.pk
    lock = " FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    return RawSQL(  # noqa: S611 (names from the model, values as parameters)
        f'EXISTS (SELECT 1 FROM "{table}" WHERE "{pk.column}" = %s AND "status" <> %s{lock})',  # noqa: S608
        [pk.get_db_prep_value(agent_id, connection), AgentStatus.DELETED],
        output_field=BooleanField(),
    )


@dataclass(frozen=True)
class _Compiled:
    sql: str
    params: tuple
    slot: int  # the position of the looked-up value among `params`
    text_slots: dict  # the position of each named text value among `params`
    compiler: SQLCompiler  # its select list, converters and related populators
    pk: Field  # the looked-up key's field, which prepares each key as the ORM would


class CompiledLookup:
    """A query by one key of the model's key type (its primary key, or a foreign key to a
    model keyed alike: the agent's live session by agent id), compiled once per database
    connection and then run with another key each time, its rows made into instances as
    Django makes them.

    Guarantee: the same statement and the same instances as `build(pk).first()`. Django
    compiles a query's SQL on every evaluation; the claim's (its annotations: budgets,
    holds, the price revision, six wake subqueries) took about 5 ms to compile and well
    under 1 ms to run (bench/RESULTS.md). Only for queries whose other parameters are
    constants or the text values `texts` names: `build` is called once, with a
    placeholder key and a placeholder for each of those, by name."""

    def __init__(self, build: Callable[..., QuerySet], *, texts: tuple[str, ...] = ()) -> None:
        self.build = build
        self.texts = texts
        self._local = threading.local()

    def first(self, pk, **texts: str) -> Model | None:
        with connection.cursor() as cursor:
            cursor.execute(*self.statement(pk, **texts))
            return self.first_of(cursor.fetchall())

    def statement(self, pk, **texts: str) -> tuple[str, list]:
        """The query's SQL and parameters for `pk` and `texts`, to run alongside others
        (`write_then_read`); `first_of` makes its rows into the instance."""
        compiled = self._compiled()
        params = list(compiled.params)
        params[compiled.slot] = compiled.pk.get_db_prep_value(pk, connection)
        for name, slot in compiled.text_slots.items():
            params[slot] = texts[name]
        return compiled.sql, params

    def first_of(self, rows: list) -> Model | None:
        """The first instance of `rows`, rows of `statement`'s query."""
        instances = self._instances(self._compiled().compiler, rows)
        return instances[0] if instances else None

    def _compiled(self) -> _Compiled:
        cache = self._local.__dict__.setdefault("by_alias", {})
        compiled = cache.get(connection.alias)
        if compiled is None:
            placeholder = uuid.uuid4()
            text_placeholders = {name: f"placeholder {name} {uuid.uuid4()}" for name in self.texts}
            queryset = self.build(placeholder, **text_placeholders)
            pk = queryset.model._meta.pk
            compiler = queryset.query.get_compiler(connection=connection)
            sql, params = compiler.as_sql()
            slot = _only_slot(params, pk.get_db_prep_value(placeholder, connection), "its key")
            text_slots = {name: _only_slot(params, value, name) for name, value in text_placeholders.items()}
            compiled = cache[connection.alias] = _Compiled(sql, tuple(params), slot, text_slots, compiler, pk)
        return compiled

    @staticmethod
    def _instances(compiler: SQLCompiler, rows: list) -> list[Model]:
        """What Django's ModelIterable makes of the rows (select_related and annotations)."""
        select, klass_info = compiler.select, compiler.klass_info
        fields = klass_info["select_fields"]
        start, end = fields[0], fields[-1] + 1
        names = [column[0].target.attname for column in select[start:end]]
        populators = get_related_populators(klass_info, select, connection.alias)
        instances = []
        for row in compiler.results_iter(results=[rows]):
            instance = klass_info["model"].from_db(connection.alias, names, row[start:end])
            for populator in populators:
                populator.populate(row, instance)
            for name, position in compiler.annotation_col_map.items():
                setattr(instance, name, row[position])
            instances.append(instance)
        return instances


def _only_slot(params, value, name: str) -> int:
    """The one position of `value` among a compiled query's `params`."""
    slots = [i for i, param in enumerate(params) if param == value]
    if len(slots) != 1:
        raise ValueError(f"the query names {name} {len(slots)} times; it must name it once")
    return slots[0]


class CompiledStatement:
    """A statement `build(values)` writes (its SQL and parameters, from the ORM's querysets,
    taking each varying value from `values`, a namespace), compiled once per database
    connection and shape, then run with other values each time. `fields` names the model
    field that prepares each value, as the ORM would: a dict of the names the statement
    takes, or, for a statement whose names vary from run to run (the fields a turn sets),
    a function from any name to its field.

    Guarantee: the same statement and parameters as `build` writes with the same values
    (Django compiles a queryset's SQL on every run: the claim's UPDATE, its filters and the
    quota hold's subquery, took about 0.65 ms; the take's two UPDATEs about 0.8, and the
    turn's and its run's outcome 1.1, bench/RESULTS.md). `build` is called once per shape,
    with a placeholder for each value, and each placeholder must show among the statement's
    parameters (a value the ORM does not pass as a parameter cannot vary). The shape is the
    names given and every value that is None or a boolean: the ORM writes None as NULL and
    a condition on it as IS NULL, and a boolean cannot be told apart from the statement's
    own constants, so each such value is compiled as the constant it is."""

    def __init__(self, build: Callable[[SimpleNamespace], tuple], fields: dict[str, Field] | Callable[[str], Field]):
        self.build = build
        self.names = frozenset(fields) if isinstance(fields, dict) else None  # None: any
        self.field_of = fields.__getitem__ if isinstance(fields, dict) else fields
        self._local = threading.local()

    def statement(self, **values) -> tuple[str, list]:
        """The statement's SQL and parameters with `values`."""
        values = self._taken(values)
        sql_, params, slots = self._compiled(values)
        params = list(params)
        for name, positions in slots.items():
            prepared = self._prepared(name, values[name])
            for position in positions:
                params[position] = prepared
        return sql_, params

    def _taken(self, values: dict) -> dict:
        """The values the statement takes (a dict of fields names them; the others are not its)."""
        if self.names is None:
            return values
        return {name: value for name, value in values.items() if name in self.names}

    def _written(self, placeholders: SimpleNamespace) -> tuple[str, list]:
        return self.build(placeholders)

    def _prepared(self, name: str, value):
        return self.field_of(name).get_db_prep_save(value, connection)

    def _compiled(self, values: dict) -> tuple[str, tuple, dict[str, list[int]]]:
        cache = self._local.__dict__.setdefault("by_alias", {})
        key = (connection.alias, _shape(values))
        compiled = cache.get(key)
        if compiled is None:
            varying = {name: value for name, value in values.items() if not _is_constant(value)}
            placeholders = {name: self._placeholder(name, value) for name, value in varying.items()}
            sql_, params = self._written(SimpleNamespace(**{**values, **placeholders}))
            slots = {}
            for name, placeholder in placeholders.items():
                prepared = _comparable(self._prepared(name, placeholder))
                slots[name] = [i for i, value in enumerate(params) if _comparable(value) == prepared]
                if not slots[name]:
                    raise ValueError(f"the statement does not take {name} as a parameter")
            compiled = cache[key] = (sql_, tuple(params), slots)
        return compiled

    @staticmethod
    def _placeholder(name: str, example):
        """A value of `example`'s type that no constant of the statement can equal."""
        unique = uuid.uuid4()
        if isinstance(example, uuid.UUID):
            return unique
        if isinstance(example, datetime):
            return datetime(2999, 1, 1, tzinfo=UTC) + timedelta(microseconds=unique.int % 10**12)
        if isinstance(example, str):
            return f"placeholder {name} {unique}"
        if isinstance(example, int):
            # Within every integer column's range: Django takes a lookup beyond it for one
            # that can never match, and writes no parameter for it.
            return 10**9 + unique.int % 10**9
        if isinstance(example, float):
            return 10.0**12 + (unique.int % 10**9) / 1024
        if isinstance(example, Decimal):
            return Decimal(10**6 + unique.int % 10**6) + Decimal(unique.int % 10**8) / 10**8
        if isinstance(example, list):
            return [f"placeholder {name} {unique}"]
        if isinstance(example, dict):
            return {"placeholder": f"{name} {unique}"}
        raise TypeError(f"{name}: no placeholder for a {type(example).__name__}")


def _is_constant(value) -> bool:
    return value is None or isinstance(value, bool)


def _shape(values: dict) -> tuple:
    """What a compiled statement is kept under: its names, and its None and boolean values."""
    return tuple(sorted((name, value if _is_constant(value) else "") for name, value in values.items()))


def _comparable(param):
    """A parameter as it compares: a JSON value by what it holds (psycopg's `Jsonb` wraps it)."""
    return ("json", param.obj) if isinstance(param, Jsonb) else param


class CompiledUpdate(CompiledStatement):
    """A `CompiledStatement` that is the ORM's `update()`: `build(values)` returns the
    queryset and the values to set; its guarantee is the same statement and parameters as
    that `update()`."""

    def update(self, **values) -> int:
        """Run the statement with `values`; the number of rows it matched."""
        with connection.cursor() as cursor:
            cursor.execute(*self.statement(**values))
            return cursor.rowcount

    def _written(self, placeholders: SimpleNamespace) -> tuple[str, list]:
        return _update_sql(*self.build(placeholders))


def queued_run_insert(run: Model, *, agent_id, bound: int) -> bool:
    """INSERT `run` (a new, unsaved queued run) unless its agent already has `bound` queued
    runs or a run under the same idempotency key: the queue's bound and the insert in one
    statement. False when it inserted nothing.

    Guarantee: the bound is exact when the caller holds the agent's enqueue lock
    (`run_queue._queue_lock`, a statement of its own on PostgreSQL, so this statement's
    snapshot, taken after the lock was granted, sees every run an earlier enqueue of the
    agent committed; SQLite's IMMEDIATE transaction runs one writer at a time), exactly as
    the count and the INSERT it replaces were. A repeated idempotency key inserts nothing
    (ON CONFLICT DO NOTHING: the partial unique index refuses it without an error, so the
    enqueue's transaction needs no savepoint). A deleted agent's row still refuses the run
    by its foreign key."""
    with connection.cursor() as cursor:
        cursor.execute(*_queued_run_insert_sql(run, agent_id=agent_id, bound=bound))
        inserted = cursor.rowcount == 1
    if inserted:
        run._state.adding, run._state.db = False, connection.alias
    return inserted


def queued_run_insert_locking(run: Model, *, agent_id, bound: int, lock: tuple[str, list]) -> bool:
    """PostgreSQL, outside any transaction: the enqueue's whole transaction, `lock` (the
    statement of the agent's enqueue lock) and then `queued_run_insert`'s statement, in one
    round trip where BEGIN, the lock, the INSERT and COMMIT were four. False when it
    inserted nothing.

    Guarantee: that of `queued_run_insert` under the lock, since the transaction is the
    same: the four statements go out in one pipeline (libpq's pipeline mode, one Sync), and
    the server runs them in order, each once the one before has finished, so the INSERT
    takes its snapshot after the lock was granted. Nothing is committed unless all four
    succeed; a failure (the agent's row gone, the COMMIT's foreign key check) is raised as
    Django raises it, after the transaction was rolled back."""
    insert_sql, insert_params = _queued_run_insert_sql(run, agent_id=agent_id, bound=bound)
    (_, insert), _ = _pipelined_transaction([lock, (insert_sql, insert_params)])
    inserted = insert.rowcount == 1
    if inserted:
        run._state.adding, run._state.db = False, connection.alias
    return inserted


def pipelines() -> bool:
    """Whether statements can be sent together here (`write_then_read`,
    `queued_run_insert_locking`): on PostgreSQL, outside any transaction."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def write_then_read(write: tuple[str, list], read: tuple[str, list]) -> tuple[int, list | None]:
    """PostgreSQL, outside any transaction: `write` (a statement and its parameters) in a
    transaction of its own, then `read`, in one round trip where they were two; the rows
    `write` matched and the rows `read` found (None when the read failed after the COMMIT:
    the caller reads again if it needs them).

    Guarantee: what running the two one after the other, each autocommitted, guarantees.
    The server runs them in order (BEGIN, `write`, COMMIT, `read`, then one Sync), so `read`
    takes its snapshot after `write` was committed, and sees what any other transaction
    committed before that. A `write` that fails (or whose COMMIT fails) commits nothing and
    `read` is not run: its error is raised as Django raises it. A `read` that fails is never
    taken for the committed write's failure."""
    (written,), read_rows = _pipelined_transaction([write], read_after=read)
    return written.rowcount, read_rows


@dataclass(frozen=True)
class _Ran:
    rowcount: int
    rows: list | None  # None for a statement that returns no rows


def _pipelined_transaction(
    statements: list[tuple[str, list]], *, read_after: tuple[str, list] | None = None
) -> tuple[list[_Ran], list | None]:
    """BEGIN, `statements` and COMMIT sent at once (PostgreSQL's pipeline mode), outside
    any transaction, then `read_after` if given (in a transaction of its own, after the
    COMMIT); what each statement did, and the rows `read_after` found (None without it, or
    when it failed once the COMMIT had succeeded)."""
    if connection.in_atomic_block:
        raise RuntimeError("a pipelined transaction cannot run inside another")
    connection.ensure_connection()
    raw = connection.connection
    cursors = [connection.cursor() for _ in statements]
    reader = connection.cursor() if read_after is not None else None
    commit = None
    try:
        with connection.wrap_database_errors, raw.pipeline():
            raw.execute("BEGIN")
            for cursor, (statement, params) in zip(cursors, statements, strict=True):
                cursor.execute(statement, params)
            commit = raw.execute("COMMIT")
            if reader is not None:
                reader.execute(*read_after)
        return _ran(cursors), reader.fetchall() if reader is not None else None
    except Exception:
        # A failed statement leaves the transaction aborted, and one that failed before it
        # was sent leaves it open: the BEGIN outlives the Sync. A broken connection has
        # neither, and Django discards it.
        if raw.info.transaction_status in (TransactionStatus.INERROR, TransactionStatus.INTRANS):
            raw.execute("ROLLBACK")
        if commit is not None and _committed(commit):
            logger.warning("A read after a committed write failed; it is read again when needed", exc_info=True)
            return _ran(cursors), None
        raise
    finally:
        for cursor in [*cursors, *([reader] if reader is not None else [])]:
            cursor.close()


def _ran(cursors: list) -> list[_Ran]:
    return [_Ran(cursor.rowcount, cursor.fetchall() if cursor.description else None) for cursor in cursors]


def _committed(commit) -> bool:
    """Whether the COMMIT sent in a pipeline (its cursor) came back committed: a
    transaction aborted before it comes back from COMMIT as ROLLBACK, or not at all."""
    result = commit.pgresult
    return result is not None and result.status == ExecStatus.COMMAND_OK and commit.statusmessage == "COMMIT"


def _queued_run_insert_sql(run: Model, *, agent_id, bound: int) -> tuple[str, list]:
    meta = run._meta
    fields = meta.concrete_fields
    values = [field.get_db_prep_save(field.pre_save(run, add=True), connection) for field in fields]
    agent_column, status_column = meta.get_field("agent").column, meta.get_field("status").column
    columns = ", ".join(f'"{field.column}"' for field in fields)
    sql = (
        f'INSERT INTO "{meta.db_table}" ({columns}) SELECT {", ".join(["%s"] * len(values))} '  # noqa: S608
        f'WHERE (SELECT COUNT(*) FROM "{meta.db_table}" WHERE "{agent_column}" = %s AND "{status_column}" = %s) < %s '
        "ON CONFLICT DO NOTHING"
    )
    agent_key = meta.get_field("agent").target_field.get_db_prep_value(agent_id, connection)
    return sql, [*values, agent_key, RunStatus.QUEUED, bound]


def row_insert(row: Model) -> None:
    """INSERT `row` (new, unsaved, keyed by an auto field) and give it the key the database
    gave it: the ledger's write on every call.

    Guarantee: what `row.save(force_insert=True)` writes, in one statement (its own
    transaction outside one), as Django writes it but compiled once per model and database
    (Django compiling it took about 0.3 ms of each call's bill, bench/RESULTS.md); a
    constraint's refusal raises Django's IntegrityError as save() does. A model whose saves
    something listens to (pre_save, post_save) is saved by save(), so no receiver is ever
    skipped."""
    model = type(row)
    if pre_save.has_listeners(model) or post_save.has_listeners(model):
        row.save(force_insert=True)
        return
    sql_, fields = _insert_returning_key(model, connection.vendor)
    values = [field.get_db_prep_save(field.pre_save(row, add=True), connection) for field in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql_, values)
        (key,) = cursor.fetchone()
    setattr(row, row._meta.auto_field.attname, key)
    row._state.adding, row._state.db = False, connection.alias


@functools.cache
def _insert_returning_key(model: type[Model], vendor: str) -> tuple[str, list[Field]]:
    """The INSERT of a row of `model` and the fields it writes, in order."""
    meta = model._meta
    fields = _inserted_fields(meta)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(field.column) for field in fields)
    sql_ = (
        f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({', '.join(['%s'] * len(fields))}) "  # noqa: S608
        f"RETURNING {quote(meta.auto_field.column)}"
    )
    return sql_, fields


def _inserted_fields(meta) -> list[Field]:
    """The fields an INSERT writes: all but the key the database gives."""
    return [field for field in meta.concrete_fields if field is not meta.auto_field]


def rows_insert_ignoring_conflicts(rows: list[Model]) -> None:
    """INSERT `rows` (new, unsaved, of one model), skipping those a unique constraint refuses.

    Guarantee: what `bulk_create(rows, ignore_conflicts=True)` writes (ON CONFLICT DO NOTHING),
    all or nothing, without the transaction bulk_create opens around its one statement when
    none is open: rows that fit one statement are that statement alone, its own transaction
    (a BEGIN and a COMMIT fewer: two round trips); more go in one transaction, as bulk_create
    would. Keys the database assigns are not read back (nor are they by bulk_create here).
    Every other field must hold a value (one with a Python default does): a field left to
    its database default alone is not written as bulk_create would write it."""
    if not rows:
        return
    meta = rows[0]._meta
    fields = _inserted_fields(meta)
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    row_placeholder = f"({', '.join(['%s'] * len(fields))})"
    size = max(connection.ops.bulk_batch_size(fields, rows), 1)
    batches = [rows[start : start + size] for start in range(0, len(rows), size)]
    with transaction.atomic() if len(batches) > 1 else nullcontext(), connection.cursor() as cursor:
        for batch in batches:
            values = [
                field.get_db_prep_save(field.pre_save(row, add=True), connection) for row in batch for field in fields
            ]
            cursor.execute(
                f"INSERT INTO {connection.ops.quote_name(meta.db_table)} ({columns}) "  # noqa: S608 (model names)
                f"VALUES {', '.join([row_placeholder] * len(batch))} ON CONFLICT DO NOTHING",
                values,
            )


def _update_sql(queryset: QuerySet, values: dict) -> tuple[str, list]:
    """The SQL of `queryset.update(**values)`, as the ORM writes it (a single-table UPDATE)."""
    query = queryset.query.chain(sql.UpdateQuery)
    query.add_update_values(values)
    statement, params = query.get_compiler(queryset.db).as_sql()
    return statement, list(params)


def turn_and_outcome_statement(session: tuple[QuerySet, dict], run: tuple[QuerySet, dict]) -> tuple[str, list]:
    """The SQL and parameters of `turn_and_outcome_run`: the UPDATE of a session (its turn)
    and the UPDATE of the run (its outcome), each a queryset and its values."""
    return _session_then_run_statement(session, run, names=("turn", "outcome"))


def turn_and_outcome_run(
    statement: tuple[str, list], *, read_after: tuple[str, list] | None = None
) -> tuple[bool | None, list | None, int | None]:
    """PostgreSQL: run the statement `turn_and_outcome_statement` wrote, its own transaction: True
    when both matched, False when the session's matched nothing (and so nothing was
    written), None when the session's matched but the run's did not (nor was anything). With
    `read_after`, outside any transaction, that query runs after the statement's COMMIT in
    the same round trip (`write_then_read`), and its rows come second (None when it did not
    run, under a caller's transaction or when nothing was written, or when it failed).
    Third comes the session's `history_rev` as the statement left it (None when it wrote
    nothing: `sessions_app.history_cache`).

    Guarantee: both or neither, as in a transaction. The run's UPDATE reads the session's
    RETURNING, so it runs after the session's (the agent's row locked, then the session's,
    then the run's: the order of the transaction it replaces and of `run_fail`, so no
    deadlock); a data-modifying WITH runs to completion whether or not it is read, so a
    session updated beside a run that is no longer running is undone by failing the whole
    statement (a division by zero, at run time, on that case only). One round trip where
    the transaction it replaces took four, and the release's read a fifth."""
    return _session_then_run_execute(statement, read_after=read_after)


def session_take_statement(session: tuple[QuerySet, dict], run: tuple[QuerySet, dict]) -> tuple[str, list]:
    """The SQL and parameters of `session_take_run`: the session's UPDATE (conditional on its
    still being live) and the run's, each a queryset and its values."""
    return _session_then_run_statement(session, run, names=("taken", "linked"))


def session_take_run(statement: tuple[str, list]) -> bool | None:
    """PostgreSQL: a heartbeat takes the session it resumes and links its run to it in one
    autocommitted statement (`session_take_statement`), with the outcomes of
    `turn_and_outcome_run`.

    Guarantee: no moment exists at which the session is taken and its run not linked, or
    the reverse, so the sweeps, which skip sessions with a running run linked and re-check
    expires_at and pause_at on the row they end, never end a session a heartbeat took; a
    sweep or an operator that ended it first (committed, or holding its row: the UPDATE
    waits, then re-reads it) leaves nothing to take, and nothing is linked. Locks are taken
    session, then run, as every other writer of both takes them. One round trip where the
    link and the take were two."""
    written, _, _ = _session_then_run_execute(statement)
    return written


def _session_then_run_execute(
    statement: tuple[str, list], *, read_after: tuple[str, list] | None = None
) -> tuple[bool | None, list | None, int | None]:
    """Run a statement `_session_then_run_statement` wrote, and `read_after` after it when
    it can (see `turn_and_outcome_run`): the statement's outcome, the read's rows and the
    session's `history_rev` as it left it."""
    try:
        if read_after is not None and pipelines():
            (ran,), read_rows = _pipelined_transaction([statement], read_after=read_after)
            ((sessions_matched, _, history_rev),) = ran.rows
            # Read while the run was still running, the rows say nothing of its end.
            return bool(sessions_matched), read_rows if sessions_matched else None, history_rev
        # Outside a transaction the statement is its own, durable at its end; under a
        # caller's (a test's) a savepoint keeps the refused case from aborting it.
        with transaction.atomic(durable=True) if connection.in_atomic_block else nullcontext():
            with connection.cursor() as cursor:
                cursor.execute(*statement)
                sessions_matched, _, history_rev = cursor.fetchone()
    except DataError as exc:
        if not isinstance(exc.__cause__, DivisionByZero):
            raise
        return None, None, None
    return bool(sessions_matched), None, history_rev


def _session_then_run_statement(
    session: tuple[QuerySet, dict], run: tuple[QuerySet, dict], *, names: tuple[str, str]
) -> tuple[str, list]:
    """`names` name the statement's two parts, so that the statement running says in
    pg_stat_activity which of the two it is."""
    first, second = names
    session_sql, session_params = _update_sql(*session)
    run_queryset, run_values = run
    first_matched = f"EXISTS (SELECT 1 FROM {first})"  # noqa: S608 (our own constant names)
    run_queryset = run_queryset.filter(RawSQL(first_matched, [], output_field=BooleanField()))  # noqa: S611
    run_sql, run_params = _update_sql(run_queryset, run_values)
    statement = (
        f'WITH {first} AS ({session_sql} RETURNING "history_rev"), '  # noqa: S608 (the ORM's SQL)
        f"{second} AS ({run_sql} RETURNING 1) "
        f"SELECT (SELECT COUNT(*) FROM {first}), (SELECT COUNT(*) FROM {second}) / "
        f"CASE WHEN (SELECT COUNT(*) FROM {first}) = (SELECT COUNT(*) FROM {second}) THEN 1 ELSE 0 END, "
        f"(SELECT history_rev FROM {first})"
    )
    return statement, [*session_params, *run_params]
