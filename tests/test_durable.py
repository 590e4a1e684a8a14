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


# -- worker processes -----------------------------------------------------------------------------------------


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


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


def saved_adapter(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from worker.torch_runtime.checkpoints import extract_archive

    with tempfile.TemporaryDirectory() as tmp:
        return load_file(str(extract_archive(Path(path), Path(tmp) / "x") / "adapter_model.safetensors"))


@pytest.mark.slow
def test_a_run_whose_owner_is_sigkilled_at_a_random_point_ends_as_an_uninterrupted_one(r, config, start_worker):
    seed = random.randrange(1_000_000)
    print(f"kill point seed: {seed}")
    owner = start_worker(TINKERQ_RUNTIME="torch")
    wait_until(lambda: owns_all(r, config), 120, "the first worker's leases")
    standby = start_worker(TINKERQ_RUNTIME="torch")
    producer = Producer(r, config)
    steps = 4
    ops = training("survivor:train:0", steps)
    tickets = [(op, producer.submit(op)) for op in ops]
    kill_after = random.Random(seed).randrange(1, len(ops) - 1)
    print(f"the owner is killed once {kill_after} of {len(ops)} results are stored")
    wait_until(lambda: sum(r.exists(keys.result_key(t.request_id)) for _, t in tickets) >= kill_after, 300,
               f"{kill_after} results")
    owner.kill(signal.SIGKILL)
    outs = answered(producer, tickets, 300)
    assert standby.alive(), standby.output()
    errors = [(op.kind, out) for (op, _), out in zip(tickets, outs) if isinstance(out, ErrorResponse)]
    assert not errors, errors
    versions = [out.weights_version for out in outs if out.type == "sample"]
    assert versions == list(range(1, steps + 1))  # each sample is served on the sync before it, across the kill

    # the same requests, never interrupted (the standby serves them), then both adapters saved and compared
    reference = [(op, producer.submit(op)) for op in training("reference:train:0", steps)]
    assert not [out for out in answered(producer, reference, 300) if isinstance(out, ErrorResponse)]
    saves = [producer.submit(SaveStateRequest(model_id=m, seq_id=3 * steps + 1, name="end"))
             for m in ("survivor:train:0", "reference:train:0")]
    paths = [producer.wait(t.request_id, 120).path for t in saves]
    survivor, uninterrupted = (saved_adapter(p) for p in paths)
    assert survivor.keys() == uninterrupted.keys() and survivor
    for name in survivor:
        assert torch.allclose(survivor[name], uninterrupted[name], atol=1e-5), name
    assert any(bool(v.abs().sum() > 0) for k, v in survivor.items() if "lora_B" in k)  # trained (B starts at 0)
    assert "survivor:train:0: replaying journal entries" in standby.output()  # it was rebuilt there
    for shard in range(config.num_shards):  # nothing left queued or in flight: every request ended once
        assert r.llen(keys.queue_key(shard)) == 0 and r.llen(keys.inflight_key(shard)) == 0


@pytest.mark.slow
def test_a_persisted_snapshot_is_sampled_through_the_sdk_after_its_owner_is_sigkilled(r, config, start_worker,
                                                                                      start_api):
    import os

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    owner = start_worker(TINKERQ_RUNTIME="torch")
    wait_until(lambda: owns_all(r, config), 120, "the first worker's leases")
    standby = start_worker(TINKERQ_RUNTIME="torch")
    api = start_api()
    client = tinker.ServiceClient(base_url=api.url, api_key="tml-test-key")
    trainer = client.create_lora_training_client(base_model=BASE, rank=4, seed=0)
    full = PROMPT + [40, 41, 42, 43]
    data = [types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:]})]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = trainer.save_weights_for_sampler("before-the-kill").result().path
    params = types.SamplingParams(max_tokens=4, temperature=0)
    before = client.create_sampling_client(model_path=path).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result()
    owner.kill(signal.SIGKILL)
    after = client.create_sampling_client(model_path=path).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result()
    assert list(after.sequences[0].tokens) == list(before.sequences[0].tokens)
    assert standby.alive(), standby.output()
    client.close("success").result()
