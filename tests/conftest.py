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
from support.stack import ApiProc, WorkerProc, api_env, worker_env
from tinkerq.config import QueueConfig


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Where the suite runs in several processes (pytest-xdist, `--dist loadgroup`): a module's tests stay in one
    process, so a module-scoped stack starts once; and the vLLM and Ray tests all run in one, one after another,
    since two engines or Ray clusters at once would only fight over the cores."""
    for item in items:
        parts = item.path.relative_to(Path(__file__).parent).parts
        group = "runtimes" if parts[0] == "runtimes" else "/".join(parts)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when given (the Makefile starts a private server), else a server of our own. Each process of a
    parallel run (pytest-xdist) has a server of its own: tests empty their database, and Redis's pub/sub reaches
    every database of a server."""
    if os.environ.get("REDIS_URL") and not os.environ.get("PYTEST_XDIST_WORKER"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis() as server:
        os.environ["REDIS_URL"] = server.url  # what the processes a test starts (a demo) find, as users' do
        yield server.url


@pytest.fixture
def r(redis_url: str) -> Redis:
    connection = Redis.from_url(redis_url)
    connection.flushdb()
    return connection


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


QUEUE = {"num_shards": 4, "lease_ttl_ms": 3000, "seq_gap_timeout_s": 2.0}


@pytest.fixture
def config() -> QueueConfig:
    return QueueConfig(**QUEUE)


@pytest.fixture
def start_api(redis_url: str, config: QueueConfig, tmp_path: Path):
    started: list[ApiProc] = []

    def start(*args: str, **env: str) -> ApiProc:
        proc = ApiProc(redis_url, {**api_env(config, tmp_path), **env}, args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill(signal.SIGTERM)


@pytest.fixture
def start_worker(redis_url: str, config: QueueConfig, tmp_path: Path):
    started: list[WorkerProc] = []

    def start(*args: str, **env: str) -> WorkerProc:
        proc = WorkerProc(redis_url, {**worker_env(config, tmp_path), **env}, list(args))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill(signal.SIGKILL)


@pytest.fixture(scope="module")
def module_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """start_worker and start_api for processes that serve every test of a module (starting a worker with a real
    model costs seconds): for tests that each keep to models of their own and need no fresh Redis. The database is
    emptied once, before the first starts; what was started is stopped after the module's last test."""
    Redis.from_url(redis_url).flushdb()
    config, root = QueueConfig(**QUEUE), tmp_path_factory.mktemp("module-stack")
    workers: list[WorkerProc] = []
    apis: list[ApiProc] = []

    def start_worker(*args: str, **env: str) -> WorkerProc:
        workers.append(WorkerProc(redis_url, {**worker_env(config, root), **env}, list(args)))
        return workers[-1]

    def start_api(*args: str, **env: str) -> ApiProc:
        apis.append(ApiProc(redis_url, {**api_env(config, root), **env}, args))
        return apis[-1]

    try:
        yield start_worker, start_api
    finally:
        try:
            for api in apis:
                api.kill(signal.SIGTERM)
        finally:
            for worker in workers:
                worker.kill(signal.SIGKILL)
