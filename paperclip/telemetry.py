"""OpenTelemetry traces and metrics, when the standard OTEL_* variables ask for them.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and
`OTEL_SDK_DISABLED` is not `true`; off otherwise, and then nothing of the OpenTelemetry
SDK, its exporters or its instrumentations is imported, and every helper here is a no-op
that costs a function call. Started once per process (`telemetry_start`, from the apps'
`ready`): the SDK reads the rest of the OTEL_* variables itself (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`, the sampler, ...).

- Every heartbeat is a trace: `heartbeat` (the run's span: its ids, outcome, cost and
  tokens), with a child span per engine step (`step`): claim, plan, fit, reserve, call,
  commit, release. The `anthropic` SDK's own span of each Messages call
  (`anthropic.messages.create`, GenAI attributes) is a child of `call`, as is the `bill`
  span of each call written to the ledger (every runtime's, Claude Code's and a process
  agent's included).
- Django requests and database queries are traced by the official instrumentations.
- A Claude Code run is given the `TRACEPARENT` of its `call` span (`traceparent`).
- Metrics (`record_run`, `record_bill`, the held credentials' gauge): runs by status,
  run duration, queue age, spend, tokens, credentials held.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

SCOPE = "paperclip"
_state: dict[str, Any] = {}


@functools.cache
def enabled() -> bool:
    """Whether the environment asks for OpenTelemetry (read once per process)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def telemetry_start(*, span_exporter=None, metric_reader=None, held_count: Callable[[], int] | None = None) -> bool:
    """Make the tracer and meter providers, exporting over OTLP (HTTP/protobuf), and
    instrument Django and the database drivers. Tests hand in the SDK's in-memory exporter
    and reader instead (and `telemetry_stop` after). Once per process; False when off.

    The providers are this module's, not OpenTelemetry's global ones: the anthropic SDK is
    handed ours (`sdk_option`), the instrumentations too, so that stopping undoes it all."""
    if _state.get("started") or not (enabled() or span_exporter is not None):
        return bool(_state.get("started"))
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "paperclip"})
    tracer_provider = TracerProvider(resource=resource)
    if span_exporter is None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # Batched: a heartbeat never waits for the collector (the processor re-arms its
        # thread in a forked task worker).
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        metric_reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    else:
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    meter_provider = MeterProvider(resource=resource, metric_readers=[metric_reader] if metric_reader else [])
    _state.update(
        started=True,
        generation=_state.get("generation", 0) + 1,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        tracer=tracer_provider.get_tracer(SCOPE),
        instruments=_instruments(meter_provider.get_meter(SCOPE), held_count=held_count),
        instrumentors=_instrument_libraries(tracer_provider, meter_provider),
    )
    return True


def telemetry_stop() -> None:
    """Undo `telemetry_start` (tests): the instrumentations removed, the providers shut."""
    if not _state.get("started"):
        return
    for instrumentor in _state["instrumentors"]:
        instrumentor.uninstrument()
    _state["tracer_provider"].shutdown()
    _state["meter_provider"].shutdown()
    generation = _state["generation"] + 1
    _state.clear()
    _state["generation"] = generation


def _instrument_libraries(tracer_provider, meter_provider) -> list:
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor

    done = []
    for instrumentor in (DjangoInstrumentor(), PsycopgInstrumentor(), SQLite3Instrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
            done.append(instrumentor)
    return done


def generation() -> int:
    """Changes whenever telemetry starts or stops: part of the SDK client cache's key."""
    return _state.get("generation", 0)


def sdk_option() -> dict | None:
    """The anthropic client's `open_telemetry` option: our tracer provider while on; None
    (the SDK's own default, the global provider, a no-op) while off."""
    return {"tracer_provider": _state["tracer_provider"]} if _state.get("started") else None


def _instruments(meter, *, held_count: Callable[[], int] | None) -> dict:
    from opentelemetry.metrics import Observation

    if held_count is not None:
        meter.create_observable_gauge(
            "paperclip.credentials.held",
            [lambda _options: [Observation(held_count())]],
            description="Credentials a provider's quota holds",
        )
    return {
        "runs": meter.create_counter("paperclip.runs", description="Heartbeat runs ended, by status"),
        "duration": meter.create_histogram("paperclip.run.duration", unit="s", description="Claim to end"),
        "queue_age": meter.create_histogram("paperclip.run.queue_age", unit="s", description="Queued to claimed"),
        "spend": meter.create_counter("paperclip.spend", unit="USD", description="Billed to the ledger"),
        "tokens": meter.create_counter("paperclip.tokens", unit="{token}", description="Tokens billed, by kind"),
    }


# Spans. Each helper is a no-op while telemetry is off.


def step(name: str, **attributes) -> contextlib.AbstractContextManager:
    """A span of one engine step, a child of the current one (the run's)."""
    if not _state.get("started"):
        return contextlib.nullcontext()
    return _span(name, attributes)


@contextlib.contextmanager
def _span(name: str, attributes: dict) -> Iterator[Any]:
    with _state["tracer"].start_as_current_span(name, attributes=_clean(attributes)) as span:
        yield span


def _clean(attributes: dict) -> dict:
    """`run_id=...` as `paperclip.run.id`; values a span can hold (ids as text); no None."""
    return {
        "paperclip." + (key[:-3] + ".id" if key.endswith("_id") else key): (
            value if isinstance(value, int | float | bool) else str(value)
        )
        for key, value in attributes.items()
        if value is not None
    }


def annotate(**attributes) -> None:
    """Attributes on the current span (the step or run being traced)."""
    if _state.get("started"):
        from opentelemetry import trace

        trace.get_current_span().set_attributes(_clean(attributes))


def traced_heartbeat(execute: Callable) -> Callable:
    """`heartbeat_execute`, as the trace of one heartbeat: the run's span, with the ids,
    status, error code, cost and tokens of the run it returns."""

    @functools.wraps(execute)
    def wrapper(*, run_id, now=None):
        if not _state.get("started"):
            return execute(run_id=run_id, now=now)
        with _span("heartbeat", {"run.id": run_id}) as span:
            run = execute(run_id=run_id, now=now)
            span.set_attributes(
                _clean(
                    {
                        "agent.id": run.agent_id,
                        "company.id": run.company_id,
                        "session.id": run.session_id,
                        "run.status": run.status,
                        "run.error_code": run.error_code or None,
                        "run.cost_usd": str(run.cost_usd) if run.cost_usd is not None else None,
                        "run.input_tokens": run.input_tokens,
                        "run.output_tokens": run.output_tokens,
                    }
                )
            )
        if run.is_finished and run.started_at is not None:
            record_run(
                status=run.status,
                duration_s=(run.finished_at - run.started_at).total_seconds() if run.finished_at else None,
                queue_age_s=(run.started_at - run.created_at).total_seconds(),
            )
        return run

    return wrapper


def traceparent() -> str | None:
    """The W3C trace context of the current span (for a Claude Code run), or None."""
    if not _state.get("started"):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


# Metrics.


def record_run(*, status: str, duration_s: float | None, queue_age_s: float | None) -> None:
    instruments = _state.get("instruments")
    if instruments is None:
        return
    instruments["runs"].add(1, {"status": status})
    if duration_s is not None:
        instruments["duration"].record(duration_s, {"status": status})
    if queue_age_s is not None:
        instruments["queue_age"].record(queue_age_s)


def record_bill(*, model: str, cost_usd, usage: dict) -> None:
    """One ledger row: its span (a child of the step that made the call) and its metrics."""
    instruments = _state.get("instruments")
    if instruments is None:
        return
    from costs_app.pricing import token_counts

    counts = token_counts(usage).__dict__
    with _span("bill", {"model": model, "cost_usd": str(cost_usd)}) as span:
        span.set_attributes({"gen_ai.request.model": model, **{f"gen_ai.usage.{k}": v for k, v in counts.items()}})
    instruments["spend"].add(float(cost_usd), {"model": model})
    for kind, tokens in counts.items():
        instruments["tokens"].add(tokens, {"model": model, "kind": kind})
