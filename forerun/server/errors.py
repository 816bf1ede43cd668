"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every failure the server answers.

Every path that can reject a request raises `APIError`; the handlers installed by `install_handlers` turn it,
FastAPI's own validation and HTTP errors, and anything unexpected into that shape, so a client never sees a
422, an HTML page or a traceback.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("forerun.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An answer other than 200: status, one-line message, the offending parameter and a machine code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def finite(x: float) -> float:
    """JSON has no -inf/NaN: a -inf logprob (a token the sampling transform ruled out) is sent as -9999.0."""
    if math.isnan(x):
        return -9999.0
    return max(-9999.0, min(9999.0, x)) if math.isinf(x) else x


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def _union_member(part: Any) -> bool:
    """pydantic puts the union member it tried into the location ('str', 'list[int]', ...): not a field name."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "function-after", "dict", "list")
                                      or "[" in part or part.endswith("Part") or part.startswith("json-or-python"))


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first problem of a pydantic error as one line; the parameter path in `param` (e.g. messages.0.role)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    locs = [[p for p in x.get("loc", ()) if p != "body" and not _union_member(p)] for x in errors]
    loc = locs[0]
    param = ".".join(str(p) for p in loc) or None
    kind, msg = err.get("type", ""), err.get("msg", "invalid value")
    if kind == "json_invalid":
        detail = msg.removeprefix("Invalid JSON: ")
        return bad_request(f"the body is not valid JSON ({detail})", None, "invalid_json")
    if not loc and (kind in ("model_type", "model_attributes_type") or kind.endswith("_type")):
        return bad_request("the body must be a JSON object", None, "invalid_body")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"missing required parameter: {param}", param, "missing_parameter")
    if len(errors) > 1:  # every member of a union failed: name the field they share, not one member's part
        common = []
        for parts in zip(*locs):
            if len(set(map(str, parts))) != 1:
                break
            common.append(parts[0])
        if common:
            param = ".".join(str(p) for p in common)
            return bad_request(f"{param}: invalid type or value ({msg})", param, "invalid_type")
    return bad_request(f"{param}: {msg}" if param else msg, param,
                       "invalid_type" if kind.endswith("_type") else "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> Response:
        return from_validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        message = {404: "not found", 405: "method not allowed"}.get(e.status_code, str(e.detail))
        return APIError(e.status_code, message, None, None, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        log.exception("internal error")  # the traceback goes to the server log, never to the client
        return APIError(500, f"internal server error ({type(e).__name__})", None, "internal_error").response()
