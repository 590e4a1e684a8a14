"""Redis going away under a live `tinkerq worker`: SIGKILLed and restarted (AOF with either fsync policy), frozen,
its connections reset. Once it is back, every acknowledged request is answered exactly once, by the same worker
process, which reconnected by itself; no job is lost between its pop and the claimed list.

"Acknowledged" is what docs/operations.md says: under appendfsync always, every submit that returned; under everysec, a
submit Redis lost with its last second of writes is lost whole (no record, job or queue entry is left), which the
API answers with 404 unknown_request and which the client resubmits under the same request id.
"""

import signal
import threading
import time
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from producer import Producer
from schemas import CreateModelRequest, SampleOutput, WeightSyncRequest
from support.load import CONFIG, Load, Sent, connect, loaded_worker, submit_until_acknowledged
from support.redis_proc import RedisProc
from support.stack import WorkerProc
from tinkerq import keys

pytestmark = pytest.mark.slow

# Longer than redis-py's own retries (about 3 s) and than the lease TTL: the worker sees the outage, and its
# leases have lapsed when Redis is back.
DOWN_S = 5.0


@pytest.fixture(params=["always", "everysec"])
def fsync(request) -> str:
    return request.param


@pytest.fixture
def server(tmp_path: Path, fsync: str):
    proc = RedisProc(tmp_path / "redis", fsync).start()
    yield proc
    proc.kill()


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
    runtime = {"TINKERQ_RUNTIME": "support.faulty_runtime:make"}
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
