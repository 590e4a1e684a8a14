"""A training program as a client sends it, and waiting for its answers as a client does (resubmitting what comes
back retryable): what the durability, drain and rebalancing tests drive a worker with."""

import time

from producer import Producer
from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq import keys

BASE = "tinyq-micro"
PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def datum(step: int) -> Datum:
    full = PROMPT + [40 + step % 7, 41, 42, 43]
    return Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]],
                                                        "weights": [0.0] * 3 + [1.0] * 4})


def training(model_id: str, steps: int, seed: int | None = 7, sample: bool = True) -> list:
    """create, then per step forward_backward + optim_step + a transient sync (+ a greedy sample)."""
    ops: list = [CreateModelRequest(model_id=model_id, base_model=BASE, lora=LoraConfig(rank=4, seed=seed))]
    for step in range(steps):
        ops += [ForwardBackwardRequest(model_id=model_id, seq_id=3 * step + 1, data=[datum(step)]),
                OptimStepRequest(model_id=model_id, seq_id=3 * step + 2, adam_params=AdamParams(learning_rate=1e-2)),
                WeightSyncRequest(model_id=model_id, seq_id=3 * step + 3)]
        if sample:
            ops.append(SampleRequest(model_id=model_id, prompt_tokens=PROMPT, sampling_params=GREEDY))
    return ops


def owns_all(r, config) -> bool:
    """Every shard is leased (by the one worker started so far)."""
    return all(r.exists(keys.lease_key(s)) for s in range(config.num_shards))


def answered(producer: Producer, tickets: list, timeout: float) -> list:
    """Each ticket's result; a retryable error is submitted again (as a client does) until it is served."""
    outs = []
    deadline = time.monotonic() + timeout
    for op, ticket in tickets:
        while True:
            out = producer.wait(ticket.request_id, max(1.0, deadline - time.monotonic()))
            assert out is not None, f"no result for {op.kind} {ticket.request_id} within {timeout}s"
            if not (isinstance(out, ErrorResponse) and out.retryable) or time.monotonic() > deadline:
                break
            print(f"retrying {op.kind} after {out.code}")
            ticket = producer.submit(op)
        outs.append(out)
    return outs

