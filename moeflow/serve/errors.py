"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the app's handlers for them.

Every failure of one request answers that request and nothing else: a malformed body, a bad parameter or an
engine that is full never reaches the engine thread or another client's stream.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeflow.engine.continuous import EngineOverloaded
from moeflow.errors import InputError
from moeflow.serve.protocol import Unsupported

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(Unsupported)
    async def _unsupported(request: Request, exc: Unsupported) -> JSONResponse:
        return error_response(400, str(exc), exc.param, "unsupported_parameter")

    @app.exception_handler(InputError)
    async def _input(request: Request, exc: InputError) -> JSONResponse:
        code = "context_length_exceeded" if "exceeds the context" in str(exc) else "invalid_value"
        return error_response(400, str(exc), None, code)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, exc: EngineOverloaded) -> JSONResponse:
        return error_response(503, str(exc), None, "overloaded")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, None)
