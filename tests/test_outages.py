"""Redis going away under a live `tinkerq worker`: SIGKILLed and restarted (AOF with either fsync policy), frozen,
its connections reset. Once it is back, every acknowledged request is answered exactly once, by the same worker
process, which reconnected by itself; no job is lost between its pop and the claimed list.

"Acknowledged" is what README.md says: under appendfsync always, every submit that returned; under everysec, a
submit Redis lost with its last second of writes is lost whole (no record, job or queue entry is left), which the
API answers with 404 unknown_request and which the client resubmits under the same request id.
"""

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError

from conftest import WorkerProc
from producer import Producer
from redis_proc import RedisProc
from schemas import CreateModelRequest, Request, SampleOutput, SampleRequest, WeightSyncRequest, new_request_id
from tinkerq import keys
from tinkerq.config import QueueConfig

pytestmark = pytest.mark.slow

CONFIG = QueueConfig(num_shards=4, lease_ttl_ms=3000)
MODELS = [f"outage:train:{i}" for i in range(4)]
# Longer than redis-py's own retries (about 3 s) and than the lease TTL: the worker sees the outage, and its
# leases have lapsed when Redis is back.
DOWN_S = 5.0


@dataclass
class Sent:
    rid: str
    request: Request
    version: int | None = None


def connect(url: str) -> Redis:
    # a short socket timeout: a frozen server fails calls instead of hanging the test
    return Redis.from_url(url, socket_timeout=3, socket_connect_timeout=1)


def submit_until_acknowledged(producer: Producer, sent: Sent, stop: threading.Event) -> bool:
    """A client's retry loop: resend under the same request id until a submit returns (idempotent)."""
    while not stop.is_set():
        try:
            sent.version = producer.submit(sent.request, sent.rid).version
            return True
        except RedisError:
            time.sleep(0.1)
    return False


class Load(threading.Thread):
    """Samples (and every 10th a weight sync) over four models on four shards, paced so the outage hits
    mid-stream; `acked` holds each request whose submit returned."""

    def __init__(self, url: str, count: int, pace_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.producer = Producer(connect(url), CONFIG)
        self.count, self.pace_s = count, pace_s
        self.acked: list[Sent] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for i in range(self.count):
            model = MODELS[i % len(MODELS)]
            request = WeightSyncRequest(model_id=model) if i % 10 == 9 else SampleRequest(
                model_id=model, prompt_tokens=[1, 2, 3])
            sent = Sent(new_request_id(request.kind[:2]), request)
            if not submit_until_acknowledged(self.producer, sent, self.stop):
                return
            self.acked.append(sent)
            time.sleep(self.pace_s)

    def finish(self, timeout_s: float = 120) -> list[Sent]:
        self.join(timeout_s)
        self.stop.set()
        self.join(10)
        assert len(self.acked) == self.count, f"only {len(self.acked)} of {self.count} submits returned"
        return self.acked


@pytest.fixture(params=["always", "everysec"])
def fsync(request) -> str:
    return request.param


@pytest.fixture
def server(tmp_path: Path, fsync: str):
    proc = RedisProc(tmp_path / "redis", fsync).start()
    yield proc
    proc.kill()


def loaded_worker(url: str, tmp_path: Path, **env: str) -> WorkerProc:
    """A reference-runtime worker whose engine runs take ~30 ms (busy), with MODELS created."""
    proc = WorkerProc(url, {
        "TINKERQ_RUNTIME": "reference",
        "TINKERQ_NUM_SHARDS": str(CONFIG.num_shards),
        "TINKERQ_LEASE_TTL_MS": str(CONFIG.lease_ttl_ms),
        "TINKERQ_CHECKPOINT_ROOT": str(tmp_path),
        "TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": "0.002",  # each engine run takes ~30 ms: the worker is busy
        **env,
    })
    r = connect(url)
    producer = Producer(r, CONFIG)
    for model in MODELS:
        out = producer.wait(producer.submit(CreateModelRequest(model_id=model, base_model="ref")).request_id, 60)
        assert out is not None and out.type == "create_model", proc.output()
    producer.close()
    return proc


@pytest.fixture
def worker(server: RedisProc, tmp_path: Path):
    proc = loaded_worker(server.url, tmp_path)
    yield proc
    proc.kill(signal.SIGKILL)


def settle(url: str, sent: list[Sent], fsync: str, worker: WorkerProc) -> None:
    """Every acknowledged request ends with its one result; under everysec one that Redis lost whole is
    resubmitted, as the client that gets 404 unknown_request does. Nothing ends FAILED in RQ."""
    r = connect(url)
    producer = Producer(r, CONFIG)
    lost = []
    for item in sent:
        if not r.exists(keys.request_key(item.rid)) and not r.exists(keys.result_key(item.rid)):
            # lost whole, never half: the record, the job and its queue entry went in one MULTI
            assert not r.exists(f"rq:job:{item.rid}")
            lost.append(item.rid)
            assert submit_until_acknowledged(producer, item, threading.Event())
    for item in sent:
        out = producer.wait(item.rid, 60)
        assert out is not None, f"{item.request.kind} {item.rid} was never answered\n{worker.output()[-3000:]}"
        if isinstance(item.request, WeightSyncRequest):
            assert out.type == "weight_sync" and out.version == item.version, out
        else:
            assert isinstance(out, SampleOutput) and out.weights_version == item.version, out
    if fsync == "always":
        assert lost == [], "appendfsync always: Redis lost no acknowledged request"
    for shard in range(CONFIG.num_shards):
        assert r.zcard(f"rq:failed:{keys.queue_name(shard)}") == 0, "a job was failed instead of retried"
    producer.close()
    assert worker.alive(), f"the worker exited with {worker.proc.returncode}\n{worker.output()[-3000:]}"


def test_redis_killed_and_restarted_under_load_every_acknowledged_request_is_answered(server, worker, fsync):
    load = Load(server.url, 160)
    load.start()
    while len(load.acked) < 40 and load.is_alive():
        time.sleep(0.02)
    server.kill()
    time.sleep(DOWN_S)
    server.start()
    settle(server.url, load.finish(), fsync, worker)


def test_redis_killed_while_the_worker_is_idle_later_samples_are_answered(server, worker, fsync):
    server.kill()
    time.sleep(DOWN_S)
    server.start()
    load = Load(server.url, 6, pace_s=0)
    load.start()
    settle(server.url, load.finish(), fsync, worker)


@pytest.mark.parametrize("fsync", ["always"])
def test_redis_frozen_past_the_lease_ttl_under_load_every_request_is_answered(server, worker, fsync):
    load = Load(server.url, 120)
    load.start()
    while len(load.acked) < 30 and load.is_alive():
        time.sleep(0.02)
    server.freeze()
    time.sleep(DOWN_S)
    server.thaw()
    settle(server.url, load.finish(), fsync, worker)


@pytest.mark.parametrize("fsync", ["always"])
def test_connections_reset_under_load_every_request_is_answered(server, worker, fsync):
    load = Load(server.url, 120)
    load.start()
    admin = connect(server.url)
    while load.is_alive():
        try:
            admin.client_kill_filter(_type="normal", skipme=True)
        except RedisError:
            pass
        time.sleep(0.1)
    settle(server.url, load.finish(), fsync, worker)


def test_a_worker_started_after_the_dead_workers_executions_expired_recovers_its_job(r, config, start_worker):
    runtime = {"TINKERQ_RUNTIME": "faulty_runtime:make"}
    first = start_worker(**runtime)
    deadline = time.monotonic() + 30
    while sum(r.exists(keys.lease_key(s)) for s in range(config.num_shards)) < config.num_shards:
        assert time.monotonic() < deadline and first.alive(), first.output()
        time.sleep(0.05)
    producer = Producer(r, config)
    create = producer.submit(CreateModelRequest(model_id="expired:train:0", base_model="stall"))  # runs 3 s
    while r.hget(f"rq:job:{create.request_id}", "status") != b"started":
        assert time.monotonic() < deadline, first.output()
        time.sleep(0.05)
    first.kill(signal.SIGKILL)
    # What 60 s do (HEARTBEAT_TTL_S): RQ's execution hash expires, while the registries that list it live 60 s
    # longer (RQ adds 60 to their scores and TTLs).
    executions = r.keys(f"rq:execution:{create.request_id}:*")
    assert executions and r.zcard(f"rq:executions:{create.request_id}") == len(executions)
    r.delete(*executions)
    second = start_worker(**runtime)
    out = producer.wait(create.request_id, 60)
    assert out is not None and out.type == "create_model", second.output()
    assert second.alive(), second.output()
