"""The lanes: a worker samples while it trains (worker/serving/sampling_lane.py), and keeps the order of conflicting
jobs only. Each test runs with both lanes busy: a sample waits for the weights it is pinned to and for nothing else;
a sync waits for the samples handed over before it; a crash or a stop with both lanes busy loses nothing."""

import signal

import pytest
from redis import Redis

from producer import Producer
from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from support.stack import burst_worker, job_spans, stop_within, wait_until
from support.training import answered, owns_all, training
from tinkerq import keys

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def long_forward_backward(model_id: str, datums: int = 32, tokens: int = 256) -> ForwardBackwardRequest:
    """A forward_backward that takes a CPU long enough (hundreds of ms) for samples to be served inside it."""
    full = [(7 * i) % 200 + 3 for i in range(tokens + 1)]
    datum = Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})
    return ForwardBackwardRequest(model_id=model_id, data=[datum] * datums)


def create(producer: Producer, *models: str) -> None:
    for model in models:
        ticket = producer.submit(CreateModelRequest(model_id=model, base_model="tinyq-micro", lora=LoraConfig(rank=8)))
        assert producer.wait(ticket.request_id, 120).type == "create_model"


def test_another_models_samples_are_served_inside_its_forward_backward(r, config, start_worker):
    """Tenant B's samples, queued behind tenant A's forward_backward on the same shard, start and end while it
    runs: B does not wait for A's op (a worker doing one job at a time served them only after it)."""
    start_worker(TINKERQ_RUNTIME="torch")
    producer = Producer(r, config)
    create(producer, "lanes-a:train:0", "lanes-b:train:0")
    fb = producer.submit(long_forward_backward("lanes-a:train:0"))
    samples = [producer.submit(SampleRequest(model_id="lanes-b:train:0", prompt_tokens=PROMPT,
                                             sampling_params=GREEDY)) for _ in range(6)]
    assert producer.wait(fb.request_id, 120).type == "forward_backward"
    outs = [producer.wait(s.request_id, 60) for s in samples]
    assert all(isinstance(out, SampleOutput) and out.weights_version == 0 for out in outs), outs
    (fb_start, fb_end), *served = job_spans(r, [t.request_id for t in (fb, *samples)])
    inside = [(start, end) for start, end in served if fb_start < start and end < fb_end]
    assert inside, f"forward_backward ran {fb_start}..{fb_end}; no sample ran inside it: {served}"


def test_a_sample_pinned_to_weights_not_yet_synced_waits_for_its_sync(r, config, tmp_path):
    """Queued behind a long training op and the sync it is pinned to, a sample is not taken ahead of its turn
    (it would find no such version yet): it is served on the synced weights."""
    producer = Producer(r, config)
    model = "lanes-pin:train:0"
    producer.submit(CreateModelRequest(model_id=model, base_model="tinyq-micro", lora=LoraConfig(rank=8)))
    producer.submit(long_forward_backward(model, datums=8))
    producer.submit(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=5e-2)))
    sync = producer.submit(WeightSyncRequest(model_id=model))
    pinned = [producer.submit(SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=GREEDY,
                                            weights_version=1)) for _ in range(3)]
    latest = producer.submit(SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=GREEDY))
    burst_worker(r, config, tmp_path, runtime="torch").run(burst=True, logging_level="WARNING")
    assert producer.get(sync.request_id).version == 1
    outs = [producer.get(t.request_id) for t in [*pinned, latest]]
    assert all(isinstance(out, SampleOutput) and out.weights_version == 1 for out in outs), outs


def test_samples_handed_over_before_a_sync_that_evicts_their_weights_are_served_first(r, config, tmp_path):
    """With one snapshot per model, a sync evicts the weights every sample queued before it is pinned to: those the
    RQ loop handed to the sampling lane are served before the sync lands, never answered 'evicted'. Two samples a
    run: the others wait in the lane's inbox when the sync's turn comes."""
    config = config.model_copy(update={"max_batch_requests": 2})
    producer = Producer(r, config)
    model = "lanes-evict:train:0"
    producer.submit(CreateModelRequest(model_id=model, base_model="tinyq-micro", lora=LoraConfig(rank=8)))
    many = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    before = [producer.submit(SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=many,
                                            num_samples=4)) for _ in range(12)]
    sync = producer.submit(WeightSyncRequest(model_id=model))
    after = producer.submit(SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=GREEDY))
    burst_worker(r, config, tmp_path, runtime="torch", max_snapshots=1).run(burst=True, logging_level="WARNING")
    assert producer.get(sync.request_id).version == 1
    outs = [producer.get(t.request_id) for t in before]
    assert all(isinstance(out, SampleOutput) and out.weights_version == 0 for out in outs), outs
    assert producer.get(after.request_id).weights_version == 1


def busy_lanes(r: Redis, producer: Producer, steps: int) -> list:
    """A's training program (each step: forward_backward, optim_step, sync, a sample on the new weights) with B's
    samples between its ops: both lanes have work all along. Returns (request, ticket) pairs in submit order."""
    tickets = []
    for op in training("lanes-a:train:0", steps):
        tickets.append((op, producer.submit(op)))
        if op.kind in ("forward_backward", "optim_step"):
            b = SampleRequest(model_id="lanes-b:train:0", prompt_tokens=PROMPT, sampling_params=GREEDY,
                              weights_version=0)
            tickets.append((b, producer.submit(b)))
    return tickets


def assert_each_answered_as_if_alone(r: Redis, config, producer: Producer, tickets: list, steps: int) -> None:
    outs = answered(producer, tickets, 300)
    errors = [(op.kind, out) for (op, _), out in zip(tickets, outs) if isinstance(out, ErrorResponse)]
    assert not errors, errors
    a_versions = [out.weights_version for (op, _), out in zip(tickets, outs)
                  if op.kind == "sample" and op.model_id.startswith("lanes-a")]
    assert a_versions == list(range(1, steps + 1))  # each of A's samples on the sync just before it
    assert {out.weights_version for (op, _), out in zip(tickets, outs) if op.model_id.startswith("lanes-b")} == {0}
    for shard in range(config.num_shards):  # nothing left queued or in flight: every request ended once
        assert r.llen(keys.queue_key(shard)) == 0 and r.llen(keys.batched_key(shard)) == 0


@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_a_worker_stopped_with_both_lanes_busy_leaves_each_request_one_result(r, config, start_worker, stop):
    """The owner goes (killed, or stopped within seconds) while its training lane runs A's ops and its sampling lane
    B's samples; the standby serves the rest: each request answered once, as if no one had stopped."""
    owner = start_worker(TINKERQ_RUNTIME="torch")
    wait_until(lambda: owns_all(r, config), 120, "the first worker's leases")
    standby = start_worker(TINKERQ_RUNTIME="torch")
    producer = Producer(r, config)
    create(producer, "lanes-b:train:0")
    steps = 6
    tickets = busy_lanes(r, producer, steps)
    wait_until(lambda: sum(r.exists(keys.result_key(t.request_id)) for _, t in tickets) >= len(tickets) // 3, 120,
               "a third of the results")
    if stop == "sigkill":
        owner.kill(signal.SIGKILL)
    else:
        stop_within(owner)
    assert_each_answered_as_if_alone(r, config, producer, tickets, steps)
    assert standby.alive(), standby.output()
