"""The FastAPI application: Tinker's HTTP protocol on top of the producer library."""

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from producer.api import handlers
from producer.api.body_limit import BodySizeLimit
from producer.api.deps import Deps
from producer.api.long_poll import AsyncResultWaiter
from producer.api.metrics import Metrics, ObserveLatency
from producer.api.routes import ROUTERS
from producer.api.settings import ApiSettings
from producer.api.state import ApiState
from producer.api.stop_signal import on_stop_signal
from producer.api.submitter import GroupSubmitter
from producer.enqueue import Producer
from tinkerq.catalog import BaseModelCatalog
from tinkerq.config import QueueConfig

log = logging.getLogger("tinkerq.api")
SHUTDOWN_STEP_S = 2.0


def create_app(redis_url: str, settings: ApiSettings | None = None, config: QueueConfig | None = None,
               catalog: BaseModelCatalog | None = None) -> FastAPI:
    settings = settings or ApiSettings()
    config = config or QueueConfig()
    # bounded as a worker's are: against a frozen Redis a request fails instead of hanging
    producer = Producer(Redis.from_url(redis_url, **config.redis_timeouts()), config)
    async_redis = AsyncRedis.from_url(redis_url, **config.redis_timeouts())
    deps = Deps(settings, producer, ApiState(async_redis, settings.session_ttl_s), AsyncResultWaiter(async_redis),
                Metrics(producer.queue_depths), GroupSubmitter(producer), catalog or BaseModelCatalog.from_env())
    if not settings.keys():
        log.warning("TINKERQ_API_KEYS is unset: API key auth is OFF; anyone who reaches this port can use it")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await deps.waiter.start()
        with on_stop_signal(deps.waiter.release):  # uvicorn runs the shutdown below only once requests are done
            yield
        await _bounded(deps.waiter.stop(), "the result listener")
        await _bounded(asyncio.to_thread(producer.close), "the producer")
        await _bounded(async_redis.aclose(), "the Redis client")

    app = FastAPI(title="tinkerq", summary="Tinker-compatible API over a Redis/RQ job queue", lifespan=lifespan)
    app.state.deps = deps
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ObserveLatency, histogram=deps.metrics.latency)
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


async def _bounded(step: Awaitable[object], what: str) -> None:
    """Shutdown never waits on Redis for long: a frozen or unreachable server must not hold SIGTERM up."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except TimeoutError:
        log.warning("shutdown: %s did not stop within %.0f s; going on", what, SHUTDOWN_STEP_S)
    except Exception as exc:  # noqa: BLE001 - a failing close must not stop the others
        log.warning("shutdown: closing %s failed: %s", what, exc)


def app_from_env() -> FastAPI:
    """The app of one `tinkerq api` process: REDIS_URL and TINKERQ_* settings from the environment."""
    return create_app(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
