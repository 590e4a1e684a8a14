"""Exception handlers: every failure the API answers is a JSON body with a message (the SDK retries an empty
400 as a proxy glitch), and none is a plain-text 500."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from producer.api import proto
from producer.api.http_errors import ApiError, error_response, rejected_response
from producer.errors import Rejected

log = logging.getLogger("tinkerq.api")


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code)


async def bad_proto(request: Request, exc: proto.BadProto) -> JSONResponse:
    return error_response(400, str(exc), "invalid_request")


async def rejected(request: Request, exc: Rejected) -> JSONResponse:
    return rejected_response(exc)


async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
    # Nothing was enqueued (or it was, and a retry with the same ids finds it): the SDK retries 503s.
    log.warning("Redis unavailable: %s", exc)
    return error_response(503, f"the job queue's Redis is unavailable ({type(exc).__name__}); retry later",
                          "queue_unavailable", {"retry-after": "1"})


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return error_response(422, f"invalid request body: {problems}", "invalid_request")


async def invalid_request(request: Request, exc: ValidationError) -> JSONResponse:
    """A well-formed body that the queue's request schemas refuse (an Adam beta of 2, no LoRA target...)."""
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
    return error_response(400, f"invalid request: {problems}", "invalid_request")


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own 404 / 405 (unknown route or method) in this API's error body."""
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path} on this server"
        return error_response(404, message, "unknown_route")
    if exc.status_code == 405:
        return error_response(405, f"{request.url.path} does not take {request.method}", "method_not_allowed")
    return error_response(exc.status_code, str(exc.detail), "http_error", dict(exc.headers or {}))


def install(app: FastAPI) -> None:
    handlers = {ApiError: api_error, proto.BadProto: bad_proto, Rejected: rejected, RedisError: redis_down,
                RequestValidationError: invalid_body, ValidationError: invalid_request, HTTPException: http_error}
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
