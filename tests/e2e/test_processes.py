"""Several processes against real Redis: producers, workers, waiters, the dashboard."""

import multiprocessing
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from redis import Redis

from commands.redis_server import free_port
from producer import Producer
from schemas import CreateModelRequest, ErrorResponse, SampleOutput, SampleRequest, WeightSyncRequest
from support.stack import wait_until
from tinkerq import keys
from tinkerq.config import QueueConfig
from worker.shards.fencing import Fence, FencedOut

pytestmark = pytest.mark.slow
FORK = multiprocessing.get_context("fork")


def owned_shards(r, config):
    return [s for s in range(config.num_shards) if r.exists(keys.lease_key(s))]


def run_program(args):
    """One producer process: submit its ops in order, report what it was given."""
    url, num_shards, ops = args
    producer = Producer(Redis.from_url(url), QueueConfig(num_shards=num_shards))
    sent = []
    for kind, model in ops:
        if kind == "sync":
            ticket = producer.submit(WeightSyncRequest(model_id=model))
        else:
            ticket = producer.submit(SampleRequest(model_id=model, prompt_tokens=[3, 4]))
        sent.append((kind, model, ticket.request_id, ticket.version))
    return sent


def test_interleaved_producers_never_get_a_sample_from_the_wrong_version(r, redis_url, config, start_worker):
    worker = start_worker()
    wait_until(lambda: len(owned_shards(r, config)) == config.num_shards, what="worker leases")
    producer = Producer(r, config)
    pool = FORK.Pool(3)
    op = st.tuples(st.sampled_from(["sync", "sample", "sample"]), st.integers(0, 2))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(programs=st.lists(st.lists(op, max_size=12), min_size=3, max_size=3))
    def check(programs):
        models = [f"hyp-{uuid.uuid4().hex[:8]}:train:{i}" for i in range(3)]
        for m in models:
            assert producer.wait(producer.submit(CreateModelRequest(model_id=m, base_model="ref")).request_id, 20)
        sent = pool.map(run_program, [(redis_url, config.num_shards, [(k, models[i]) for k, i in prog])
                                      for prog in programs])
        requests = [item for program in sent for item in program]
        for program in sent:
            floor = {m: 0 for m in models}  # a producer's own sync must be visible to its later samples
            for kind, model, rid, version in program:
                out = producer.wait(rid, 20)
                assert out is not None, f"no result for {kind} {rid}"
                if kind == "sync":
                    assert out.type == "weight_sync" and out.version == version and out.applied
                    floor[model] = version
                else:
                    assert isinstance(out, SampleOutput), out
                    assert out.weights_version == version >= floor[model]
                    assert {t for seq in out.sequences for t in seq.tokens} == {version}
        rids = [rid for *_, rid, _ in requests]
        assert len(set(rids)) == len(rids)
        assert sum(r.exists(keys.result_key(rid)) for rid in rids) == len(requests)

    try:
        check()
    finally:
        pool.terminate()
    assert worker.alive(), worker.output()


def wait_in_process(args):
    url, rid, timeout = args
    start = time.monotonic()
    out = Producer(Redis.from_url(url), QueueConfig(num_shards=4)).wait(rid, timeout)
    return (out.type if out else None), time.monotonic() - start


def test_many_waiters_in_several_processes_all_wake_without_polling(r, redis_url, config, start_worker):
    producer = Producer(r, config)
    producer.wait(producer.submit(CreateModelRequest(model_id="w", base_model="ref")).request_id, 0.01)
    ticket = producer.submit(SampleRequest(model_id="w", prompt_tokens=[1]))
    gets_before = int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))
    with FORK.Pool(4) as pool:
        waiting = pool.map_async(wait_in_process, [(redis_url, ticket.request_id, 30)] * 8)
        time.sleep(2.0)  # everyone is blocked on the same id
        worker = start_worker()
        outcomes = waiting.get(timeout=60)
    assert [kind for kind, _ in outcomes] == ["sample"] * 8
    gets = int(r.info("commandstats")["cmdstat_get"]["calls"]) - gets_before
    assert gets < 100, f"{gets} GETs for 8 waiters: that is polling"
    assert worker.alive()


def test_waiting_for_a_result_that_never_comes_times_out(r, config):
    producer = Producer(r, config)
    start = time.monotonic()
    assert producer.wait("never-1", 0.5) is None
    assert 0.4 < time.monotonic() - start < 3


def test_only_the_lease_holder_writes(r):
    old, new = Fence(r, "old", 1000), Fence(r, "new", 1000)
    assert old.acquire([0]) == [0] and new.acquire([0]) == []
    time.sleep(1.1)  # the old owner stalls past its lease
    assert new.acquire([0]) == [0]
    with pytest.raises(FencedOut):
        old.put_result(0, "req-1", ErrorResponse(error="stale", status=500, code="x").model_dump_json(), 60, "error")
    assert old.renew() == [0] and not old.owns(0)
    assert new.put_result(0, "req-1", '{"type":"error","error":"a","status":500,"code":"x"}', 60, "error")
    assert not new.put_result(0, "req-1", '{"type":"error","error":"b","status":500,"code":"x"}', 60, "error")
    assert b'"a"' in r.get(keys.result_key("req-1"))


def test_a_standby_takes_over_a_dead_workers_shards_and_reruns_its_job_first(r, config, start_worker):
    runtime = {"TINKERQ_RUNTIME": "support.faulty_runtime:make"}
    first = start_worker(**runtime)
    wait_until(lambda: len(owned_shards(r, config)) == config.num_shards, what="first worker's leases")
    standby = start_worker(**runtime)
    producer = Producer(r, config)
    model = "takeover:train:0"
    create = producer.submit(CreateModelRequest(model_id=model, base_model="stall"))  # runs 3 s
    before = producer.submit(SampleRequest(model_id=model, prompt_tokens=[1]))
    sync = producer.submit(WeightSyncRequest(model_id=model))
    after = producer.submit(SampleRequest(model_id=model, prompt_tokens=[1]))
    wait_until(lambda: r.hget(f"rq:job:{create.request_id}", "status") == b"started", what="create to start")
    time.sleep(0.5)
    first.kill(signal.SIGKILL)  # mid-job: its lease lapses, nobody finishes the create
    outs = [producer.wait(t.request_id, 30) for t in (create, before, sync, after)]
    assert outs[0].type == "create_model", outs[0]
    assert (outs[1].weights_version, outs[2].version, outs[3].weights_version) == (0, 1, 1)
    assert standby.alive(), standby.output()


def test_sigterm_finishes_the_job_in_hand_then_releases_the_shards(r, config, start_worker):
    worker = start_worker(TINKERQ_RUNTIME="support.faulty_runtime:make")
    wait_until(lambda: len(owned_shards(r, config)) == config.num_shards, what="leases")
    producer = Producer(r, config)
    create = producer.submit(CreateModelRequest(model_id="term", base_model="stall"))
    queued = producer.submit(CreateModelRequest(model_id="term2", base_model="ref"))
    time.sleep(1.0)
    worker.kill(signal.SIGTERM)
    assert worker.proc.returncode == 0, worker.output()
    assert producer.get(create.request_id).type == "create_model"
    assert owned_shards(r, config) == []  # released at once: a standby need not wait out the TTL
    if keys.shard_of("term2", 4) == create.shard:
        assert producer.get(queued.request_id) is None  # still queued for the next owner


def test_rq_dashboard_lists_the_shard_queues_and_the_worker(r, redis_url, config, start_worker):
    worker = start_worker()
    wait_until(lambda: len(owned_shards(r, config)) == config.num_shards, what="leases")
    producer = Producer(r, config)
    producer.wait(producer.submit(CreateModelRequest(model_id="dash", base_model="ref")).request_id, 10)
    port = free_port()
    dash = subprocess.Popen([sys.executable, "-m", "rq_dashboard", "--json", "-b", "127.0.0.1", "-p", str(port),
                             "-u", redis_url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def fetch(path):
            return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()
        wait_until(lambda: _ok(fetch, "/0/data/queues.json"), what="rq-dashboard")
        queues = fetch("/0/data/queues.json")
        workers = fetch("/0/data/workers.json")
    finally:
        dash.terminate()
        dash.wait(10)
    for shard in range(config.num_shards):
        assert keys.queue_name(shard) in queues
        assert keys.queue_name(shard) in workers
    assert worker.alive()


def _ok(fetch, path):
    try:
        fetch(path)
        return True
    except OSError:
        return False
