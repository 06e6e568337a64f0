"""`claude-code`: the Messages API through the official `anthropic` SDK.

The SDK reads ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL itself and retries 408/409/429/5xx
with backoff (honouring retry-after); we only choose how many times and how long.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from paperclip import telemetry
from sessions_app.adapters.base import (
    Adapter,
    AdapterError,
    AdapterReply,
    AdapterRequest,
    BatchListing,
    BatchResult,
    ListedBatch,
    is_int,
    is_number,
    usage_error,
    validate_model,
    validate_timeout,
)
from sessions_app.adapters.claude_cli import RUNTIME as CLI_RUNTIME
from sessions_app.adapters.claude_cli import ClaudeCliAdapter
from sessions_app.adapters.rate_limits import LAST_HEADROOM, QuotaMiddleware, api_credential, api_refusal
from sessions_app.adapters.tool_config import (
    CONTEXT_MANAGEMENT_BETA,
    TOOL_CONFIG_KEYS,
    clear_tool_uses_edit,
    validate_tool_config,
)

DEFAULT_MAX_TOKENS = 4096
DEFAULT_TIMEOUT_SECONDS = 600
DEFAULT_MAX_RETRIES = 2
# `inference_geo`: where the model runs ("global", the default, or "us"; the API may add more).
INFERENCE_GEO = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# The SDK waits as long as a retry-after header asks; the API asks for seconds, not
# minutes. A run's deadline allows this much between two attempts.
RETRY_WAIT_SECONDS = 60

if TYPE_CHECKING:
    import anthropic


def sdk():
    """The `anthropic` package, imported at the first call rather than at start-up: it is most
    of what a web or cluster process would import before it can answer (bench/RESULTS.md,
    "Restart")."""
    import anthropic

    return anthropic


@functools.lru_cache(maxsize=32)
def _client(
    base_url: str, api_key: str, timeout: float, max_retries: int, telemetry_generation: int
) -> anthropic.Anthropic:
    # One client per configuration and process: it owns a connection pool, so reusing it
    # saves a TLS handshake per heartbeat. The environment values are part of the key so a
    # changed ANTHROPIC_BASE_URL or key takes effect without a restart.
    return sdk().Anthropic(
        api_key=api_key or None,
        base_url=base_url or None,
        timeout=timeout,
        max_retries=max_retries,
        middleware=[QuotaMiddleware()],
        # While tracing is on, the SDK's span of each call goes to our tracer provider, as a
        # child of the engine's `call` step (paperclip/telemetry.py).
        open_telemetry=telemetry.sdk_option(),
    )


def client_for(config: dict) -> anthropic.Anthropic:
    try:
        return _client(
            os.environ.get("ANTHROPIC_BASE_URL", ""),
            os.environ.get("ANTHROPIC_API_KEY", ""),
            float(config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)),
            int(config.get("max_retries", DEFAULT_MAX_RETRIES)),
            telemetry.generation(),
        )
    except sdk().AnthropicError as exc:
        # Typically no API key configured. The message never contains the key itself.
        raise AdapterError("adapter_not_configured", f"Anthropic client could not be created: {exc}") from None


def error_from_sdk(exc: Exception) -> AdapterError:
    """Map an SDK exception to a stable error code; messages never carry credentials."""
    anthropic = sdk()
    if isinstance(exc, anthropic.APITimeoutError):
        return AdapterError("model_timeout", "The Messages API did not answer in time.", retryable=True)
    if isinstance(exc, anthropic.APIConnectionError):
        return AdapterError("model_unreachable", "Could not reach the Messages API.", retryable=True)
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        code = {
            400: "model_bad_request",
            401: "model_auth_failed",
            403: "model_forbidden",
            404: "model_not_found",
            413: "model_request_too_large",
            429: "model_rate_limited",
            529: "model_overloaded",
        }.get(status, "model_server_error" if status >= 500 else "model_error")
        detail = ""
        body = exc.body if isinstance(exc.body, dict) else None
        if body and isinstance(body.get("error"), dict):
            detail = str(body["error"].get("message", ""))[:500]
        refusal = api_refusal(status=status, headers=exc.response.headers, message=detail, now=datetime.now(UTC))
        if refusal is not None:
            return refusal
        message = f"Messages API answered {status}" + (f": {detail}" if detail else "")
        return AdapterError(code, message, retryable=status == 429 or status >= 500)
    if isinstance(exc, anthropic.APIResponseValidationError):
        return AdapterError("model_malformed_response", "The Messages API answered with an unexpected body.")
    return AdapterError("model_error", f"{exc.__class__.__name__}: {str(exc)[:500]}")


def missing_credentials(exc: TypeError) -> Exception:
    # The SDK raises TypeError when it has no credentials to build the request with.
    if "authentication" in str(exc):
        return AdapterError(
            "adapter_not_configured",
            "No Anthropic credentials: set ANTHROPIC_API_KEY in the environment of the web and worker processes.",
        )
    return exc


COMPACTION_BETA = "compact-2026-01-12"


def compaction_edit(config: dict) -> dict:
    edit: dict[str, Any] = {"type": "compact_20260112"}
    if config.get("compaction_trigger_tokens"):
        edit["trigger"] = {"type": "input_tokens", "value": int(config["compaction_trigger_tokens"])}
    return edit


CLI_ADAPTER = ClaudeCliAdapter()


def beta_features(request: AdapterRequest) -> tuple[list[str], list[dict]]:
    """The beta headers and context edits a request needs: server compaction, the tools of
    the tool loop (the memory tool is a context-management beta) and clearing old tool
    results. None of them: the plain Messages API."""
    betas: list[str] = []
    edits: list[dict] = []
    # Only requests that offer tools clear tool uses: a summary or handoff request has none.
    clearing = clear_tool_uses_edit(request.config) if request.tools else None
    if request.tools:
        betas.append(CONTEXT_MANAGEMENT_BETA)
    if clearing:
        edits.append(clearing)
    if request.config.get("context_strategy") == "server":
        betas.append(COMPACTION_BETA)
        edits.append(compaction_edit(request.config))
    return betas, edits


def context_management_of(message) -> dict | None:
    """What context editing did to the request (`applied_edits`), as the API reported it."""
    found = getattr(message, "context_management", None)
    if found is None:
        return None
    return found.model_dump(mode="json", exclude_none=True) if hasattr(found, "model_dump") else dict(found)


# The most batches one list request returns (the API's bound).
BATCH_LIST_PAGE = 1000


def listed_batch(batch) -> ListedBatch:
    counts = batch.request_counts
    requests = counts.processing + counts.succeeded + counts.errored + counts.canceled + counts.expired
    return ListedBatch(batch.id, batch.created_at, batch.processing_status == "ended", requests)


def batch_result(result) -> BatchResult:
    """One line of a batch's results, as the engine keeps it."""
    if result.type == "succeeded":
        return BatchResult("succeeded", message=result.message.model_dump(mode="json", exclude_none=True))
    error = getattr(getattr(result, "error", None), "error", None)
    return BatchResult(result.type, error=str(getattr(error, "message", "") or "")[:500])


class ClaudeCodeAdapter(Adapter):
    type_name = "claude-code"
    counts_tokens = True  # the API's free count_tokens endpoint
    delivers_batch = True  # the Message Batches API, at half of every rate
    config_keys = {
        "runtime",
        "model",
        "max_tokens",
        "temperature",
        "timeout_seconds",
        "max_retries",
        "prompt_caching",
        "cache_ttl",
        "compaction_trigger_tokens",
        "inference_geo",
    } | TOOL_CONFIG_KEYS

    def for_config(self, config: dict):
        """`runtime: "cli"` is Claude Code itself (`claude_cli`); the default, `"api"`, this
        adapter: one Messages API call per heartbeat."""
        return CLI_ADAPTER if config.get("runtime") == CLI_RUNTIME else self

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        clean: dict[str, Any] = {}
        if "runtime" in config:
            if config["runtime"] != "api":
                errors["runtime"] = f"must be 'api' or 'cli', got {config['runtime']!r}"
            clean["runtime"] = config["runtime"]
        validate_model(config, errors, clean)
        max_tokens = config.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not is_int(max_tokens) or not 1 <= max_tokens <= 128_000:
            errors["max_tokens"] = f"must be a whole number in 1..128000, got {max_tokens!r}"
        clean["max_tokens"] = max_tokens
        if "temperature" in config:
            temperature = config["temperature"]
            if temperature is not None and (not is_number(temperature) or not 0 <= temperature <= 1):
                errors["temperature"] = f"must be a number in 0..1 or null, got {temperature!r}"
            clean["temperature"] = temperature
        validate_timeout(config, errors, clean, default=DEFAULT_TIMEOUT_SECONDS)
        retries = config.get("max_retries", DEFAULT_MAX_RETRIES)
        if not is_int(retries) or not 0 <= retries <= 10:
            errors["max_retries"] = f"must be a whole number in 0..10, got {retries!r}"
        clean["max_retries"] = retries
        # Left out when not given: the engine then chooses from how often the agent wakes
        # (`sessions_app.context_defaults`), which it could not tell from a stored default.
        if "prompt_caching" in config:
            caching = config["prompt_caching"]
            if not isinstance(caching, bool):
                errors["prompt_caching"] = f"must be true or false, got {caching!r}"
            clean["prompt_caching"] = caching
        if "cache_ttl" in config:
            cache_ttl = config["cache_ttl"]
            if cache_ttl not in ("5m", "1h"):
                errors["cache_ttl"] = f"must be '5m' or '1h', got {cache_ttl!r}"
            clean["cache_ttl"] = cache_ttl
        if "compaction_trigger_tokens" in config:
            trigger = config["compaction_trigger_tokens"]
            if trigger is not None and (not is_int(trigger) or not 50_000 <= trigger <= 2_000_000):
                errors["compaction_trigger_tokens"] = f"must be a whole number of at least 50000, got {trigger!r}"
            clean["compaction_trigger_tokens"] = trigger
        if "inference_geo" in config:
            geo = config["inference_geo"]
            if geo is not None and (not isinstance(geo, str) or not INFERENCE_GEO.fullmatch(geo)):
                errors["inference_geo"] = f"must be a geo such as 'us' or 'global', or null, got {geo!r}"
            clean["inference_geo"] = geo
        clean.update(validate_tool_config(config, errors))
        return clean

    def credential(self, config: dict) -> str | None:
        return api_credential()

    def call_seconds(self, config: dict) -> float:
        timeout = float(config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        retries = int(config.get("max_retries", DEFAULT_MAX_RETRIES))
        return timeout * (retries + 1) + retries * RETRY_WAIT_SECONDS

    def params(self, request: AdapterRequest) -> tuple[dict[str, Any], list[str]]:
        """The Messages API parameters of a request, and the betas it needs."""
        extra_body: dict[str, Any] = {}
        if request.config.get("temperature") is not None:
            extra_body["temperature"] = request.config["temperature"]
        kwargs: dict[str, Any] = {
            "model": request.model,
            "max_tokens": int(request.config.get("max_tokens", DEFAULT_MAX_TOKENS)),
            "messages": request.messages,
        }
        if request.system_blocks or request.system:
            kwargs["system"] = request.system_blocks or request.system
        if request.max_tokens:
            kwargs["max_tokens"] = request.max_tokens
        if extra_body:
            kwargs["extra_body"] = extra_body
        if request.config.get("inference_geo"):
            # Where the model runs (the API's `inference_geo`); priced with its factor.
            kwargs["inference_geo"] = request.config["inference_geo"]
        betas, edits = beta_features(request)
        if betas:
            if request.tools:
                kwargs["tools"] = request.tools
            if edits:
                kwargs["context_management"] = {"edits": edits}
        return kwargs, betas

    def call(self, request: AdapterRequest) -> AdapterReply:
        client = client_for(request.config)
        kwargs, betas = self.params(request)
        LAST_HEADROOM.set(None)
        try:
            if betas:
                message = client.beta.messages.create(**kwargs, betas=betas)
            else:
                message = client.messages.create(**kwargs)
        except sdk().AnthropicError as exc:
            raise error_from_sdk(exc) from None
        except TypeError as exc:
            raise missing_credentials(exc) from None
        except ValueError as exc:  # a body that is not JSON at all
            raise AdapterError(
                "model_malformed_response", f"The Messages API answered with invalid JSON: {exc}"
            ) from None
        return self._reply(request, message, headroom=LAST_HEADROOM.get())

    def _reply(self, request: AdapterRequest, message, *, headroom=None) -> AdapterReply:
        content = [block.model_dump(mode="json", exclude_none=True) for block in (message.content or [])]
        text = "".join(block.get("text", "") for block in content if block.get("type") == "text")
        usage = message.usage.model_dump(mode="json", exclude_none=True) if message.usage is not None else None
        if problem := usage_error(usage):
            raise AdapterError("model_malformed_response", f"The Messages API reported an impossible usage: {problem}")
        return AdapterReply(
            text=text,
            content=content,
            model=message.model or request.model,
            requested_model=request.model,
            message_id=message.id or "",
            stop_reason=message.stop_reason or "",
            usage=usage,
            context_management=context_management_of(message),
            headroom=headroom,
        )

    # Message Batches (`sessions_app.batches`): the plain Messages API's requests only.

    def batch_params(self, request: AdapterRequest) -> dict | None:
        kwargs, betas = self.params(request)
        if betas:
            return None  # tools and context edits are betas: sent direct
        params = {key: value for key, value in kwargs.items() if key != "extra_body"}
        return {**params, **kwargs.get("extra_body", {})}

    def batch_send(self, config: dict, entries: list[tuple[str, dict]]) -> str:
        requests = [{"custom_id": custom_id, "params": params} for custom_id, params in entries]
        # Never retried by the SDK: a create whose answer was lost may have made its batch,
        # and a second create would have every request answered, and charged, twice.
        return self._batch_call(
            lambda client: client.with_options(max_retries=0).messages.batches.create(requests=requests), config
        ).id

    def batch_read(self, config: dict, batch_id: str) -> dict[str, BatchResult] | None:
        def read(client):
            if client.messages.batches.retrieve(batch_id).processing_status != "ended":
                return None
            return {line.custom_id: batch_result(line.result) for line in client.messages.batches.results(batch_id)}

        return self._batch_call(read, config)

    def batch_cancel(self, config: dict, batch_id: str) -> None:
        self._batch_call(lambda client: client.messages.batches.cancel(batch_id), config)

    def batch_reply(self, request: AdapterRequest, message: dict) -> AdapterReply:
        return self._reply(request, sdk().types.Message.model_validate(message))

    def batch_list(self, config: dict, *, since: datetime, pages: int) -> BatchListing:
        def listing(client):
            found: list[ListedBatch] = []
            page = client.messages.batches.list(limit=BATCH_LIST_PAGE)
            for read in range(1, pages + 1):
                for batch in page.data:
                    if batch.created_at < since:  # newest first: the rest are older still
                        return BatchListing(found, complete=True)
                    found.append(listed_batch(batch))
                if not page.has_next_page():
                    return BatchListing(found, complete=True)
                if read < pages:
                    page = page.get_next_page()
            return BatchListing(found, complete=False)

        return self._batch_call(listing, config)

    def batch_custom_ids(self, config: dict, batch_id: str) -> Iterator[str]:
        lines = self._batch_call(lambda client: client.messages.batches.results(batch_id), config)
        try:
            for line in lines:
                yield line.custom_id
        except sdk().AnthropicError as exc:
            raise error_from_sdk(exc) from None
        finally:
            lines.close()  # a caller that stops early leaves the rest of the stream unread

    def _batch_call(self, action, config: dict):
        try:
            return action(client_for(config))
        except sdk().AnthropicError as exc:
            raise error_from_sdk(exc) from None
        except TypeError as exc:
            raise missing_credentials(exc) from None

    def count_tokens(self, request: AdapterRequest) -> int:
        """Exact input size of a request, from the API's free count_tokens endpoint."""
        client = client_for(request.config)
        kwargs: dict[str, Any] = {"model": request.model, "messages": request.messages}
        if request.system_blocks or request.system:
            kwargs["system"] = request.system_blocks or request.system
        try:
            if request.tools:
                # The tools' definitions (and the memory tool's own instructions) are input too.
                counted = client.beta.messages.count_tokens(
                    **kwargs, tools=request.tools, betas=[CONTEXT_MANAGEMENT_BETA]
                )
                return counted.input_tokens
            return client.messages.count_tokens(**kwargs).input_tokens
        except sdk().AnthropicError as exc:
            raise error_from_sdk(exc) from None
        except TypeError as exc:
            raise missing_credentials(exc) from None
