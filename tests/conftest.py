"""Fixtures: a real Redis for anything that crosses processes, fakeredis for single-process units."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
from redis import Redis

from tinkerq.config import QueueConfig, RuntimeConfig
from commands.redis_server import EmbeddedRedis
from worker.main import WorkerProcess
from worker.runtimes import build_runtime

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


class WorkerProc:
    """A `tinkerq worker` in its own process, as users run it."""

    def __init__(self, redis_url: str, env: dict[str, str], args: list[str] = ()) -> None:
        self.log = open(Path(env.get("TINKERQ_CHECKPOINT_ROOT", "/tmp")) / f"worker-{time.time_ns()}.log", "w+")
        path = [str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]  # env may add to it
        full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "commands.cli", "worker", "--redis-url", redis_url, "--log-level", "WARNING", *args],
            env=full_env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


class ApiProc(WorkerProc):
    """`tinkerq api` on a free port, as users run it."""

    def __init__(self, redis_url: str, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        from commands.redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(env.get("TINKERQ_CHECKPOINT_ROOT", "/tmp")) / f"api-{time.time_ns()}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "commands.cli", "api", "--redis-url", redis_url, "--port", str(self.port),
             "--log-level", "warning", *args],
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
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
