"""Fixtures: a real Redis for anything that crosses processes, fakeredis for single-process units."""

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
from redis import Redis

from commands.processes import TinkerqProc
from commands.redis_server import EmbeddedRedis
from tinkerq.config import QueueConfig, RuntimeConfig
from worker.main import WorkerProcess
from worker.runtime.registry import build_runtime

ROOT = Path(__file__).resolve().parent.parent


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


def burst_worker(connection: Redis, config: QueueConfig, tmp_path: Path, **runtime: object) -> WorkerProcess:
    """An in-process worker over every shard, for draining queues in a test (run with burst=True); the reference
    runtime unless the test asks for another."""
    runtime.setdefault("runtime", "reference")
    rt = build_runtime(RuntimeConfig(checkpoint_root=str(tmp_path / "ckpt"), **runtime))
    return WorkerProcess(connection, rt, config)


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def log_dir(env: dict[str, str]) -> Path:
    return Path(env.get("TINKERQ_CHECKPOINT_ROOT", "/tmp"))


class WorkerProc(TinkerqProc):
    """A `tinkerq worker` in its own process, as users run it; its log beside its checkpoints."""

    def __init__(self, redis_url: str, env: dict[str, str], args: list[str] = ()) -> None:
        super().__init__(["worker", "--redis-url", redis_url, "--log-level", "WARNING", *args], env, log_dir(env),
                         python_path=[str(ROOT / "tests")])


class ApiProc(TinkerqProc):
    """`tinkerq api` on a free port, as users run it."""

    def __init__(self, redis_url: str, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        from commands.redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["api", "--redis-url", redis_url, "--port", str(self.port), "--log-level", "warning", *args],
                         env, log_dir(env))
        import urllib.request

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=1).read()
                return
            except OSError:
                if not self.alive():
                    raise RuntimeError(f"the API exited: {self.output()}") from None
                time.sleep(0.1)
        self.kill(signal.SIGTERM)  # no fixture holds it yet: left running, it would outlive the test session
        raise RuntimeError(f"the API did not come up: {self.output()}")


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
