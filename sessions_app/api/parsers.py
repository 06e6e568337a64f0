"""The API's only request parser: JSON, bounded in size, free of what PostgreSQL refuses."""

from __future__ import annotations

import json
import math

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser
from rest_framework.utils.json import strict_constant

from sessions_app.api.exceptions import BadRequest, payload_too_large

MAX_DEPTH = 64


def check_text(value: str, where: str) -> None:
    # PostgreSQL stores neither NUL in text columns nor \u0000 in jsonb; a lone surrogate
    # ("\ud800") is not encodable as UTF-8 at all. Either would reach the database as an
    # error deep inside a save, so both are refused here, naming where they were found.
    if "\x00" in value:
        raise BadRequest(f"NUL characters are not allowed ({where}).", code="nul_character", fields={where: "NUL"})
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            f"Text must be valid Unicode ({where}).", code="invalid_unicode", fields={where: "invalid Unicode"}
        ) from None


def check_json_value(value: object, where: str = "body", depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise BadRequest(f"JSON nested deeper than {MAX_DEPTH} levels.", code="too_deep")
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key if where == "body" else f"{where}.{key}"
            check_text(key, name)
            check_json_value(item, name, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_value(item, f"{where}.{index}", depth + 1)


def finite_float(literal: str) -> float:
    """A JSON number with a fraction or exponent, as a float, refused when no float holds it.

    Python reads `1e400` as infinity, which no JSON column stores, and `1e-400` as 0.0, which
    would turn a tiny money limit into a zero one; both are refused, naming the number."""
    value = float(literal)
    mantissa = literal.lower().partition("e")[0]
    if math.isinf(value) or (value == 0 and any(digit in mantissa for digit in "123456789")):
        raise BadRequest(
            f"The JSON number {literal[:40]} is out of range: it has no value as a double-precision "
            'number (send an amount as a decimal string, such as "0.000001").',
            code="number_out_of_range",
        )
    return value


def json_kind(value: object) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, (int, float)):
        return "a JSON number"
    return "null"


class StrictJSONParser(JSONParser):
    """A JSON object with a body limit (413), no NaN/Infinity (nor a number that reads as one),
    no NUL, valid Unicode only.

    DRF reads the request stream itself, bypassing Django's DATA_UPLOAD_MAX_MEMORY_SIZE
    check on `request.body`, so the limit is enforced here: by Content-Length up front, and
    by reading at most one byte more than the limit when the length is not declared.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        try:
            if declared and int(declared) > limit:
                raise payload_too_large()
        except ValueError:
            raise BadRequest("Content-Length is not a number.") from None
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise payload_too_large()
        try:
            text = raw.decode("utf-8")
            data = json.loads(text, parse_constant=strict_constant, parse_float=finite_float)
        except UnicodeDecodeError:
            raise ParseError("The request body is not UTF-8.") from None
        except RecursionError:
            raise BadRequest(f"JSON nested deeper than {MAX_DEPTH} levels.", code="too_deep") from None
        except ValueError as exc:
            raise ParseError(f"Malformed JSON: {exc}") from None
        check_json_value(data)
        if not isinstance(data, dict):
            # Every body of this API is an object; DRF would answer "non_field_errors".
            raise BadRequest(
                f'The request body is {json_kind(data)}: expected a JSON object ({{"name": value, ...}}).',
                code="expected_json_object",
            )
        return data
