"""A dead worker loses nothing: each model's training journal (worker/durability/journal.py) rebuilds it on any worker
(worker/durability/restore.py), and a standby that takes a shard carries the run on where the dead owner left it."""

import random
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from producer import Producer
from schemas import (
    AdamParams,
    ErrorResponse,
    ForwardBackwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    SampleRequest,
    SaveStateRequest,
    WeightSyncRequest,
)
from support.stack import burst_worker, wait_until
from support.training import BASE, GREEDY, PROMPT, answered, datum, owns_all, training
from tinkerq import keys
from tinkerq.config import QueueConfig, RuntimeConfig
from worker.durability.journal import Journal
from worker.durability.restore import Restorer
from worker.runtime.registry import build_runtime
from worker.shards.fencing import Fence, FencedOut


def torch_runtime(tmp_path: Path):
    return build_runtime(RuntimeConfig(checkpoint_root=str(tmp_path / "ckpt"), runtime="torch", engine="torch"))


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
                                   keys.last_seq_key(model), 99, keys.journal_base_key(model))
    assert Journal(r).length(model) == 4 and not r.exists(keys.result_key("rid-stale"))
    assert int(r.get(keys.last_seq_key(model))) == 3

    owner = Fence(r, "owner", 3000)
    r.delete(keys.lease_key(shard))
    assert owner.acquire([shard]) == [shard]
    again = owner.put_result_journaled(shard, tickets[1].request_id, "{}", 60, "done", keys.journal_key(model),
                                       "{}", keys.last_seq_key(model), 1, keys.journal_base_key(model))
    assert again == 0 and Journal(r).length(model) == 4  # its result was stored already: nothing appended


def with_period(config: QueueConfig, every: int) -> QueueConfig:
    return QueueConfig(**{**config.model_dump(), "durable_every": every})


@pytest.mark.parametrize(("seed", "every"), [(None, 0), (3, 0), (3, 2)])
def test_a_model_rebuilt_from_its_journal_holds_the_same_tensors(r, config, tmp_path, seed, every):
    config = with_period(config, every)
    producer = Producer(r, config)
    model = "rebuilt:train:0"
    ops = training(model, 3, seed=seed)
    ops.append(ForwardBackwardRequest(model_id=model, seq_id=10, data=[datum(9)]))  # gradients pending
    tickets = [producer.submit(op) for op in ops]
    owner = burst_worker(r, config, tmp_path, runtime="torch")
    owner.run(burst=True, logging_level="WARNING")
    assert all(producer.get(t.request_id).type != "error" for t in tickets), [
        producer.get(t.request_id) for t in tickets]
    original = owner.dispatcher.runtime
    journal = Journal(r)
    assert journal.length(model) == 1 + 3 * 3 + 1
    # with a period of 2 steps, the checkpoint after step 2 replaced the 6 entries up to it
    assert journal.listed(model) == (5 if every else 11)
    assert (journal.checkpoint(model) is not None) == bool(every)

    fresh = torch_runtime(tmp_path)
    assert Restorer(r, fresh, journal).ensure(model) is None
    assert_same(tensors(original, model), tensors(fresh, model))
    assert fresh.engine.live_versions(model) == original.engine.live_versions(model)


def test_a_checkpoint_holds_pending_gradients_and_every_live_snapshot(r, config, tmp_path):
    producer = Producer(r, config)
    model = "whole:train:0"
    ops = training(model, 5, seed=4) + [ForwardBackwardRequest(model_id=model, seq_id=16, data=[datum(3)])]
    tickets = [producer.submit(op) for op in ops]
    owner = burst_worker(r, config, tmp_path, runtime="torch")
    owner.run(burst=True, logging_level="WARNING")
    assert all(producer.get(t.request_id).type != "error" for t in tickets)
    owner.fence.acquire(list(range(config.num_shards)))  # the burst run released its leases
    assert owner.dispatcher.make_durable(list(range(config.num_shards))) == 1  # what a drain does
    journal = Journal(r)
    assert journal.listed(model) == 0 and journal.length(model) == 17
    checkpoint = journal.checkpoint(model)
    assert Path(checkpoint.path).is_file() and checkpoint.applied == 5

    fresh = torch_runtime(tmp_path)
    assert Restorer(r, fresh, journal).ensure(model) is None
    original = owner.dispatcher.runtime
    assert_same(tensors(original, model), tensors(fresh, model))
    assert fresh.engine.live_versions(model) == original.engine.live_versions(model) == [2, 3, 4, 5]
    greedy = SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=GREEDY)
    for version in (2, 5):  # each live snapshot is the weights it was synced from, not the trainer's current ones
        pinned = greedy.model_copy(update={"weights_version": version})
        a, b = original.sample([pinned])[0], fresh.sample([pinned])[0]
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)


def test_a_checkpoint_covering_no_optim_step_is_recorded_and_its_file_kept(r, config, tmp_path):
    """A shard released (or drained) after a forward_backward but no optim_step since the last checkpoint: the
    checkpoint covers no optim_step. Its record once failed half-way in Redis (after the trim and the record) and the
    worker deleted the file it had just recorded: every later takeover lost the model (seen in test_balance)."""
    producer = Producer(r, config)
    model = "nostep:train:0"
    tickets = [producer.submit(op) for op in training(model, 1, sample=False)]
    owner = burst_worker(r, config, tmp_path)
    owner.run(burst=True, logging_level="WARNING")
    shards = list(range(config.num_shards))
    owner.fence.acquire(shards)  # the burst run released its leases
    assert owner.dispatcher.make_durable(shards) == 1
    tickets.append(producer.submit(ForwardBackwardRequest(model_id=model, seq_id=4, data=[datum(1)])))
    owner.run(burst=True, logging_level="WARNING")
    assert all(producer.get(t.request_id).type != "error" for t in tickets)
    owner.fence.acquire(shards)
    assert owner.dispatcher.make_durable(shards) == 1
    journal = Journal(r)
    checkpoint = journal.checkpoint(model)
    assert journal.listed(model) == 0 and Path(checkpoint.path).is_file(), checkpoint
    assert journal.steps_since_checkpoint(model) == 0
    assert Restorer(r, build_runtime(RuntimeConfig(runtime="reference", checkpoint_root=str(tmp_path / "ckpt"))),
                    journal).ensure(model) is None


def test_a_checkpoint_is_written_off_the_step_and_trims_the_journal_only_once_the_file_is_whole(r, config, tmp_path,
                                                                                               monkeypatch):
    """TINKERQ_DURABLE_ASYNC: the step that makes a checkpoint due copies the state and returns; the file is written
    on a side thread while the next steps run (held here until the test lets it finish), and the journal keeps
    every entry until it is complete and recorded. What it holds is the state at its step, not at its write."""
    import threading

    import worker.torch_runtime.trainer as trainer_module

    gate, entered, writers, problems = threading.Event(), threading.Event(), [], []
    real_write = trainer_module.write_archive

    def held_write(source, target, compress=True):  # the real write, once the test allows
        writers.append(threading.current_thread())
        entered.set()
        gate.wait(60)
        return real_write(source, target, compress)

    monkeypatch.setattr(trainer_module, "write_archive", held_write)
    config = with_period(config, 2)
    assert config.durable_async
    producer = Producer(r, config)
    model = "async:train:0"
    journal = Journal(r)
    ops = training(model, 3, seed=5, sample=False)  # the checkpoint falls due at step 2's optim_step (entry 5)
    tickets = [producer.submit(op) for op in ops]

    def while_written() -> None:
        try:
            assert entered.wait(120), "no checkpoint write began"
            # the step's result is published and the steps after it run while the file is being written ...
            wait_until(lambda: journal.length(model) == 10, 60, "step 3 journaled during the write")
            assert producer.get(tickets[5].request_id).type == "optim_step"
            # ... and the journal keeps every entry: nothing is trimmed before the file is complete and recorded
            assert journal.listed(model) == 10 and journal.checkpoint(model) is None
            assert not list((tmp_path / "ckpt").rglob("j6-*.tar"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's own thread
            problems.append(exc)
        finally:
            gate.set()

    watcher = threading.Thread(target=while_written, daemon=True)
    watcher.start()
    owner = burst_worker(r, config, tmp_path, runtime="torch", engine="torch")
    owner.run(burst=True, logging_level="WARNING")  # its stop waits for the write in flight
    watcher.join(10)
    assert not problems, problems
    assert writers and all(t is not threading.main_thread() for t in writers)  # never on the step's thread
    assert all(producer.get(t.request_id).type != "error" for t in tickets)
    checkpoint = journal.checkpoint(model)
    assert checkpoint is not None and Path(checkpoint.path).is_file() and Path(checkpoint.path).name.startswith("j6-")
    assert journal.length(model) == 10 and journal.listed(model) == 4  # step 2's sync and step 3 stay
    assert journal.steps_since_checkpoint(model) == 1

    fence = Fence(r, "owner", 3000)
    shard = producer.shard_of(model)
    assert fence.acquire([shard]) == [shard]
    # an older checkpoint (entries up to 4) recorded after it would drop nothing and replace nothing
    assert not fence.trim_journal(shard, journal.key(model), journal.base_key(model), 4,
                                  checkpoint.model_dump_json(), 1)
    fence.release()

    fresh = torch_runtime(tmp_path)
    assert Restorer(r, fresh, journal).ensure(model) is None  # the checkpoint (step 2), then the tail (step 3)
    assert_same(tensors(owner.dispatcher.runtime, model), tensors(fresh, model))
    assert fresh.engine.live_versions(model) == owner.dispatcher.runtime.engine.live_versions(model)


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


def test_an_evicted_persisted_snapshot_is_read_back_from_its_archive(r, config, tmp_path):
    producer = Producer(r, config)
    model = "archived:train:0"
    ops = training(model, 1, seed=5, sample=False)
    ops[-1] = WeightSyncRequest(model_id=model, seq_id=3, name="keep")  # version 1, with an archive
    for step in range(1, 6):  # five more steps, each synced: version 1 is evicted from the engine (4 live)
        ops += [ForwardBackwardRequest(model_id=model, seq_id=3 * step + 1, data=[datum(step)]),
                OptimStepRequest(model_id=model, seq_id=3 * step + 2, adam_params=AdamParams(learning_rate=1e-2)),
                WeightSyncRequest(model_id=model, seq_id=3 * step + 3)]
    pinned = SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=GREEDY, weights_version=1)
    first = producer.submit(ops[0])
    owner = burst_worker(r, config, tmp_path, runtime="torch")
    for op in ops[1:4]:
        producer.submit(op)
    before = producer.submit(pinned)  # served while version 1 is live
    for op in ops[4:]:
        producer.submit(op)
    owner.run(burst=True, logging_level="WARNING")
    assert producer.get(first.request_id).type == "create_model"
    expected = producer.get(before.request_id)
    assert expected.type == "sample" and expected.weights_version == 1
    assert 1 not in owner.dispatcher.runtime.engine.live_versions(model)

    again = producer.submit(pinned)  # on the same worker: read back from the archive instead of a 410
    owner.run(burst=True, logging_level="WARNING")
    # on a worker that never held it (the owner died): rebuilt from the journal, then read back the same way
    lost = producer.submit(pinned)
    burst_worker(r, config, tmp_path, runtime="torch").run(burst=True, logging_level="WARNING")
    for ticket in (again, lost):
        out = producer.get(ticket.request_id)
        assert out.type == "sample", out
        assert out.weights_version == 1 and out.sequences[0].tokens == expected.sequences[0].tokens
        assert out.sequences[0].logprobs == pytest.approx(expected.sequences[0].logprobs, abs=1e-5)

    archive = r.hget(keys.snapshots_key(model), "1").decode()
    Path(archive).unlink()  # the archive is gone too: an explicit 410 naming it
    gone = producer.submit(pinned)
    burst_worker(r, config, tmp_path, runtime="torch").run(burst=True, logging_level="WARNING")
    out = producer.get(gone.request_id)
    assert out.code == "snapshot_evicted" and archive in out.error


# -- worker processes -----------------------------------------------------------------------------------------


def saved_adapter(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from worker.torch_runtime.checkpoints import extract_archive

    with tempfile.TemporaryDirectory() as tmp:
        return load_file(str(extract_archive(Path(path), Path(tmp) / "x") / "adapter_model.safetensors"))


def sigkilled_run(r, config, start_worker, steps: int, **env: str) -> None:
    """A run whose owner is SIGKILLed at a random point ends, on the standby, with the adapter of an uninterrupted
    run of the same requests."""
    seed = random.randrange(1_000_000)
    print(f"kill point seed: {seed}")
    owner = start_worker(TINKERQ_RUNTIME="torch", **env)
    wait_until(lambda: owns_all(r, config), 120, "the first worker's leases")
    standby = start_worker(TINKERQ_RUNTIME="torch", **env)
    producer = Producer(r, config)
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

    assert_as_uninterrupted(producer, steps)
    rebuilt = ("survivor:train:0: replaying journal entries", "survivor:train:0: loading its checkpoint")
    assert any(line in standby.output() for line in rebuilt)  # it was rebuilt there
    for shard in range(config.num_shards):  # nothing left queued or in flight: every request ended once
        assert r.llen(keys.queue_key(shard)) == 0 and r.llen(keys.batched_key(shard)) == 0


def assert_as_uninterrupted(producer: Producer, steps: int) -> None:
    """survivor:train:0's adapter equals that of the same requests never interrupted (served by the live worker)."""
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


@pytest.mark.slow
def test_a_run_whose_owner_is_sigkilled_at_a_random_point_ends_as_an_uninterrupted_one(r, config, start_worker):
    sigkilled_run(r, config, start_worker, 4, TINKERQ_DURABLE_EVERY="0")
    assert Journal(r).listed("survivor:train:0") == 1 + 3 * 4  # no checkpoint: every entry since create_model


@pytest.mark.slow
def test_a_run_longer_than_the_checkpoint_period_survives_a_sigkill_with_its_journal_bounded(r, config,
                                                                                            start_worker):
    sigkilled_run(r, config, start_worker, 7, TINKERQ_DURABLE_EVERY="2")
    journal = Journal(r)
    for model in ("survivor:train:0", "reference:train:0"):
        assert journal.length(model) == 1 + 3 * 7
        # at most one period of entries since the last checkpoint (after step 6): its sync, then step 7's three ops
        assert journal.listed(model) <= 3 * 2, journal.listed(model)
        latest = Path(journal.checkpoint(model).path)
        assert [p.name for p in latest.parent.iterdir()] == [latest.name]  # the ones it replaced are deleted


@pytest.mark.slow
def test_an_owner_sigkilled_while_it_writes_a_checkpoint_leaves_the_whole_journal(r, config, start_worker, tmp_path):
    """The write off the step (TINKERQ_DURABLE_ASYNC) cut off by SIGKILL: the results it covers are published, yet
    nothing was trimmed, so the standby rebuilds the model from the whole journal and the run ends as an
    uninterrupted one."""
    from support.faulty_runtime import HOLD_WRITES

    hold = tmp_path / "hold-writes"
    hold.mkdir()
    (hold / "hold").touch()
    owner = start_worker(TINKERQ_RUNTIME="support.faulty_runtime:held_writes", TINKERQ_DURABLE_EVERY="2",
                         **{HOLD_WRITES: str(hold)})
    wait_until(lambda: owns_all(r, config), 120, "the first worker's leases")
    standby = start_worker(TINKERQ_RUNTIME="torch", TINKERQ_DURABLE_EVERY="2")
    producer, journal, model = Producer(r, config), Journal(r), "survivor:train:0"
    tickets = [(op, producer.submit(op)) for op in training(model, 4)]
    wait_until(lambda: (hold / "writing").exists(), 300, "the owner's checkpoint write (after step 2)")
    wait_until(lambda: journal.length(model) >= 8, 120, "step 3 journaled while the write is held")
    owner.kill(signal.SIGKILL)
    assert journal.checkpoint(model) is None and journal.listed(model) == journal.length(model)
    assert not list(tmp_path.rglob("durable/j*.tar"))  # no checkpoint file was completed

    outs = answered(producer, tickets, 300)
    assert standby.alive(), standby.output()
    assert not [out for out in outs if isinstance(out, ErrorResponse)]
    assert [out.weights_version for out in outs if out.type == "sample"] == [1, 2, 3, 4]
    assert f"{model}: replaying journal entries 0.." in standby.output()  # from create_model: nothing was trimmed
    assert_as_uninterrupted(producer, 4)
    assert journal.length(model) == 1 + 3 * 4


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
