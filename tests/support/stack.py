"""The worker and API a test starts: in process (a burst worker draining the queues) or as `tinkerq` processes, as
users run them; and a polling wait with a deadline."""

import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from redis import Redis
from rq.job import Job

from commands.processes import TinkerqProc
from tinkerq.config import QueueConfig, RuntimeConfig
from tinkerq.jobs import JobSerializer
from worker.main import WorkerProcess
from worker.runtime.registry import build_runtime

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 10.0  # the shutdown bound: a process stops within a few seconds of SIGTERM


def burst_worker(connection: Redis, config: QueueConfig, tmp_path: Path, **runtime: object) -> WorkerProcess:
    """An in-process worker over every shard, for draining queues in a test (run with burst=True); the reference
    runtime unless the test asks for another, and beside the torch runtime the PyTorch engine unless it asks for vLLM
    (starting a vLLM engine takes a CPU many seconds; tests/runtimes and the engine-parametrized tests are vLLM's)."""
    runtime.setdefault("runtime", "reference")
    runtime.setdefault("engine", "torch")
    rt = build_runtime(RuntimeConfig(checkpoint_root=str(tmp_path / "ckpt"), **runtime))
    return WorkerProcess(connection, rt, config)


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def job_spans(r: Redis, request_ids: list[str], timeout: float = 15.0) -> list[tuple[datetime, datetime]]:
    """When the worker started and ended each request's job, as its RQ job hash records them (RQ's own for a job it
    ran, a lane run's for a sample), once every one is marked ended: a result is stored before its job is marked
    finished (RQ's success path, the run's next flush)."""
    spans: list[tuple] = []

    def all_ended() -> bool:
        spans[:] = [(job.started_at, job.ended_at) for job in (Job.fetch(rid, connection=r, serializer=JobSerializer)
                                                               for rid in request_ids)]
        return all(end is not None for _, end in spans)

    wait_until(all_ended, timeout, "every job's ended_at")
    return spans


def api_env(config: QueueConfig, root: Path) -> dict[str, str]:
    """A `tinkerq api`'s settings in a test: the queue's shard count, and the checkpoint root its paths resolve in."""
    return {"TINKERQ_NUM_SHARDS": str(config.num_shards), "TINKERQ_CHECKPOINT_ROOT": str(root)}


def worker_env(config: QueueConfig, root: Path) -> dict[str, str]:
    """A `tinkerq worker`'s settings in a test: the queue's, its checkpoints under `root`, the reference runtime
    unless the test asks for a real one, and beside the torch runtime the PyTorch engine unless it asks for vLLM."""
    return {
        "TINKERQ_RUNTIME": "reference",
        "TINKERQ_ENGINE": "torch",
        "TINKERQ_NUM_SHARDS": str(config.num_shards),
        "TINKERQ_LEASE_TTL_MS": str(config.lease_ttl_ms),
        "TINKERQ_SEQ_GAP_TIMEOUT_S": str(config.seq_gap_timeout_s),
        "TINKERQ_CHECKPOINT_ROOT": str(root),
    }


def log_dir(env: dict[str, str]) -> Path:
    return Path(env.get("TINKERQ_CHECKPOINT_ROOT", "/tmp"))


class WorkerProc(TinkerqProc):
    """A `tinkerq worker` in its own process, as users run it; its log beside its checkpoints. tests/ is on its
    path, so a test may name a runtime of tests/support (TINKERQ_RUNTIME=support.faulty_runtime:make)."""

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


def stop_within(proc: TinkerqProc, deadline_s: float = DEADLINE_S) -> float:
    """SIGTERM; the seconds it took to exit with status 0 (fails, after SIGKILLing it, if it did not)."""
    start = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    try:
        code = proc.proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill(signal.SIGKILL)
        pytest.fail(f"{proc.log_path.name} was still running {deadline_s:g} s after SIGTERM\n{proc.output()[-3000:]}")
    took = time.monotonic() - start
    assert code == 0, f"{proc.log_path.name} exited with status {code} after {took:.1f} s\n{proc.output()[-3000:]}"
    return took
