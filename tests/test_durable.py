"""A dead worker loses nothing: each model's training journal (worker/journal.py) rebuilds it on any worker
(worker/restore.py), and a standby that takes a shard carries the run on where the dead owner left it."""

import json
import random
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import burst_worker
from producer import Producer
from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    SaveStateRequest,
    WeightSyncRequest,
)
from tinkerq import keys
from tinkerq.config import RuntimeConfig
from worker.fencing import Fence, FencedOut
from worker.journal import Journal
from worker.restore import Restorer
from worker.runtime.factory import build_runtime

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


def torch_runtime(tmp_path: Path):
    return build_runtime(RuntimeConfig(checkpoint_root=str(tmp_path / "ckpt"), runtime="torch"))


def tensors(runtime, model_id: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's training state: adapter weights, their gradients, AdamW's moments."""
    trained = runtime.trainer.models[model_id]
    out = {}
    for i, p in enumerate(trained.params):
        out[f"p{i}"] = p.detach().clone()
        out[f"g{i}"] = p.grad.detach().clone() if p.grad is not None else torch.zeros(0)
        for name, value in trained.optimizer.state.get(p, {}).items():
            out[f"s{i}.{name}"] = torch.as_tensor(value).detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), (name, (a[name] - b[name]).abs().max())


# -- single process -------------------------------------------------------------------------------------------


def test_a_stored_result_and_its_journal_entry_are_one_fenced_write(r, config, tmp_path):
    producer = Producer(r, config)
    model = "journal:train:0"
    tickets = [producer.submit(op) for op in training(model, 1, seed=None, sample=False)]
    tickets.append(producer.submit(SampleRequest(model_id=model, prompt_tokens=[1])))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    assert all(producer.get(t.request_id).type != "error" for t in tickets)
    entries = Journal(r).entries(model)
    # the sample changed nothing: not journaled; the create got the seed the worker picked
    assert [e.kind for e in entries] == ["create_model", "forward_backward", "optim_step", "weight_sync"]
    assert entries[0].lora.seed is not None
    assert entries[3].version == 1
    assert int(r.get(keys.last_seq_key(model))) == 3

    shard = producer.shard_of(model)
    stale = Fence(r, "paused-old-owner", 3000)
    stale.tokens[shard] = "paused-old-owner:1"  # a token the lease no longer holds
    with pytest.raises(FencedOut):
        stale.put_result_journaled(shard, "rid-stale", "{}", 60, "done", keys.journal_key(model), "{}",
                                   keys.last_seq_key(model), 99)
    assert Journal(r).length(model) == 4 and not r.exists(keys.result_key("rid-stale"))
    assert int(r.get(keys.last_seq_key(model))) == 3

    owner = Fence(r, "owner", 3000)
    r.delete(keys.lease_key(shard))
    assert owner.acquire([shard]) == [shard]
    again = owner.put_result_journaled(shard, tickets[1].request_id, "{}", 60, "done", keys.journal_key(model),
                                       "{}", keys.last_seq_key(model), 1)
    assert again == 0 and Journal(r).length(model) == 4  # its result was stored already: nothing appended


@pytest.mark.parametrize("seed", [None, 3])
def test_a_model_rebuilt_from_its_journal_holds_the_same_tensors(r, config, tmp_path, seed):
    producer = Producer(r, config)
    model = "rebuilt:train:0"
    ops = training(model, 3, seed=seed)
    ops.append(ForwardBackwardRequest(model_id=model, seq_id=10, data=[datum(9)]))  # gradients pending
    tickets = [producer.submit(op) for op in ops]
    owner = burst_worker(r, config, tmp_path, runtime="torch")
    owner.run(burst=True, logging_level="WARNING")
    assert all(producer.get(t.request_id).type != "error" for t in tickets), [producer.get(t.request_id) for t in tickets]
    original = owner.dispatcher.runtime

    fresh = torch_runtime(tmp_path)
    assert Restorer(r, fresh, Journal(r)).ensure(model) is None
    assert_same(tensors(original, model), tensors(fresh, model))
    assert fresh.engine.live_versions(model) == original.engine.live_versions(model)


def test_what_cannot_be_rebuilt_is_named(r, config, tmp_path):
    producer = Producer(r, config)
    model, other = "named:train:0", "gone:train:0"
    ops = training(model, 1, sample=False) + [SaveStateRequest(model_id=model, seq_id=4, name="s1")]
    tickets = [producer.submit(op) for op in ops]
    for op in training(other, 1, sample=False):
        producer.submit(op)
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    archive = producer.get(tickets[-1].request_id).path
    load = producer.submit(LoadStateRequest(model_id=model, seq_id=5, path=archive, optimizer=False))
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")
    assert producer.get(load.request_id).type == "load_state"

    Path(archive).unlink()  # the saved state a journaled load_state read is gone
    r.delete(keys.journal_key(other))  # this model's journal is gone
    after = [producer.submit(OptimStepRequest(model_id=model, seq_id=6)),
             producer.submit(OptimStepRequest(model_id=other, seq_id=4))]
    burst_worker(r, config, tmp_path).run(burst=True, logging_level="WARNING")  # a new worker: rebuilds
    lost = [producer.get(t.request_id) for t in after]
    assert [x.code for x in lost] == ["model_state_lost", "model_state_lost"], lost
    assert Path(archive).name in lost[0].error
    assert keys.journal_key(other) in lost[1].error
