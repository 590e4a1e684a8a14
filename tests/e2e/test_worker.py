"""The worker against real Redis, in process (burst mode): order, batching, versions, failures."""

import json
import threading
import time
import zlib

import numpy as np
import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from producer import Producer
from schemas import (
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    WeightSyncRequest,
)
from support.stack import burst_worker
from tinkerq import keys

M = "sess:train:0"


@pytest.fixture
def producer(r, config):
    return Producer(r, config)


def drain(r, config, tmp_path, **runtime):
    worker = burst_worker(r, config, tmp_path, **runtime)
    worker.run(burst=True, logging_level="WARNING")
    return worker


def create(producer, model_id=M):
    return producer.submit(CreateModelRequest(model_id=model_id, base_model="reference"))


def sample(producer, model_id=M, **kw):
    return producer.submit(SampleRequest(model_id=model_id, prompt_tokens=kw.pop("prompt", [1, 2]), **kw))


def result(producer, ticket):
    out = producer.get(ticket.request_id)
    assert out is not None, f"no result for {ticket}"
    return out


def test_a_sync_lands_before_every_later_sample_and_after_every_earlier_one(r, producer, config, tmp_path):
    create(producer)
    before = [sample(producer) for _ in range(3)]
    sync = producer.submit(WeightSyncRequest(model_id=M))
    after = [sample(producer) for _ in range(3)]
    drain(r, config, tmp_path)
    assert result(producer, sync).version == 1
    for ticket, version in [(t, 0) for t in before] + [(t, 1) for t in after]:
        out = result(producer, ticket)
        assert isinstance(out, SampleOutput) and out.weights_version == version
        assert {tok for seq in out.sequences for tok in seq.tokens} == {version}


def test_samples_between_barriers_reach_the_engine_as_one_batch(r, producer, config, tmp_path):
    create(producer)
    create(producer, "other")
    first = [sample(producer) for _ in range(5)]
    producer.submit(WeightSyncRequest(model_id=M))
    # samples of another model may be served past M's sync; M's own later samples may not
    mixed = [sample(producer, "other") for _ in range(3)] if keys.shard_of("other", 4) == keys.shard_of(M, 4) else []
    later = [sample(producer) for _ in range(4)]
    worker = drain(r, config, tmp_path)
    batches = worker.dispatcher.runtime.engine.batches
    assert batches[0] == 5 + len(mixed), batches
    assert sum(batches) == len(first) + len(mixed) + len(later)
    assert {result(producer, t).weights_version for t in later} == {1}
    # the batched jobs left the queue at once and show as finished in RQ (the dashboard's view)
    for ticket in first + mixed + later:
        job = Job.fetch(ticket.request_id, connection=r, serializer="json")
        assert job.get_status() == JobStatus.FINISHED and job.started_at <= job.ended_at
        # and expire as RQ's own finished jobs do, not live on in Redis
        assert 0 < r.ttl(job.key) <= config.rq_result_ttl_s
    assert r.llen(keys.batched_key(keys.shard_of(M, 4))) == 0


def drain_while(r, config, tmp_path, submit_meanwhile, **runtime) -> None:
    """Drain, and call `submit_meanwhile` from another thread while the first job runs (RQ's worker wants the
    main thread, for its signal handlers)."""
    submitter = threading.Timer(1.0, submit_meanwhile)
    submitter.start()
    drain(r, config, tmp_path, **runtime)
    submitter.join()


def summary(r, ticket) -> dict:
    return Job.fetch(ticket.request_id, connection=r, serializer="json").return_value()


def test_samples_that_arrive_while_a_batch_runs_join_it_but_never_overtake_a_queued_job(r, producer, config, tmp_path):
    """The serial schedule's run (TINKERQ_LANES=0): the RQ loop's job in hand serves the samples that join it, and
    none past a queued job (the lanes serve samples past jobs they do not conflict with: test_lanes.py)."""
    from support import faulty_runtime

    config = config.model_copy(update={"lanes": False})
    create(producer)
    stall = sample(producer, prompt=[faulty_runtime.STALL])  # its engine call takes 3 s
    joined = []
    drain_while(r, config, tmp_path, lambda: joined.append(sample(producer)), runtime="support.faulty_runtime:make")
    assert summary(r, stall)["batch"] == 2  # the late sample was served in the stalled job's run
    assert summary(r, joined[0])["batched"] is True
    assert isinstance(result(producer, joined[0]), SampleOutput)

    # a fresh worker (state is in memory): two new models on one shard
    first, second = [m for m in (f"m{i}:train:0" for i in range(100))
                     if keys.shard_of(m, config.num_shards) == keys.shard_of(M, config.num_shards)][:2]
    create(producer, first)
    stall = sample(producer, first, prompt=[faulty_runtime.STALL])
    queued = []
    drain_while(r, config, tmp_path, lambda: queued.extend([create(producer, second), sample(producer, first)]),
                runtime="support.faulty_runtime:make")
    assert summary(r, stall)["batch"] == 1  # another model's job was queued first: the sample waited for it
    assert isinstance(result(producer, queued[1]), SampleOutput)
    assert summary(r, queued[1]) == {"request_id": queued[1].request_id, "type": "sample", "batch": 1}

    # nor a job on another shard of the same worker
    third = next(m for m in (f"n{i}:train:0" for i in range(100)) if keys.shard_of(m, config.num_shards)
                 != keys.shard_of(M, config.num_shards))
    create(producer, first)
    stall = sample(producer, first, prompt=[faulty_runtime.STALL])
    queued = []
    drain_while(r, config, tmp_path, lambda: queued.extend([create(producer, third), sample(producer, first)]),
                runtime="support.faulty_runtime:make")
    assert summary(r, stall)["batch"] == 1
    assert summary(r, queued[1])["batch"] == 1


def test_an_engine_crash_after_admitting_samples_puts_them_back_and_each_gets_one_result(r, producer, config,
                                                                                        tmp_path):
    from support import faulty_runtime

    create(producer)
    stall = sample(producer, prompt=[faulty_runtime.STALL])
    late = []
    drain_while(r, config, tmp_path, lambda: late.extend([sample(producer, prompt=[faulty_runtime.EXPLODE]),
                                                           sample(producer)]), runtime="support.faulty_runtime:make")
    assert isinstance(result(producer, stall), SampleOutput)  # stored before the admitted batch exploded
    assert Job.fetch(stall.request_id, connection=r, serializer="json").get_status() == JobStatus.FINISHED
    boom, fine = (result(producer, ticket) for ticket in late)
    assert (boom.code, boom.status) == ("internal_error", 500)  # retried alone after the release, and failed
    assert isinstance(fine, SampleOutput)
    assert r.llen(keys.batched_key(keys.shard_of(M, config.num_shards))) == 0
    assert r.llen(Queue(keys.queue_name(stall.shard), connection=r).key) == 0


def test_samples_served_before_an_engine_crash_are_finished_in_rq_and_leave_the_batched_list(r, producer, config,
                                                                                           tmp_path):
    from support import faulty_runtime

    create(producer)
    crashing = sample(producer, prompt=[faulty_runtime.HALF])
    served = [sample(producer) for _ in range(2)]  # taken with it, and served before the engine raises
    drain(r, config, tmp_path, runtime="support.faulty_runtime:make")
    assert all(isinstance(result(producer, ticket), SampleOutput) for ticket in served)
    assert result(producer, crashing).status == 500
    for ticket in served:
        assert Job.fetch(ticket.request_id, connection=r, serializer="json").get_status() == JobStatus.FINISHED
    assert r.llen(keys.batched_key(keys.shard_of(M, config.num_shards))) == 0


def test_a_crash_mid_batch_puts_the_taken_samples_back_at_the_front_in_order(r, producer, config, tmp_path):
    from schemas import Limits
    from worker.consumer.admission import Admission
    from worker.consumer.recovery import recover
    from worker.serving.batching import Batcher
    from worker.shards.fencing import Fence

    create(producer)
    worker = drain(r, config, tmp_path)
    tickets = [sample(producer) for _ in range(4)]
    queue = Queue(keys.queue_name(tickets[0].shard), connection=r, serializer="json")
    first = r.lpop(queue.key).decode()  # popped by a worker that then takes the rest and dies
    dead, successor = Fence(r, "dead", 60000), Fence(r, "successor", 60000)
    dead.acquire([tickets[0].shard])
    taken = Batcher(r, dead, 60, Admission(config, Limits())).take(queue.key, tickets[0].shard, 10)
    assert [c.request_id for c in taken] == [t.request_id for t in tickets[1:]]
    assert queue.get_job_ids() == []
    r.rpush(f"{queue.key}:intermediate", first)
    r.delete(keys.lease_key(tickets[0].shard))  # its lease lapses; the successor takes the shard
    successor.acquire([tickets[0].shard])
    recover(r, queue, successor, lambda *answer: pytest.fail(f"no request here is refused: {answer}"))
    assert queue.get_job_ids() == [t.request_id for t in tickets]
    successor.release()
    worker.run(burst=True, logging_level="WARNING")
    assert all(isinstance(result(producer, t), SampleOutput) for t in tickets)


def test_training_ops_run_in_seq_order_even_when_the_first_chunk_arrives_last(r, producer, config, tmp_path):
    create(producer)
    datum = Datum(model_input=[1, 2, 3])
    # seq 1 and 2 are chunks of one forward_backward: chunk 2 is posted first, as the SDK does
    chunk2 = producer.submit(ForwardBackwardRequest(model_id=M, seq_id=2, data=[datum]))
    optim = producer.submit(OptimStepRequest(model_id=M, seq_id=3))
    chunk1 = producer.submit(ForwardBackwardRequest(model_id=M, seq_id=1, data=[datum, datum]))
    after = producer.submit(ForwardBackwardRequest(model_id=M, seq_id=4, data=[datum]))
    drain(r, config, tmp_path)
    # both chunks ran before the step (they saw step 0), and the step applied all 3 datums
    assert result(producer, chunk1).metrics["step:max"] == 0
    assert result(producer, chunk2).metrics["step:max"] == 0
    assert result(producer, optim).metrics == {"step:max": 1.0, "datums:sum": 3.0}
    assert result(producer, after).metrics["step:max"] == 1


def test_a_seq_gap_that_never_fills_ends_in_an_error_and_later_ops_go_on(r, producer, config, tmp_path):
    create(producer)
    early = producer.submit(OptimStepRequest(model_id=M, seq_id=2))  # seq 1 never comes
    worker = burst_worker(r, config, tmp_path)
    worker.run(burst=True, logging_level="WARNING")
    assert producer.get(early.request_id) is None  # held, not answered yet
    time.sleep(config.seq_gap_timeout_s + 0.1)
    worker.take_free_shards()
    worker._tick()
    out = result(producer, early)
    assert isinstance(out, ErrorResponse) and out.code == "seq_gap_timeout" and out.status == 408
    next_op = producer.submit(OptimStepRequest(model_id=M, seq_id=3))
    late = producer.submit(OptimStepRequest(model_id=M, seq_id=1))
    worker.run(burst=True, logging_level="WARNING")
    assert result(producer, next_op).type == "optim_step"
    assert result(producer, late).code == "stale_seq_id"


def test_old_snapshots_are_served_exactly_until_evicted(r, producer, config, tmp_path):
    create(producer)
    syncs = [producer.submit(WeightSyncRequest(model_id=M)) for _ in range(5)]
    pinned = {v: sample(producer, weights_version=v) for v in (0, 1, 2, 5)}
    future = sample(producer, weights_version=9)
    drain(r, config, tmp_path, max_snapshots=4)
    assert [result(producer, s).version for s in syncs] == [1, 2, 3, 4, 5]
    for v in (0, 1):
        assert result(producer, pinned[v]).code == "snapshot_evicted"
    for v in (2, 5):
        assert result(producer, pinned[v]).weights_version == v
    out = result(producer, future)
    assert out.code == "weights_not_ready" and out.status == 409


def test_unknown_model_gets_an_error_not_a_crash(r, producer, config, tmp_path):
    lost = sample(producer, "nobody")
    optim = producer.submit(OptimStepRequest(model_id="nobody"))
    sync = producer.submit(WeightSyncRequest(model_id="nobody"))
    drain(r, config, tmp_path)
    for ticket in (lost, optim, sync):
        out = result(producer, ticket)
        assert out.status == 404 and out.code == "unknown_model"


def test_replayed_sync_is_a_no_op(r, producer, config, tmp_path):
    create(producer)
    sync = producer.submit(WeightSyncRequest(model_id=M, name="first"))
    worker = drain(r, config, tmp_path)
    assert result(producer, sync).persisted
    path = r.hget(keys.model_key(M, "snapshots"), "1").decode()  # the named snapshot is registered
    assert path == result(producer, sync).path and path.endswith("first.json")
    assert int(r.get(keys.model_key(M, "applied"))) == 1
    # the dashboard's "requeue" (or a recovery) runs the same job again
    r.delete(keys.result_key(sync.request_id))
    Queue(keys.queue_name(sync.shard), connection=r, serializer="json").push_job_id(sync.request_id)
    worker.run(burst=True, logging_level="WARNING")
    replay = result(producer, sync)
    assert replay.version == 1 and replay.applied is False and replay.persisted


def raw_job(r, shard, job_id, func, args, kwargs=None):
    queue = Queue(keys.queue_name(shard), connection=r, serializer="json")
    queue.enqueue_call(func, args=args, kwargs=kwargs or {}, job_id=job_id)


def test_garbage_jobs_get_error_results_and_the_worker_keeps_serving(r, producer, config, tmp_path):
    create(producer)
    shard = keys.shard_of(M, 4)
    qname = keys.queue_name(shard)
    # 1) bytes that are neither zlib nor JSON, pushed straight into Redis
    r.hset("rq:job:garbage-1", mapping={"data": b"\x00{not json", "status": "queued", "origin": qname,
                                        "created_at": "2026-01-01T00:00:00.000000Z"})
    r.rpush(f"rq:queue:{qname}", "garbage-1")
    # 2) valid JSON, but a function outside the allowlist (it would create a directory)
    pwned = tmp_path / "pwned"
    raw_job(r, shard, "evil-1", "os.mkdir", [str(pwned)])
    # 3) right function, wrong arguments; 4) schema-invalid payload; 5) a job on the wrong shard
    raw_job(r, shard, "arity-1", "worker.jobs.sample", [1, 2])
    raw_job(r, shard, "schema-1", "worker.jobs.sample", [{"kind": "sample", "model_id": M, "prompt_tokens": []}])
    other = next(m for m in (f"m{i}" for i in range(100)) if keys.shard_of(m, 4) != shard)
    raw_job(r, shard, "shard-1", "worker.jobs.sample", [{"kind": "sample", "model_id": other, "prompt_tokens": [1]}])
    # 6) undecodable job hash fields: RQ cannot even load the job
    r.hset("rq:job:unloadable-1", mapping={"data": zlib.compress(b"[]"), "status": "not-a-status",
                                           "origin": qname})
    r.rpush(f"rq:queue:{qname}", "unloadable-1")
    # 7) queued through the producer, then its job hash deleted: RQ alone would skip it without a result
    lost = sample(producer)
    r.delete(f"rq:job:{lost.request_id}")
    good = sample(producer)
    drain(r, config, tmp_path)
    codes = {rid: result(producer, type("T", (), {"request_id": rid})).code
             for rid in ("garbage-1", "evil-1", "arity-1", "schema-1", "shard-1", "unloadable-1", lost.request_id)}
    assert codes == {"garbage-1": "invalid_job", "evil-1": "invalid_job", "arity-1": "invalid_job",
                     "schema-1": "invalid_request", "shard-1": "wrong_shard", "unloadable-1": "invalid_job",
                     lost.request_id: "job_lost"}
    assert not pwned.exists()
    assert isinstance(result(producer, good), SampleOutput)
    # infrastructure-level refusals are RQ FAILED (for the dashboard); domain errors are not
    assert Job.fetch("evil-1", connection=r, serializer="json").get_status() == JobStatus.FAILED
    assert Job.fetch("schema-1", connection=r, serializer="json").get_status() == JobStatus.FINISHED


@pytest.mark.parametrize("lanes", [False, True], ids=["serial", "lanes"])
def test_a_job_that_raises_or_times_out_still_gets_exactly_one_result(r, producer, config, tmp_path, lanes):
    """A sample whose engine run raises, or outlasts the job timeout, is served alone and answered with its error
    (500, 504); the others are served. With the lanes, the sync queued behind the stalled sample waits for the
    engine's run past its own timeout (a sync never changes weights under a running sample): it is answered 504,
    and the sample pinned to it a retryable 409, which a client sends again."""
    from support import faulty_runtime

    config = config.model_copy(update={"job_timeout_s": 2, "lanes": lanes})  # the stall takes 3 s
    producer = Producer(r, config)
    create(producer)
    boom = sample(producer, prompt=[faulty_runtime.EXPLODE])
    producer.submit(WeightSyncRequest(model_id=M))  # a barrier, so the stall is not batched with boom
    stall = sample(producer, prompt=[faulty_runtime.STALL])
    sync = producer.submit(WeightSyncRequest(model_id=M))
    fine = sample(producer)
    drain(r, config, tmp_path, runtime="support.faulty_runtime:make")
    # With the lanes, boom's second try (alone, on the RQ loop) may wait for the engine behind the stalled run
    # past its own timeout: it is then answered 504, still once.
    boom_codes = {("internal_error", 500)} | ({("timeout", 504)} if lanes else set())
    assert (result(producer, boom).code, result(producer, boom).status) in boom_codes
    assert (result(producer, stall).code, result(producer, stall).status) == ("timeout", 504)
    assert Job.fetch(boom.request_id, connection=r, serializer="json").get_status() == JobStatus.FAILED
    if not lanes:
        assert result(producer, fine).weights_version == 2
        return
    assert (result(producer, sync).code, result(producer, sync).status) == ("timeout", 504)
    assert (result(producer, fine).code, result(producer, fine).retryable) == ("weights_not_ready", True)


def test_a_training_op_that_raises_gets_its_error_and_later_ops_still_run(r, producer, config, tmp_path):
    from schemas import AdamParams
    from support import faulty_runtime

    create(producer)
    bad = AdamParams(learning_rate=faulty_runtime.BAD_LEARNING_RATE)
    late = producer.submit(OptimStepRequest(model_id=M, seq_id=3))
    parked_bad = producer.submit(OptimStepRequest(model_id=M, seq_id=2, adam_params=bad))  # raises when drained
    first = producer.submit(OptimStepRequest(model_id=M, seq_id=1))
    then_bad = producer.submit(OptimStepRequest(model_id=M, seq_id=4, adam_params=bad))  # raises as the job in hand
    after = producer.submit(OptimStepRequest(model_id=M, seq_id=5))
    drain(r, config, tmp_path, runtime="support.faulty_runtime:make")
    assert result(producer, first).metrics["step:max"] == 1
    assert (result(producer, parked_bad).code, result(producer, parked_bad).status) == ("internal_error", 500)
    assert result(producer, late).metrics["step:max"] == 2
    assert result(producer, then_bad).code == "internal_error"
    assert result(producer, after).metrics["step:max"] == 3
    assert Job.fetch(then_bad.request_id, connection=r, serializer="json").get_status() == JobStatus.FAILED


def test_heartbeats_continue_while_a_long_job_runs(r, producer, config, tmp_path):
    """The RQ loop's job in hand (a sample, on the serial schedule) stays in RQ's started registry, refreshed."""
    from support import faulty_runtime

    config = config.model_copy(update={"lease_ttl_ms": 1500, "lanes": False})
    create(producer)
    stall = sample(producer, prompt=[faulty_runtime.STALL])
    registry = StartedJobRegistry(keys.queue_name(stall.shard), connection=r)
    scores: list[float] = []

    def watch():
        for _ in range(6):
            time.sleep(0.45)
            score = r.zscore(registry.key, next(iter(r.zrange(registry.key, 0, -1)), b""))
            if score:
                scores.append(score)

    watcher = threading.Thread(target=watch)
    watcher.start()
    drain(r, config, tmp_path, runtime="support.faulty_runtime:make")
    watcher.join()
    assert result(producer, stall).type == "sample"
    assert len(scores) >= 3 and scores[-1] > scores[0] + 0.5, scores  # the registry entry was refreshed


def test_results_expire_and_rq_keeps_only_a_summary(r, producer, config, tmp_path):
    config = config.model_copy(update={"result_ttl_s": 30})
    create(producer)
    ticket = sample(producer, num_samples=4)
    drain(r, config, tmp_path)
    assert 0 < r.ttl(keys.result_key(ticket.request_id)) <= 30
    job = Job.fetch(ticket.request_id, connection=r, serializer="json")
    assert job.return_value()["request_id"] == ticket.request_id and job.return_value()["type"] == "sample"
    assert len(json.dumps(job.return_value())) < 200


def test_running_a_worker_in_process_leaves_the_signal_handlers_as_they_were(r, config, tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    drain(r, config, tmp_path)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_model_whose_worker_is_gone_gets_a_clear_state_lost_error(r, producer, config, tmp_path):
    create(producer)
    drain(r, config, tmp_path)  # this worker made the model in its memory, then went away
    r.delete(keys.journal_key(M))  # ... and its durable record is gone too (tests/e2e/test_durable.py: when it is not)
    after = [sample(producer, weights_version=0), producer.submit(OptimStepRequest(model_id=M, seq_id=1)),
             sample(producer, model_id="never-made:train:0")]
    drain(r, config, tmp_path)  # the next owner of the shard never saw it
    codes = [result(producer, t).code for t in after]
    assert codes == ["model_state_lost", "model_state_lost", "unknown_model"]
    assert "load_state" in result(producer, after[0]).error
    assert keys.journal_key(M) in result(producer, after[1]).error  # names what was lost


def test_a_finished_jobs_data_stays_as_its_producer_stored_it(r, producer, config, tmp_path):
    """The worker's saves of a job (RQ's finish) leave its data alone: this producer's plain JSON and an earlier
    producer's zlib stream alike stay the bytes that were stored, and read back as RQ reads them."""
    create(producer)
    datum = Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2.0, 3.0, 4.0]})
    tickets = [producer.submit(ForwardBackwardRequest(model_id=M, data=[datum])), sample(producer),
               producer.submit(ForwardBackwardRequest(model_id=M, data=[datum]))]
    earlier = tickets[2].request_id  # as an earlier producer stored it: compressed
    r.hset(f"rq:job:{earlier}", "data", zlib.compress(r.hget(f"rq:job:{earlier}", "data")))
    stored = {t.request_id: r.hget(f"rq:job:{t.request_id}", "data") for t in tickets}
    drain(r, config, tmp_path)
    for ticket in tickets:
        job = Job.fetch(ticket.request_id, connection=r, serializer="json")
        assert job.get_status() == JobStatus.FINISHED
        assert r.hget(f"rq:job:{ticket.request_id}", "data") == stored[ticket.request_id]
        plain = stored[ticket.request_id]
        assert job.data == (zlib.decompress(plain) if ticket.request_id == earlier else plain)
    assert result(producer, tickets[0]).type == "forward_backward"
    assert result(producer, tickets[2]).type == "forward_backward"


def test_job_data_is_inflated_once_and_reads_as_rq_reads_it(r):
    """AllowlistJob hands RQ the data it already inflated (checking its size) exactly where RQ's own inflating would
    give the same bytes; anything else (not zlib, trailing bytes, a truncated stream) goes to RQ as it came. Either
    way the worker's saves leave the stored data alone."""
    from worker.consumer.rq_worker import AllowlistJob

    payload = json.dumps(["worker.jobs.sample", None, [{"a": [1.5, 2]}], {}]).encode()
    cases = {"level1": zlib.compress(payload, 1), "level9": zlib.compress(payload, 9), "plain": payload,
             "trailing": zlib.compress(payload) + b"junk", "truncated": zlib.compress(payload)[:-6]}
    for name, data in cases.items():
        r.hset(f"rq:job:{name}", mapping={"data": data, "created_at": "2026-12-05T00:00:00.000000Z",
                                            "origin": "q", "status": "queued"})
        ours, rq = (cls.fetch(name, connection=r, serializer="json") for cls in (AllowlistJob, Job))
        assert ours.data == rq.data, name
        ours.set_status(JobStatus.FINISHED)
        ours.save()
        assert r.hget(f"rq:job:{name}", "data") == data, name
        assert r.hget(f"rq:job:{name}", "status") == b"finished", name


def test_a_forward_backwards_result_comes_in_the_form_its_producer_reads(r, producer, config, tmp_path):
    """Per-token outputs come packed to a producer of this version (it says so: packed_results), and as number
    lists for a job an earlier producer queued (number lists, no packed_results), which is all that producer reads."""
    create(producer)
    datum = Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2.0, 3.0, 4.0]})
    ours = producer.submit(ForwardBackwardRequest(model_id=M, seq_id=1, data=[datum]))
    earlier = {"kind": "forward_backward", "model_id": M, "seq_id": 2, "loss_fn": "cross_entropy",
               "loss_fn_config": {}, "custom_loss": None,
               "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2.0, 3.0, 4.0]}}]}
    raw_job(r, keys.shard_of(M, 4), "earlier-fb", "worker.jobs.training_op", [earlier])
    drain(r, config, tmp_path)
    packed, lists = (json.loads(r.get(keys.result_key(rid)))["loss_fn_outputs"][0]["logprobs"]
                     for rid in (ours.request_id, "earlier-fb"))
    assert set(packed) == {"dtype", "base64"}
    assert isinstance(lists, list) and len(lists) == 3 and all(type(v) is float for v in lists)
    outputs = [result(producer, type("T", (), {"request_id": rid})).loss_fn_outputs[0]["logprobs"]
               for rid in (ours.request_id, "earlier-fb")]
    assert np.array_equal(outputs[0], outputs[1]) and np.array_equal(outputs[1], lists)
