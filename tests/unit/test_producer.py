"""Producer library on fakeredis: idempotency, versions, backpressure, serialization."""

import hashlib
import json

import numpy as np
import pytest
from pydantic_core import to_json

from producer import Producer, Rejected
from producer.enqueue import DIGEST_FORM, canonical, digest_of, legacy_digest, lists_digest
from schemas import (
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    Limits,
    OptimStepRequest,
    SampleRequest,
    WeightSyncRequest,
)
from tinkerq import keys
from tinkerq.config import QueueConfig


@pytest.fixture
def producer(fake):
    return Producer(fake, QueueConfig(num_shards=4), Limits(max_shard_queue_depth=5))


def queued(fake, producer, model_id):
    return [i.decode() for i in fake.lrange(producer._queues[producer.shard_of(model_id)].key, 0, -1)]


def test_request_goes_to_its_models_shard_queue_as_json(fake, producer):
    ticket = producer.submit(SampleRequest(model_id="m1", prompt_tokens=[5, 6]))
    assert ticket.shard == keys.shard_of("m1", 4)
    assert queued(fake, producer, "m1") == [ticket.request_id]
    raw = fake.hget(f"rq:job:{ticket.request_id}", "data")
    func, _, args, kwargs = json.loads(raw)  # stored as it is, not compressed (tinkerq.jobs.QueuedJob)
    assert func == "worker.jobs.sample"
    assert args[0]["prompt_tokens"] == [5, 6] and kwargs == {}


def fb_request(model_id="m2", seq_id=3, weights=(1e-05, 0.5, 2.0), reverse=False):
    inputs = {"weights": list(weights), "target_tokens": [2.0, 3.0, 4.0]}
    if reverse:
        inputs = dict(reversed(inputs.items()))
    return ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="importance_sampling",
                                  loss_fn_config={"b": 1.5}, data=[Datum(model_input=[1, 2, 3], loss_fn_inputs=inputs)])


def test_job_payload_is_the_requests_json_and_its_digest_that_of_the_sorted_json(fake, producer):
    """The payload, spliced in as encoded for the digest, reads back (with plain json) as model_dump(mode="json")."""
    request = fb_request()
    stamped = SampleRequest(model_id="m2", prompt_tokens=[5, 6])  # the producer pins its version after the digest
    for req in (request, stamped):
        ticket = producer.submit(req)
        func, instance, args, kwargs = json.loads(fake.hget(f"rq:job:{ticket.request_id}", "data"))
        assert (instance, kwargs, len(args)) == (None, {}, 1)
        # a forward_backward says it reads packed arrays in its result; the producer reads that form
        stamp = {"packed_results": True} if req is request else {"weights_version": 0}
        assert args[0] == {**req.model_dump(mode="json"), **stamp}
    body = json.loads(canonical(request))
    assert body == request.model_dump(mode="json") and list(body["data"][0]["loss_fn_inputs"]) == \
        ["target_tokens", "weights"]
    assert digest_of(canonical(request)) == digest_of(canonical(fb_request(reverse=True)))  # dict order aside


def earlier_body(seq_id: int) -> dict:
    """fb_request(seq_id) as producers before the packed arrays encoded it: number lists, no packed_results."""
    return {"model_id": "m2", "seq_id": seq_id, "kind": "forward_backward",
            "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"weights": [1e-05, 0.5, 2.0],
                                                                   "target_tokens": [2.0, 3.0, 4.0]}}],
            "loss_fn": "importance_sampling", "loss_fn_config": {"b": 1.5}, "custom_loss": None}


def earlier_digests(seq_id: int) -> dict[str, str]:
    """The digests earlier producers stored for fb_request(seq_id), written out from the bytes they hashed."""
    text = json.dumps(earlier_body(seq_id), sort_keys=True, separators=(",", ":")).encode()
    return {"bare": hashlib.blake2b(text, digest_size=16).hexdigest(),
            "v2": "v2:" + hashlib.blake2b(to_json(json.loads(text)), digest_size=16).hexdigest()}


@pytest.mark.parametrize("form", ["bare", "v2"])
def test_a_resend_compares_with_a_digest_an_earlier_producer_stored(fake, producer, form):
    """Request records written before the digest's current form (the bare hash of json.dumps(sort_keys=True), then
    "v2:" of the arrays as number lists) still tell a resend of the same body (answered with the first id) from
    another body under the same seq_id (409)."""
    first = producer.submit(fb_request(seq_id=7))
    record = keys.request_key(first.request_id)
    assert fake.hget(record, "digest").decode().startswith(DIGEST_FORM)
    fake.hset(record, "digest", earlier_digests(7)[form])
    again = producer.submit(fb_request(seq_id=7, reverse=True))
    assert again.duplicate and again.request_id == first.request_id
    with pytest.raises(Rejected) as refused:
        producer.submit(fb_request(seq_id=7, weights=(1.0, 1.0, 1.0)))
    assert refused.value.error.code == "idempotency_conflict"


def test_the_list_form_is_what_earlier_producers_wrote_whatever_the_arrays_dtypes():
    """The SDK's datums arrive as int32 tokens, int64 targets and float32 weights (the API's protobuf reader); their
    list form is the float lists an earlier API made of them, so a resend across an upgrade compares equal."""
    datum = Datum(model_input=np.array([1, 2, 3], "<i4"),
                  loss_fn_inputs={"weights": np.array([1e-05, 0.5, 2.0]), "target_tokens": np.array([2, 3, 4], "<i8")})
    request = fb_request(seq_id=7).model_copy(update={"data": [datum], "packed_results": True})
    assert json.loads(canonical(request, lists=True)) == earlier_body(7)
    assert legacy_digest(request) == earlier_digests(7)["bare"]
    assert lists_digest(request) == earlier_digests(7)["v2"]


def test_weight_syncs_get_increasing_versions_and_samples_pin_the_latest(producer):
    assert producer.submit(SampleRequest(model_id="m", prompt_tokens=[1])).version == 0
    assert producer.submit(WeightSyncRequest(model_id="m")).version == 1
    assert producer.submit(WeightSyncRequest(model_id="m", name="ckpt")).version == 2
    assert producer.submit(SampleRequest(model_id="m", prompt_tokens=[1])).version == 2
    assert producer.submit(SampleRequest(model_id="m", prompt_tokens=[1], weights_version=1)).version == 1
    assert producer.submit(WeightSyncRequest(model_id="other")).version == 1


def test_same_request_id_twice_enqueues_once(fake, producer):
    request = SampleRequest(model_id="m", prompt_tokens=[1])
    first = producer.submit(request, request_id="req-1")
    again = producer.submit(request, request_id="req-1")
    assert (first.duplicate, again.duplicate) == (False, True)
    assert again.request_id == "req-1" and again.version == first.version
    assert queued(fake, producer, "m") == ["req-1"]


def test_same_request_id_with_another_body_is_rejected(fake, producer):
    producer.submit(SampleRequest(model_id="m", prompt_tokens=[1]), request_id="req-1")
    with pytest.raises(Rejected) as info:
        producer.submit(SampleRequest(model_id="m", prompt_tokens=[2]), request_id="req-1")
    assert info.value.error.status == 409 and info.value.error.code == "idempotency_conflict"
    assert queued(fake, producer, "m") == ["req-1"]


def test_resent_model_seq_id_returns_the_first_request_id(fake, producer):
    op = OptimStepRequest(model_id="m", seq_id=3)
    first = producer.submit(op)
    again = producer.submit(op)  # the SDK retries with a fresh idempotency key: a new request id
    assert again.request_id == first.request_id and again.duplicate
    with pytest.raises(Rejected, match="seq_id=3"):
        producer.submit(ForwardBackwardRequest(model_id="m", seq_id=3, data=[{"model_input": [1]}]))
    assert queued(fake, producer, "m") == [first.request_id]


def test_full_shard_queue_is_a_retryable_rejection_and_enqueues_nothing(fake, producer):
    for i in range(5):
        producer.submit(SampleRequest(model_id="m", prompt_tokens=[i + 1]))
    with pytest.raises(Rejected) as info:
        producer.submit(WeightSyncRequest(model_id="m"))
    assert info.value.error.status == 429 and info.value.error.retryable
    assert len(queued(fake, producer, "m")) == 5
    assert fake.get(keys.model_key("m", "wver")) is None  # no version was consumed


def test_a_duplicate_is_still_answered_when_the_queue_is_full(producer):
    first = producer.submit(SampleRequest(model_id="m", prompt_tokens=[1]), request_id="keep")
    for i in range(4):
        producer.submit(SampleRequest(model_id="m", prompt_tokens=[i + 2]))
    assert producer.submit(SampleRequest(model_id="m", prompt_tokens=[1]), request_id="keep") == \
        type(first)("keep", first.shard, first.version, duplicate=True)


def test_limits_are_checked_before_enqueue(fake, producer):
    with pytest.raises(Rejected) as info:
        producer.submit(SampleRequest(model_id="m", prompt_tokens=[1], num_samples=10_000))
    assert info.value.error.status == 400 and "num_samples" in info.value.error.error
    assert queued(fake, producer, "m") == []


@pytest.mark.parametrize("rid", ["has:colon", "has space", "", "x" * 200, "../x"])
def test_request_ids_must_be_safe_for_keys(producer, rid):
    with pytest.raises(Rejected, match="must match"):
        producer.submit(CreateModelRequest(model_id="m", base_model="b"), request_id=rid)


def test_shard_count_is_fixed_per_deployment(fake, producer):
    with pytest.raises(RuntimeError, match="fixed per deployment"):
        Producer(fake, QueueConfig(num_shards=8))


def test_dashboard_description_does_not_leak_prompts(fake, producer):
    ticket = producer.submit(SampleRequest(model_id="m", prompt_tokens=[31337]))
    assert b"31337" not in fake.hget(f"rq:job:{ticket.request_id}", "description")


def test_submit_many_is_all_or_nothing_and_versions_follow_batch_order(fake, producer):
    tickets = producer.submit_many([
        SampleRequest(model_id="m", prompt_tokens=[1]),
        WeightSyncRequest(model_id="m"),
        SampleRequest(model_id="m", prompt_tokens=[2]),
        OptimStepRequest(model_id="m", seq_id=1),
        OptimStepRequest(model_id="m", seq_id=1),  # the same (model, seq_id) twice: one job
    ])
    assert [t.version for t in tickets[:3]] == [0, 1, 1]
    assert tickets[4].request_id == tickets[3].request_id and tickets[4].duplicate
    assert queued(fake, producer, "m") == [t.request_id for t in tickets[:4]]
    with pytest.raises(Rejected) as info:  # 4 queued + 2 more > depth limit 5: neither is enqueued
        producer.submit_many([SampleRequest(model_id="m", prompt_tokens=[3]), WeightSyncRequest(model_id="m")])
    assert info.value.error.code == "queue_full"
    assert len(queued(fake, producer, "m")) == 4 and fake.get(keys.model_key("m", "wver")) == b"1"


def test_submit_each_decides_every_request_on_its_own_in_one_transaction(fake, producer):
    producer.submit(SampleRequest(model_id="m", prompt_tokens=[1]), request_id="taken")
    outcomes = producer.submit_each(
        [SampleRequest(model_id="m", prompt_tokens=[2]),
         SampleRequest(model_id="m", prompt_tokens=[3], num_samples=10_000),  # over a limit
         SampleRequest(model_id="m", prompt_tokens=[9]),  # a different body under a used request id
         WeightSyncRequest(model_id="m"),
         SampleRequest(model_id="m", prompt_tokens=[1]),  # the same body again: the first ticket
         SampleRequest(model_id="m", prompt_tokens=[4]),
         SampleRequest(model_id="m", prompt_tokens=[5]),
         SampleRequest(model_id="m", prompt_tokens=[6])],  # 1 + 4 queued: the depth limit of 5 is reached
        [None, None, "taken", None, "taken", None, None, None])
    codes = [o.error.code if isinstance(o, Rejected) else "ok" for o in outcomes]
    assert codes == ["ok", "limit_exceeded", "idempotency_conflict", "ok", "ok", "ok", "ok", "queue_full"]
    assert outcomes[4].duplicate and outcomes[4].request_id == "taken"
    assert [outcomes[0].version, outcomes[3].version, outcomes[5].version] == [0, 1, 1]
    assert queued(fake, producer, "m") == ["taken"] + [outcomes[i].request_id for i in (0, 3, 5, 6)]
    assert producer.submit_each([SampleRequest(model_id="m", prompt_tokens=[7], num_samples=10_000)])[0].error.code \
        == "limit_exceeded"  # nothing left to enqueue: no transaction at all


@pytest.mark.parametrize("text", [
    ('["worker.jobs.training_op", null, [{"data": [{"model_input": [1, 2], "loss_fn_inputs": {"w": [1e-05, 0.5]}}]}],'
     ' {}]'),
    '[123456789012345678901234567890, -0.0, 5e-324, 1.7976931348623157e308, 1e400, NaN, -Infinity]',
    '{"a": 1, "a": 2, "\\u00e9": "\\n"}', '["\\ud800"]', "[" * 300 + "]" * 300,
])
def test_job_data_reads_as_json_loads_reads_it(text):
    from tinkerq.jobs import JobSerializer

    assert repr(JobSerializer.loads(text.encode())) == repr(json.loads(text))


@pytest.mark.parametrize("text", ["[1,]", "{", "[1] x", ""])
def test_malformed_job_data_is_refused_as_json_loads_refuses_it(text):
    from tinkerq.jobs import JobSerializer

    with pytest.raises(json.JSONDecodeError):
        JobSerializer.loads(text.encode())


def test_a_submit_after_redis_lost_its_scripts_loads_them_again(r):
    """The read script goes by its sha alone (no SCRIPT EXISTS round trip per submit); after a SCRIPT FLUSH (as after
    a Redis restart) the next submit loads it again and is decided as before."""
    producer = Producer(r, QueueConfig(num_shards=1))
    first = producer.submit(SampleRequest(model_id="m:train:0", prompt_tokens=[1]), request_id="sa-flush-1")
    r.script_flush()
    again = producer.submit(SampleRequest(model_id="m:train:0", prompt_tokens=[1]), request_id="sa-flush-1")
    second = producer.submit(SampleRequest(model_id="m:train:0", prompt_tokens=[2]), request_id="sa-flush-2")
    assert again.request_id == first.request_id and again.duplicate
    assert not second.duplicate and r.llen(producer._queues[0].key) == 2
