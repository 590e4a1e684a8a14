"""Riding out a Redis outage: the errors that mean "Redis is away", and waiting, bounded, until it answers again.

A killed, restarting (LOADING), frozen or reset Redis shows up in redis-py as ConnectionError (BusyLoadingError
is one) or TimeoutError, after redis-py's own few retries. The worker then waits here and resumes; it gives up
(and exits non-zero) only after `give_up_s` without an answer.
"""

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

REDIS_DOWN: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
T = TypeVar("T")


class RedisGone(RuntimeError):
    """Redis did not answer for longer than the worker is willing to wait."""


def wait_for_redis(connection: Redis, give_up_s: float, stopping: Callable[[], bool] = lambda: False) -> bool:
    """Block until Redis answers PING (True), or `stopping()` turns true (False). RedisGone after `give_up_s`."""
    deadline = time.monotonic() + give_up_s
    pause = 0.1
    while True:
        try:
            if connection.ping():
                return True
        except REDIS_DOWN as exc:
            if time.monotonic() + pause > deadline:
                raise RedisGone(f"Redis did not answer for {give_up_s:g} s: {exc}") from exc
        if stopping():
            return False
        time.sleep(pause)
        pause = min(2 * pause, 2.0)


def retrying(connection: Redis, give_up_s: float, call: Callable[[], T], what: str) -> T:
    """`call()`, again after each outage, until it returns: for writes that are idempotent (fenced, NX, max)."""
    while True:
        try:
            return call()
        except REDIS_DOWN as exc:
            log.warning("Redis is away during %s (%s); waiting for it", what, exc)
            wait_for_redis(connection, give_up_s)
