"""Request bodies decoded and validated in short slices, off the event loop.

Decoding runs in a worker thread, but a C call holds the GIL from start to end: one
``model_validate_json`` of a 4096-instance body (1.5 MB) is a single 50-80 ms call during which
the event loop cannot answer even ``/healthz``. So a body is decoded value by value here (each
element of a top-level list is its own short ``json`` call) and validated a slice of elements at
a time; between slices the interpreter lets the event loop run.

The result is the same as pydantic's own parser: bodies that are not a plain, well-formed JSON
object (NaN, ``\\ud800``-style escapes, duplicate keys, anything malformed) fall back to
``model_validate_json`` whole, which reports the error exactly as before; the validators are the
same pydantic schemas, and error locations are those of the whole body.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

from api.schemas import MAX_FIELDS, Instance, PredictRequest
from api.v2.protocol import InferInput, InferRequest

SLICE = 256
"""Instances validated per call (about 2 ms each): the longest the event loop waits for the GIL."""

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_INSTANCES = TypeAdapter(list[Instance])
_INPUT = TypeAdapter(InferInput)


class _Fallback(Exception):
    """The body is not one this decoder takes: let pydantic's parser have it whole."""


def _reject_constant(name: str) -> Any:
    raise _Fallback(name)  # NaN, Infinity: not JSON; pydantic says so


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _skip(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _list(text: str, i: int) -> tuple[list, int]:
    """The list starting at ``text[i] == "["``, one element per decoder call."""
    out: list = []
    i = _skip(text, i + 1)
    if text[i] == "]":
        return out, i + 1
    while True:
        value, i = _DECODER.raw_decode(text, i)
        out.append(value)
        i = _skip(text, i)
        if text[i] == "]":
            return out, i + 1
        if text[i] != ",":
            raise _Fallback("list")
        i = _skip(text, i + 1)


def _object(text: str) -> dict[str, Any]:
    i = _skip(text, 0)
    if text[i] != "{":
        raise _Fallback("not an object")
    out: dict[str, Any] = {}
    i = _skip(text, i + 1)
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        if not isinstance(key, str) or key in out:
            raise _Fallback("key")
        i = _skip(text, i)
        if text[i] != ":":
            raise _Fallback("colon")
        i = _skip(text, i + 1)
        out[key], i = _list(text, i) if text[i] == "[" else _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if text[i] == ",":
            i = _skip(text, i + 1)
        elif text[i] != "}":
            raise _Fallback("comma")
    if _skip(text, i + 1) != len(text):
        raise _Fallback("trailing data")
    return out


def decode_object(body: bytes) -> dict[str, Any] | None:
    """A JSON object, its top-level lists decoded element by element; None where the body is
    anything else (the caller then validates it whole, which reports the error)."""
    try:
        text = body.decode("utf-8")
        if _SURROGATE.search(text):
            return None
        return _object(text)
    except (_Fallback, ValueError, IndexError, RecursionError):
        return None


def _whole(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None


def _invalid(exc: ValidationError, prefix: tuple) -> RequestValidationError:
    """``exc`` with its error locations made relative to the whole body."""
    errors = exc.errors(include_url=False, include_input=False)
    return RequestValidationError([{**e, "loc": (*prefix, *e["loc"])} for e in errors])


def predict_request(body: bytes) -> PredictRequest:
    """A V1 predict body, validated ``SLICE`` instances at a time.

    Raises:
        RequestValidationError: the body is not a valid request (locations as pydantic's).
    """
    data = decode_object(body)
    items = data.get("instances") if data is not None and len(data) == 1 else None
    if not isinstance(items, list) or not items:
        return _whole(PredictRequest, body)
    validated: list = []
    for lo in range(0, len(items), SLICE):
        try:
            validated += _INSTANCES.validate_python(items[lo : lo + SLICE])
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            raise RequestValidationError(
                [{**e, "loc": ("instances", lo + e["loc"][0], *e["loc"][1:])} for e in errors]
            ) from None
    return PredictRequest.model_construct(instances=validated)


def infer_request(head: bytes) -> InferRequest:
    """An Open Inference Protocol request's JSON, validated one input tensor at a time."""
    data = decode_object(head)
    inputs = data.get("inputs") if data is not None else None
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_FIELDS:
        return _whole(InferRequest, head)
    tensors = []
    for k, item in enumerate(inputs):
        try:
            tensors.append(_INPUT.validate_python(item))
        except ValidationError as exc:
            raise _invalid(exc, ("inputs", k)) from None
    try:
        return InferRequest.model_validate({**data, "inputs": tensors})
    except ValidationError as exc:
        raise _invalid(exc, ()) from None
