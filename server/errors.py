"""Errors as the OpenAI API spells them: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app turns it (and Starlette's own HTTP errors, and anything
unexpected) into that body with the right status, so a client library parses every failure.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("radixkv.server")


class APIError(Exception):
    """A request that fails with `status`; `param` names the offending field when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes)",
        type="invalid_request_error",
        code="request_too_large",
    )


def engine_unavailable(reason: str) -> APIError:
    return APIError(
        503, f"the engine is not serving: {reason}", type="server_error",
        code="engine_unavailable",
    )


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """A pydantic failure as a 400; `param` is the top-level field it concerns."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=error_type).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {exc}", type="server_error").response()
