"""Fixtures for every folder (unit, e2e, runtimes): a real Redis for anything that crosses processes, fakeredis for
single-process units, and the `tinkerq` worker and API processes a test starts (tests/support/stack.py)."""

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
from redis import Redis

from commands.redis_server import EmbeddedRedis
from support.stack import ApiProc, WorkerProc
from tinkerq.config import QueueConfig


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when given (the Makefile starts a private server), else a server of our own."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def r(redis_url: str) -> Redis:
    connection = Redis.from_url(redis_url)
    connection.flushdb()
    return connection


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def config() -> QueueConfig:
    return QueueConfig(num_shards=4, lease_ttl_ms=3000, seq_gap_timeout_s=2.0)


@pytest.fixture
def start_api(redis_url: str, config: QueueConfig, tmp_path: Path):
    started: list[ApiProc] = []

    def start(*args: str, **env: str) -> ApiProc:
        base = {"TINKERQ_NUM_SHARDS": str(config.num_shards), "TINKERQ_CHECKPOINT_ROOT": str(tmp_path)}
        proc = ApiProc(redis_url, {**base, **env}, args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill(signal.SIGTERM)


@pytest.fixture
def start_worker(redis_url: str, config: QueueConfig, tmp_path: Path):
    started: list[WorkerProc] = []

    def start(*args: str, **env: str) -> WorkerProc:
        base = {
            "TINKERQ_RUNTIME": "reference",  # the tests' stand-in model unless a test asks for a real one
            "TINKERQ_NUM_SHARDS": str(config.num_shards),
            "TINKERQ_LEASE_TTL_MS": str(config.lease_ttl_ms),
            "TINKERQ_SEQ_GAP_TIMEOUT_S": str(config.seq_gap_timeout_s),
            "TINKERQ_CHECKPOINT_ROOT": str(tmp_path),
        }
        proc = WorkerProc(redis_url, {**base, **env}, list(args))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill(signal.SIGKILL)
