"""Health, metrics, the SDK's start-up handshake, telemetry and server capabilities."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from producer.api.deps import Authorized, DepsParam
from producer.api.http_errors import error_response

public = APIRouter(prefix="/api/v1")
router = APIRouter(prefix="/api/v1", dependencies=Authorized)


@public.get("/healthz", response_model=None)
async def healthz(deps: DepsParam) -> dict | JSONResponse:
    """Healthy means able to serve: the queue's Redis answers (within a second)."""
    try:
        await asyncio.wait_for(deps.state.redis.ping(), 1.0)
    except (TimeoutError, RedisError, OSError) as exc:
        return error_response(503, f"the job queue's Redis does not answer ({type(exc).__name__})",
                              "queue_unavailable", {"retry-after": "1"})
    return {"status": "ok"}


@public.get("/metrics", include_in_schema=False, response_class=Response)
async def metrics(deps: DepsParam) -> Response:
    body = await asyncio.to_thread(generate_latest, deps.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/client/config")
async def client_config(deps: DepsParam) -> dict:
    # custom_loss_server_side: create_custom_loss uploads the traced graph, forward_backward_custom runs it here
    return {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": deps.settings.fwdbwd_max_chunk_len,
            "custom_loss_server_side": True}


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return {}


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(deps: DepsParam) -> dict:
    return {"supported_models": [deps.catalog.describe(name) for name in deps.catalog.names]}
