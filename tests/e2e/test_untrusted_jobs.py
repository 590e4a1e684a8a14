"""Jobs read from Redis are untrusted input: hashes and queue entries written straight into Redis (bypassing the
producer) never crash, hijack or starve the worker, and each refused request gets its own ErrorResponse."""

import base64
import http.server
import json
import math
import re
import threading
import time
import zlib

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from pydantic import ValidationError
from rq.job import Job, JobStatus
from tinker.proto import tinker_public_pb2 as pb

from producer import Producer
from schemas import (
    ID_PATTERN,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
    parse_result,
)
from support.stack import burst_worker
from tinkerq import keys
from tinkerq.config import RuntimeConfig
from worker.main import WorkerProcess
from worker.runtime.registry import build_runtime

M = "untrusted:train:0"
WAIT_S = 20


def sample_payload(model_id: str = M, **fields) -> dict:
    return {"kind": "sample", "model_id": model_id, "prompt_tokens": [1, 2], **fields}


def job_data(payload: dict, func: str = "worker.jobs.sample") -> bytes:
    """A job's `data` field as RQ's JSON serializer writes it (json writes NaN and Infinity as they are)."""
    return zlib.compress(json.dumps([func, None, [payload], {}]).encode())


def forge(r, rid: str | bytes, shard: int, payload: dict | None = None, func: str = "worker.jobs.sample",
          data: bytes | None = None, onto: str | None = None, **fields) -> None:
    """Write a job hash as RQ's JSON serializer would (`fields` over RQ's usual ones) and push its id onto `shard`'s
    queue (or the list `onto`)."""
    rid = rid if isinstance(rid, bytes) else rid.encode()
    if data is None:
        data = job_data(payload if payload is not None else sample_payload(), func)
    mapping = {"data": data, "status": "queued", "origin": keys.queue_name(shard), "timeout": 60,
               "created_at": "2026-01-01T00:00:00.000000Z", "enqueued_at": "2026-01-01T00:00:00.000000Z",
               "description": "forged", **fields}
    r.hset(b"rq:job:" + rid, mapping=mapping)
    r.rpush(onto or keys.queue_key(shard), rid)


def other_shard(shard: int, num_shards: int) -> int:
    return (shard + 1) % num_shards


def serve_model(producer: Producer, model_id: str = M) -> None:
    created = producer.wait(producer.submit(CreateModelRequest(model_id=model_id, base_model="ref")).request_id,
                            WAIT_S)
    assert created is not None and created.type == "create_model", created


def good_sample_is_answered(producer: Producer, model_id: str = M) -> None:
    """A request queued after the bad ones is served: the worker kept serving."""
    ticket = producer.submit(SampleRequest(model_id=model_id, prompt_tokens=[3]))
    out = producer.wait(ticket.request_id, WAIT_S)
    assert isinstance(out, SampleOutput), out


def settle(r, rids: list[str]) -> None:
    """Wait until RQ is done with each job: callbacks and webhooks come after the result, with the RQ status."""
    deadline = time.monotonic() + WAIT_S
    while any(r.hget(f"rq:job:{rid}", "status") not in (b"finished", b"failed") for rid in rids):
        assert time.monotonic() < deadline, {rid: r.hget(f"rq:job:{rid}", "status") for rid in rids}
        time.sleep(0.05)


def codes(producer: Producer, rids: list[str]) -> dict[str, str | None]:
    return {rid: getattr(producer.wait(rid, WAIT_S), "code", None) for rid in rids}


# -- ids and origins: each of these crashed the worker process -----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("owned", ["one shard", "every shard"])  # RQ pops with LMOVE for one queue, BLPOP for more
def test_queue_entries_that_name_no_request_and_forged_origins_never_crash_the_worker(r, config, start_worker,
                                                                                       owned):
    shard = keys.shard_of(M, config.num_shards)
    worker = start_worker("--shards", str(shard)) if owned == "one shard" else start_worker()
    producer = Producer(r, config)
    serve_model(producer)
    for raw in (b"\xff\xfe-not-utf8", b"", b"not an id", b"x" * 200):
        r.rpush(f"rq:queue:{keys.queue_name(shard)}".encode(), raw)
    forge(r, "with-space id", shard)  # a hash, but its id is none a producer makes: nothing to answer
    origins = {"origin-empty": "", "origin-default": "default", "origin-garbled": "tinkerq.shard.xyz",
               "origin-foreign": keys.queue_name(other_shard(shard, config.num_shards))}
    for rid, origin in origins.items():
        forge(r, rid, shard, origin=origin)
    good_sample_is_answered(producer)
    assert worker.alive(), worker.output()
    assert codes(producer, list(origins)) == dict.fromkeys(origins, "invalid_job")
    assert "origin" in producer.get("origin-foreign").error
    queue_key = f"rq:queue:{keys.queue_name(shard)}"
    # a claimed job leaves the intermediate list just after its result is stored: wait for that, boundedly
    deadline = time.monotonic() + WAIT_S
    while (r.llen(queue_key) or r.llen(f"{queue_key}:intermediate")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.llen(queue_key) == 0 and r.llen(f"{queue_key}:intermediate") == 0
    assert not r.exists(keys.result_key("with-space id"))


# -- limits: enforced by the worker too -----------------------------------------------------------------------

@pytest.mark.slow
def test_every_limit_is_enforced_by_the_worker_not_only_by_the_producer(r, config, start_worker):
    worker = start_worker()
    producer = Producer(r, config)
    serve_model(producer)
    shard = keys.shard_of(M, config.num_shards)
    over = {  # in queue order; the last two used to kill or stall the worker
        "huge-prompt": sample_payload(prompt_tokens=[1] * 2_000_000),
        "many-datums": {"kind": "forward", "model_id": M, "data": [{"model_input": [1]}] * 4097},
        "topk": sample_payload(topk_prompt_logprobs=21),
        "budget": sample_payload(prompt_tokens=[1] * 1000, num_samples=128, sampling_params={"max_tokens": 4096}),
        "num-samples": sample_payload(num_samples=10**7),
        "max-tokens": sample_payload(sampling_params={"max_tokens": 10**9}),
    }
    for rid, payload in over.items():
        forge(r, rid, shard, payload, func="worker.jobs.training_op" if payload["kind"] == "forward" else
              "worker.jobs.sample")
    good_sample_is_answered(producer)
    assert worker.alive(), worker.output()
    results = {rid: producer.get(rid) for rid in over}
    assert {rid: (out.code, out.status) for rid, out in results.items()} == \
        dict.fromkeys(over, ("limit_exceeded", 400)), results
    assert "TINKERQ_MAX_NUM_SAMPLES" in results["num-samples"].error
    assert "TINKERQ_MAX_PROMPT_TOKENS" in results["huge-prompt"].error


# -- nothing RQ would resolve or call from a hash -------------------------------------------------------------

@pytest.mark.slow
def test_callbacks_named_in_a_forged_hash_import_nothing(r, config, start_worker, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    marker = tmp_path / "imported"
    (hooks / "tq_forged_hook.py").write_text(
        f"open({str(marker)!r}, 'a').write(__name__)\ndef hook(*args, **kwargs):\n    pass\n")
    worker = start_worker(PYTHONPATH=str(hooks))
    producer = Producer(r, config)
    serve_model(producer)
    shard = keys.shard_of(M, config.num_shards)
    forged = {
        "cb-success": {"success_callback_name": "tq_forged_hook.hook"},  # a job that would succeed
        "cb-failure": {"failure_callback_name": "tq_forged_hook.hook"},
        "cb-stopped": {"stopped_callback_name": "tq_forged_hook.hook", "stopped_callback_timeout": "soon"},
    }
    for rid, fields in forged.items():
        forge(r, rid, shard, **fields)
    forge(r, "cb-failing", shard, func="os.getcwd", failure_callback_name="tq_forged_hook.hook")  # one that fails
    good_sample_is_answered(producer)
    settle(r, ["cb-success", "cb-failure", "cb-failing"])  # ("cb-stopped" does not even load on today's RQ)
    assert worker.alive(), worker.output()
    assert not marker.exists(), "a module named in a job hash was imported"
    assert codes(producer, [*forged, "cb-failing"]) == dict.fromkeys([*forged, "cb-failing"], "invalid_job")
    assert "callback" in producer.get("cb-success").error


class Listener(http.server.ThreadingHTTPServer):
    """A local HTTP server that records every request it gets."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                listener.seen.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.end_headers()

            do_GET = do_POST = _record

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.slow
def test_webhooks_in_a_forged_hash_send_no_request(r, config, start_worker):
    listener = Listener()
    try:
        worker = start_worker()
        producer = Producer(r, config)
        serve_model(producer)
        shard = keys.shard_of(M, config.num_shards)
        hooks = [{"url": f"{listener.url}/{status}", "job_status": status, "method": method}
                 for status in ("finished", "failed") for method in ("GET", "POST")]
        forge(r, "wh-finishing", shard, webhooks=json.dumps(hooks))
        forge(r, "wh-failing", shard, func="os.getcwd", webhooks=json.dumps(hooks))
        good_sample_is_answered(producer)
        settle(r, ["wh-finishing", "wh-failing"])
        time.sleep(0.2)  # a webhook is sent once the job's status is written: give a sent one time to arrive
        assert worker.alive(), worker.output()
        assert listener.seen == []
        assert codes(producer, ["wh-finishing", "wh-failing"]) == {"wh-finishing": "invalid_job",
                                                                   "wh-failing": "invalid_job"}
    finally:
        listener.shutdown()
        listener.server_close()


def test_forged_dependents_retries_and_repeats_are_not_acted_on(r, config, tmp_path):
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    shard = keys.shard_of(M, config.num_shards)
    forge(r, "hooked", shard, retries_left=3, repeats_left=3)
    # a deferred job that RQ would enqueue once "hooked" ends (its dependents set is a key anyone can write)
    r.hset("rq:job:dependent", mapping={
        "data": job_data(sample_payload()),
        "status": "deferred", "origin": keys.queue_name(shard), "created_at": "2026-01-01T00:00:00.000000Z",
        "dependency_ids": json.dumps(["hooked"]), "allow_dependency_failures": 1})
    r.sadd("rq:job:hooked:dependents", "dependent")
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    assert producer.get("hooked").code == "invalid_job"
    job = Job.fetch("hooked", connection=r, serializer="json")
    assert len(job.results()) == 1  # run once: no retry, no repeat
    assert job.get_status() == JobStatus.FAILED
    assert producer.get("dependent") is None
    assert Job.fetch("dependent", connection=r, serializer="json").get_status() == JobStatus.DEFERRED
    assert all(r.llen(f"rq:queue:{keys.queue_name(k)}") == 0 for k in range(config.num_shards))


def test_a_zlib_bomb_in_the_job_data_is_refused_not_inflated(r, config, tmp_path, monkeypatch):
    from worker.consumer.rq_worker import AllowlistJob

    monkeypatch.setattr(AllowlistJob, "max_data_bytes", 1 << 20, raising=False)  # the bound, scaled down for the test
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    shard = keys.shard_of(M, config.num_shards)
    forge(r, "bomb", shard, data=zlib.compress(b"[" * (4 << 20), 9))  # 4 MB of '[' in a few kB
    good = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    out = producer.get("bomb")
    assert (out.code, out.status) == ("invalid_job", 400) and "exceeds" in out.error
    assert isinstance(producer.get(good.request_id), SampleOutput)


# -- one bad job never fails another ----------------------------------------------------------------------------

def test_a_corrupt_job_in_the_batch_look_ahead_fails_only_itself(r, config, tmp_path):
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    first = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    bad_date = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    r.hset(f"rq:job:{bad_date.request_id}", "created_at", "not a date")
    r.rpush(f"rq:queue:{keys.queue_name(first.shard)}", b"\xff-not-utf8")
    too_many = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))  # a real job, its payload rewritten
    r.hset(f"rq:job:{too_many.request_id}", "data", job_data(sample_payload(num_samples=129)))
    last = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    worker = burst_worker(r, config, tmp_path)
    worker.run(burst=True, logging_level="WARNING")
    assert isinstance(producer.get(first.request_id), SampleOutput), producer.get(first.request_id)
    assert isinstance(producer.get(last.request_id), SampleOutput)
    assert producer.get(bad_date.request_id).code == "invalid_job"
    assert producer.get(too_many.request_id).code == "limit_exceeded"
    assert worker.dispatcher.runtime.engine.batches[0] == 2  # the first and the last, together, and no one else


def test_a_job_of_a_shard_the_worker_does_not_own_gets_an_explicit_result(r, config, tmp_path):
    producer = Producer(r, config)
    shard = keys.shard_of(M, config.num_shards)
    other = other_shard(shard, config.num_shards)
    elsewhere = next(m for m in (f"m{i}:train:0" for i in range(100)) if keys.shard_of(m, config.num_shards) == other)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    forge(r, "foreign-origin", shard, origin=keys.queue_name(other))  # says it belongs to a shard not owned here
    forge(r, "foreign-model", shard, sample_payload(elsewhere))  # its model routes to that shard
    good = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    runtime = build_runtime(RuntimeConfig(runtime="reference", checkpoint_root=str(tmp_path / "ckpt")))
    WorkerProcess(r, runtime, config, shards=[shard]).run(burst=True, logging_level="WARNING")
    assert producer.get("foreign-origin").code == "invalid_job"
    assert producer.get("foreign-model").code == "wrong_shard"
    assert isinstance(producer.get(good.request_id), SampleOutput)
    assert Job.fetch("foreign-origin", connection=r, serializer="json").get_status() == JobStatus.FAILED


# -- a dead owner's in-flight records: recovery reads them as untrusted input too ------------------------------

def leave_in_flight(r, shard: int, config, in_hand: str, batched: list[str]) -> None:
    """What an owner of `shard` that died mid-batch leaves: its lease (lapsing after the TTL), the job in hand in the
    queue's intermediate list and RQ's started registry, the samples batched with it in the shard's batched list."""
    queue_key = keys.queue_key(shard)
    r.set(keys.lease_key(shard), "dead-owner:1", px=config.lease_ttl_ms)
    r.lrem(queue_key, 1, in_hand)
    r.rpush(f"{queue_key}:intermediate", in_hand)
    r.zadd(f"rq:wip:{keys.queue_name(shard)}", {f"{in_hand}:dead-execution": time.time() + 60})
    r.hset(f"rq:job:{in_hand}", "status", "started")
    for rid in batched:
        r.lrem(queue_key, 1, rid)
        r.rpush(keys.batched_key(shard), rid)


@pytest.mark.slow
def test_forged_in_flight_records_never_crash_the_worker_that_takes_the_shard_over(r, config, start_worker):
    """Each of these crashed recovery at takeover (and so every later owner of the shard): entries that name no
    request, a request record that is not a hash, a `created` that is no time. The genuine in-flight jobs beside
    them are requeued in order and answered once; a forged entry with a request id gets an error result."""
    shard = keys.shard_of(M, config.num_shards)
    producer = Producer(r, config)
    create = producer.submit(CreateModelRequest(model_id=M, base_model="ref"))  # the dead owner's job in hand
    batched = [producer.submit(SampleRequest(model_id=M, prompt_tokens=[i])) for i in (1, 2)]
    queued = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))  # still queued behind them
    leave_in_flight(r, shard, config, create.request_id, [t.request_id for t in batched])
    intermediate, batched_list = f"{keys.queue_key(shard)}:intermediate", keys.batched_key(shard)
    for raw in (b"\xff\xfe-not-utf8", b"not an id", b""):
        r.rpush(intermediate, raw)
        r.rpush(batched_list, raw)
    for raw in (b"\xff:1", b"a:b:c", b"no-execution-id"):
        r.zadd(f"rq:wip:{keys.queue_name(shard)}", {raw: time.time() - 120})
    forge(r, "record-not-a-hash", shard, onto=intermediate)
    r.set(keys.request_key("record-not-a-hash"), "not a hash")
    forge(r, "created-not-a-time", shard, onto=intermediate)
    r.hset(keys.request_key("created-not-a-time"), mapping={"kind": "sample", "created": "abc"})
    forge(r, "created-infinite", shard, onto=batched_list)
    r.hset(keys.request_key("created-infinite"), mapping={"kind": "sample", "created": "inf"})
    r.rpush(batched_list, "no-job-hash")  # an id whose job is gone: answered as a queued one would be
    worker = start_worker("--shards", str(shard))
    genuine = [create, *batched, queued]
    outs = {t.request_id: producer.wait(t.request_id, WAIT_S + config.lease_ttl_ms / 1000) for t in genuine}
    assert worker.alive(), worker.output()[-3000:]
    assert outs[create.request_id].type == "create_model", outs
    assert all(isinstance(outs[t.request_id], SampleOutput) for t in (*batched, queued)), outs
    assert codes(producer, ["record-not-a-hash", "created-not-a-time", "created-infinite", "no-job-hash"]) == {
        "record-not-a-hash": "invalid_job", "created-not-a-time": "invalid_job", "created-infinite": "invalid_job",
        "no-job-hash": "job_lost"}
    good_sample_is_answered(producer)
    assert worker.alive(), worker.output()[-3000:]
    settle(r, [t.request_id for t in genuine])
    assert all(r.hget(f"rq:job:{t.request_id}", "status") == b"finished" for t in genuine)
    deadline = time.monotonic() + WAIT_S  # a claim ends just after its result is stored
    while (r.llen(intermediate) or r.llen(batched_list)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.lrange(intermediate, 0, -1) == [] and r.lrange(batched_list, 0, -1) == []
    assert r.zrange(f"rq:wip:{keys.queue_name(shard)}", 0, -1) == []


def running_worker(r, config, tmp_path) -> WorkerProcess:
    """A burst worker that served the model's creation and took every shard again: what a test writes next is
    written after the takeover's recovery, as while a worker runs."""
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    worker = burst_worker(r, config, tmp_path)
    worker.run(burst=True, logging_level="WARNING")
    assert worker.take_free_shards() == list(range(config.num_shards))
    return worker


def test_rq_fails_no_claimed_job_it_has_seen_in_the_intermediate_list_for_a_minute(r, config, tmp_path):
    """RQ's maintenance marked such a job FAILED, unanswered; the intermediate list is the claim's."""
    worker = running_worker(r, config, tmp_path)
    shard = keys.shard_of(M, config.num_shards)
    intermediate = f"{keys.queue_key(shard)}:intermediate"
    forge(r, "seen-long-ago", shard, onto=intermediate)  # a claim whose reply was lost, say
    r.set(f"{intermediate}:first_seen:seen-long-ago", time.time() - 120)
    worker.run(burst=True, logging_level="WARNING")
    assert isinstance(Producer(r, config).get("seen-long-ago"), SampleOutput)
    assert r.llen(intermediate) == 0


def test_forged_registry_entries_never_end_rqs_loop(r, config, tmp_path):
    """RQ's maintenance, at each start of its loop, loads whatever its registries and the intermediate list hold:
    each of these ended the loop, and with it the worker."""
    worker = running_worker(r, config, tmp_path)
    producer = Producer(r, config)
    shard = keys.shard_of(M, config.num_shards)
    intermediate = f"{keys.queue_key(shard)}:intermediate"
    r.set("rq:job:not-a-hash", "x")
    for raw in (b"\xff\xfe", b"not-a-hash"):
        r.rpush(intermediate, raw)
    for raw in (b"\xff:1", b"a:b:c", b"not-a-hash:1"):
        r.zadd(f"rq:wip:{keys.queue_name(shard)}", {raw: 1})
    good = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    worker.run(burst=True, logging_level="WARNING")
    assert isinstance(producer.get(good.request_id), SampleOutput)
    assert producer.get("not-a-hash").code == "invalid_job"
    assert r.llen(intermediate) == 0


# -- parked training ops are read back as untrusted ---------------------------------------------------------------

def park(r, shard: int, rid: str, seq_id: float, payload: bytes | dict | None, model_id: str = M) -> None:
    """Park an op as the worker's held-op structure would, with its deadline already past (None: no payload)."""
    if payload is not None:
        r.hset(keys.held_payload_key(model_id), rid, payload if isinstance(payload, bytes) else json.dumps(payload))
    r.zadd(keys.held_key(model_id), {rid: seq_id})
    r.zadd(keys.held_deadlines_key(shard), {f"{rid}|{model_id}": 0})


def test_forged_parked_ops_are_judged_and_answered_and_never_stop_the_sweep(r, config, tmp_path):
    """A deadline that names no op raised in every tick's sweep (no op parked on the shard was answered again), an
    entry of a model's held set that is no request id in each of its training ops, a payload that is no request in
    the tick once (never answered); and a parked payload ran without admission's checks."""
    producer = Producer(r, config)
    shard = keys.shard_of(M, config.num_shards)
    elsewhere = next(m for m in (f"m{i}:train:0" for i in range(100)) if keys.shard_of(m, config.num_shards) != shard)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    early = producer.submit(OptimStepRequest(model_id=M, seq_id=2))  # a genuine op parked for seq 1, which never comes
    worker = burst_worker(r, config, tmp_path)
    worker.run(burst=True, logging_level="WARNING")
    assert producer.get(early.request_id) is None
    deadlines = keys.held_deadlines_key(shard)
    r.zadd(deadlines, {b"\xff|" + M.encode(): 0, b"no-bar": 0, b"|" + M.encode(): 0, f"x|{elsewhere}".encode(): 0})
    r.zadd(keys.held_key(M), {b"\xff\xfe": 0, b"not an id": 0})
    park(r, shard, "not-json", 1, b"{not json")
    park(r, shard, "infinite-seq", -math.inf, {"kind": "optim_step", "model_id": M, "seq_id": 6})
    park(r, shard, "no-payload", 3, None)
    park(r, shard, "over-limits", 4, {"kind": "forward", "model_id": M, "seq_id": 4,
                                      "data": [{"model_input": [1]}] * 4097})
    park(r, shard, "not-as-parked", 5, {"kind": "optim_step", "model_id": M, "seq_id": 9})
    time.sleep(config.seq_gap_timeout_s + 0.1)  # the genuine op's deadline passes too
    worker.take_free_shards()
    worker._tick()
    assert producer.get(early.request_id).code == "seq_gap_timeout"
    assert codes(producer, ["not-json", "infinite-seq", "no-payload", "over-limits", "not-as-parked"]) == {
        "not-json": "invalid_request", "infinite-seq": "invalid_request", "no-payload": "invalid_request",
        "over-limits": "limit_exceeded", "not-as-parked": "invalid_request"}
    assert (r.zcard(deadlines), r.zcard(keys.held_key(M)), r.hlen(keys.held_payload_key(M))) == (0, 0, 0)
    after = producer.submit(OptimStepRequest(model_id=M, seq_id=3))  # the model goes on
    worker.run(burst=True, logging_level="WARNING")
    assert producer.get(after.request_id).type == "optim_step"


# -- non-finite numbers -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_inputs_are_refused_at_validation(bad):
    with pytest.raises(ValidationError, match="finite"):
        Datum(model_input=[1, 2], loss_fn_inputs={"advantages": [0.5, bad]})
    with pytest.raises(ValidationError, match="finite"):
        ForwardRequest(model_id=M, data=[Datum(model_input=[1])], loss_fn="ppo", loss_fn_config={"clip": bad})


def test_a_forged_job_with_non_finite_advantages_is_refused_by_the_worker(r, config, tmp_path):
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    shard = keys.shard_of(M, config.num_shards)
    datum = {"model_input": [1, 2], "loss_fn_inputs": {"advantages": [math.nan, math.inf]}}
    forge(r, "nan-adv", shard, {"kind": "forward_backward", "model_id": M, "data": [datum]},
          func="worker.jobs.training_op")
    good = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    out = producer.get("nan-adv")  # parses: the stored result is one
    assert (out.code, out.status) == ("invalid_request", 400) and "finite" in out.error
    assert isinstance(producer.get(good.request_id), SampleOutput)


def test_a_non_finite_output_is_stored_as_a_result_that_reads_back(r, redis_url, config, tmp_path):
    from producer.api.app import create_app
    from producer.api.settings import ApiSettings

    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    # finite inputs whose loss overflows: the reference loss is -sum(logprob * sum(weights))
    overflow = producer.submit(ForwardRequest(model_id=M, data=[
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": [1e308, 1e308, 1e308]})]))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    out = parse_result(r.get(keys.result_key(overflow.request_id)))
    assert out.type == "forward_backward" and out.metrics["loss:sum"] == math.inf
    assert producer.wait(overflow.request_id, 1).metrics["loss:sum"] == math.inf
    settings = ApiSettings(api_keys="tml-good", long_poll_s=0.5)
    with TestClient(create_app(redis_url, settings, config)) as api:
        response = api.post("/api/v1/retrieve_future", json={"request_id": overflow.request_id},
                            headers={"X-API-Key": "tml-good"})
    assert response.status_code == 200, response.text
    assert pb.ForwardBackwardOutput.FromString(response.content).metrics["loss:sum"] == math.inf


def test_a_non_finite_loss_input_through_the_api_is_a_400(r, redis_url, config, tmp_path):
    import numpy as np

    from producer.api.app import create_app
    from producer.api.settings import ApiSettings

    settings = ApiSettings(api_keys="tml-good", long_poll_s=0.5)
    headers = {"X-API-Key": "tml-good"}
    with TestClient(create_app(redis_url, settings, config)) as api:
        session = api.post("/api/v1/create_session", json={"tags": []}, headers=headers).json()["session_id"]
        created = api.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": "tinyq-micro"}, headers=headers).json()
        burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
        message = pb.ForwardBackwardRequest(model_id=created["model_id"], seq_id=1, loss_fn="importance_sampling")
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], dtype="<i4").tobytes()
        advantages = datum.loss_fn_inputs["advantages"]
        advantages.dense = np.asarray([0.5, np.nan], dtype="<f4").tobytes()
        advantages.dtype = pb.DTYPE_FLOAT32
        advantages.shape.append(2)
        response = api.post("/api/v1/forward_backward", content=message.SerializeToString(),
                            headers={**headers, "Content-Type": "application/x-protobuf"})
    assert response.status_code == 400, response.text
    assert "finite" in response.json()["error"]


# -- anything at all ----------------------------------------------------------------------------------------------

RQ_FIELDS = ["data", "status", "origin", "created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat",
             "timeout", "result_ttl", "failure_ttl", "ttl", "description", "worker_name", "meta", "result",
             "exc_info", "group_id", "dependency_ids", "dependency_id", "allow_dependency_failures",
             "enqueue_at_front", "retries_left", "retry_intervals", "number_of_retries", "repeats_left",
             "repeat_intervals", "rate_limit_key", "rate_limit_concurrency", "success_callback_name",
             "failure_callback_name", "stopped_callback_name", "success_callback_timeout", "webhooks"]
FUZZ_MODELS = ["fuzz:train:0", "fuzz:train:1", "", "x" * 200]  # never M: fuzzed jobs must not change its weights


def fuzz_entries(hook: str, listener_url: str, num_shards: int):
    """Lists of queue entries: an id (often none a producer makes) pushed on a shard queue, with maybe a job hash
    (mostly well formed, so that its payload gets judged, then bent by a few random fields) and a request record."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20))
    json_value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                              max_leaves=12)
    model = st.sampled_from(FUZZ_MODELS[:2])
    tokens = st.lists(st.integers(0, 50), min_size=1, max_size=4)
    valid = st.one_of(  # requests a producer could have sent, for models other than M
        st.builds(SampleRequest, model_id=model, prompt_tokens=tokens, num_samples=st.integers(1, 3),
                  sampling_params=st.builds(SamplingParams, max_tokens=st.integers(1, 8))),
        st.builds(WeightSyncRequest, model_id=model, version=st.integers(1, 3)),
        st.builds(CreateModelRequest, model_id=model, base_model=st.just("ref")),
        st.builds(ForwardBackwardRequest, model_id=model, seq_id=st.integers(1, 3),
                  data=st.lists(st.builds(Datum, model_input=tokens), min_size=1, max_size=2)),
        st.builds(OptimStepRequest, model_id=model, seq_id=st.integers(1, 3)),
        st.builds(LoadStateRequest, model_id=model, path=st.sampled_from(["/etc/passwd", "../x", "tinker://a/b"])),
    ).map(lambda request: request.model_dump(mode="json"))
    huge = st.one_of(st.integers(-1, 10**8), st.integers(-2**70, 2**70))
    # packed arrays (schemas/arrays.py): right and wrong dtypes, bytes of any length and value, text that is not base64
    packed = st.fixed_dictionaries(
        {"dtype": st.one_of(st.sampled_from(["int32", "int64", "float32", "float64", "int8", "<f4"]), json_value),
         "base64": st.one_of(st.binary(max_size=24).map(lambda b: base64.b64encode(b).decode()), st.text(max_size=8),
                             json_value)},
        optional={"extra": json_value})
    bent_request = {  # payload field -> what it may become
        "num_samples": huge, "prompt_tokens": st.one_of(st.lists(st.integers(-1, 2**40), max_size=6), json_value),
        "sampling_params": st.fixed_dictionaries({}, optional={"max_tokens": huge, "temperature": st.floats(),
                                                              "top_k": st.integers(-2, 3), "stop": json_value}),
        "topk_prompt_logprobs": huge, "weights_version": huge, "seq_id": huge, "version": huge,
        "model_id": st.sampled_from(FUZZ_MODELS), "kind": st.text(max_size=8),
        "data": st.lists(st.fixed_dictionaries({"model_input": st.one_of(st.lists(st.integers(-1, 9), max_size=3),
                                                                         packed)}, optional={
            "loss_fn_inputs": st.dictionaries(st.sampled_from(["weights", "advantages", "target_tokens"]),
                                              st.one_of(st.lists(st.floats(), max_size=3), packed), max_size=2)}),
                         max_size=3),
        "loss_fn_config": st.dictionaries(st.text(max_size=5), st.floats(), max_size=2), "extra": json_value,
    }
    bend_request = st.sampled_from(sorted(bent_request)).flatmap(lambda k: st.tuples(st.just(k), bent_request[k]))
    request = st.builds(lambda payload, bends: {**payload, **dict(bends)}, valid, st.lists(bend_request, max_size=2))
    allowed = st.sampled_from(["worker.jobs.sample", "worker.jobs.training_op", "worker.jobs.weight_sync"])
    func = st.one_of(allowed, allowed, allowed, st.sampled_from(["os.getcwd", hook, "builtins.print", ""]))
    data = st.one_of(
        st.builds(lambda f, p: job_data(p, f), func, request),
        st.builds(lambda f, i, a, k: zlib.compress(json.dumps([f, i, a, k]).encode()), func, json_value, json_value,
                  json_value),
        st.builds(lambda v: json.dumps(v).encode(), json_value), st.binary(max_size=40),
        st.builds(zlib.compress, st.binary(max_size=40)))
    date = st.one_of(st.just("2026-01-01T00:00:00.000000Z"), st.text(max_size=12), st.binary(max_size=12))
    bent = {  # field -> what it may become
        "data": data,
        "origin": st.one_of(st.sampled_from([keys.queue_name(k) for k in range(num_shards)]
                                            + ["", "default", "tinkerq.shard.xyz"]), st.text(max_size=12)),
        "status": st.one_of(st.sampled_from(["started", "finished", "deferred", "canceled"]), st.binary(max_size=8)),
        "created_at": date, "enqueued_at": date, "last_heartbeat": date, "started_at": date,
        "timeout": st.one_of(st.integers(-5, 10**6).map(str), st.text(max_size=6)),
        "success_callback_name": st.just(hook), "failure_callback_name": st.just(hook),
        "stopped_callback_name": st.just(hook),
        "webhooks": st.one_of(st.just(json.dumps([{"url": listener_url, "job_status": s, "method": "POST"}
                                                  for s in ("finished", "failed")])), st.binary(max_size=20)),
        "dependency_ids": st.one_of(st.just(json.dumps(["fuzz-parent"])), st.binary(max_size=10)),
    }
    junk = st.one_of(st.binary(max_size=30), st.text(max_size=30), st.integers().map(str))
    bend = st.one_of(st.sampled_from(sorted(bent)).flatmap(lambda name: st.tuples(st.just(name), bent[name])),
                     st.tuples(st.one_of(st.sampled_from(RQ_FIELDS), st.binary(min_size=1, max_size=10)), junk))

    @st.composite
    def entry(draw):
        payload = draw(request)
        routed = keys.shard_of(str(payload.get("model_id")), num_shards)
        shard = draw(st.one_of(st.just(routed), st.just(routed), st.integers(0, num_shards - 1)))
        job = {"data": job_data(payload, draw(func)), "status": "queued",
               "origin": keys.queue_name(shard), "created_at": "2026-01-01T00:00:00.000000Z",
               "enqueued_at": "2026-01-01T00:00:00.000000Z", "timeout": "60", "description": "fuzz"}
        job.update(draw(st.lists(bend, max_size=3)))
        return {
            "id": draw(st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True), st.binary(max_size=12),
                                 st.text(max_size=12))),
            "hash": draw(st.one_of(st.just(job), st.just(job), st.just(job), st.none(), st.just("wrong type"))),
            "record": draw(st.one_of(st.none(), st.just("wrong type"), st.fixed_dictionaries({
                "kind": st.sampled_from(["sample", "optim_step", "garbage"]), "model": st.sampled_from(FUZZ_MODELS)}))),
            "shard": shard,
        }

    return st.lists(entry(), min_size=1, max_size=5)


@pytest.mark.slow
def test_random_job_hashes_and_queue_entries_never_stop_the_worker(r, config, start_worker, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    marker = tmp_path / "imported"
    (hooks / "tq_fuzz_hook.py").write_text(f"open({str(marker)!r}, 'a').write(__name__)\ndef hook(*a, **k): pass\n")
    listener = Listener()
    worker = start_worker("--runtime", "reference", PYTHONPATH=str(hooks))
    producer = Producer(r, config)
    serve_model(producer)
    answerable: set[str] = set()
    examples = iter(range(10**9))

    # No shrinking: the worker process lives across examples, so a smaller example would not replay the same state.
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.explicit, Phase.generate])
    @given(entries=fuzz_entries("tq_fuzz_hook.hook", listener.url, config.num_shards))
    def check(entries):
        prefix = f"f{next(examples)}-".encode()  # ids of one example never meet another's
        for entry in entries:
            rid = prefix + (entry["id"] if isinstance(entry["id"], bytes) else entry["id"].encode())
            r.delete(b"rq:job:" + rid, b"tq:req:" + rid)  # an id may come twice in one example
            if entry["hash"] == "wrong type":
                r.set(b"rq:job:" + rid, b"not a hash")
            elif entry["hash"] is not None:
                r.hset(b"rq:job:" + rid, mapping=entry["hash"])
            if entry["record"] == "wrong type":
                r.set(b"tq:req:" + rid, b"not a hash")
            elif entry["record"] is not None:
                r.hset(b"tq:req:" + rid, mapping=entry["record"])
            r.rpush(f"rq:queue:{keys.queue_name(entry['shard'])}".encode(), rid)
            if re.fullmatch(ID_PATTERN, rid.decode(errors="replace")):
                answerable.add(rid.decode())
        assert worker.alive(), worker.output()
        good_sample_is_answered(producer)

    try:
        check()
        # every queued request id got its one result (a parked training op, once its seq gap timed out)
        deadline = time.monotonic() + config.seq_gap_timeout_s + 5
        while (unanswered := [rid for rid in answerable if producer.get(rid) is None]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert unanswered == []
        assert worker.alive(), worker.output()
        assert not marker.exists(), "a module named in a job hash was imported"
        assert listener.seen == []
    finally:
        listener.shutdown()
        listener.server_close()


def test_a_stop_signal_while_a_claimed_job_loads_leaves_it_for_the_next_owner(r, config, tmp_path, monkeypatch):
    """The signal handler raises StopRequested when the worker is not yet busy, which may be inside RQ's fetch of
    a job just claimed; RQ tags that exception with the job id like a load failure. The job must not be answered
    as unloadable: it stays in flight, and the next owner serves it once."""
    from rq.exceptions import StopRequested

    from worker.consumer.rq_worker import AllowlistJob

    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    ticket = producer.submit(SampleRequest(model_id=M, prompt_tokens=[3]))
    fetch = AllowlistJob.fetch.__func__
    signalled: list[str] = []

    def fetch_then_signal(cls, job_id, *args, **kwargs):
        if job_id == ticket.request_id and not signalled:
            signalled.append(job_id)  # SIGTERM arrives while RQ loads the job it was handed
            raise StopRequested()
        return fetch(cls, job_id, *args, **kwargs)

    monkeypatch.setattr(AllowlistJob, "fetch", classmethod(fetch_then_signal))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    assert signalled == [ticket.request_id]
    assert producer.get(ticket.request_id) is None  # not answered invalid_job: left in flight
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    assert isinstance(producer.get(ticket.request_id), SampleOutput), producer.get(ticket.request_id)
