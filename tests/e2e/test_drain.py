"""`tinkerq shards` and `tinkerq drain WORKER`, against real worker processes and a real Redis."""

import json
import os
import subprocess
import sys
import time

from producer import Producer
from schemas import ErrorResponse, SampleRequest, SamplingParams
from support.stack import ROOT, wait_until
from support.training import answered, owns_all, training
from tinkerq import keys
from worker.durability.journal import Journal


def cli(redis_url: str, config, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKERQ_NUM_SHARDS": str(config.num_shards), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "commands.cli", *args, "--redis-url", redis_url], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def shard_table(redis_url: str, config) -> list[dict]:
    done = cli(redis_url, config, "shards", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_shards_lists_owner_epoch_depths_and_models(r, redis_url, config, start_worker):
    producer = Producer(r, config)
    models = [f"listed{i}:train:0" for i in range(6)]
    for model in models:
        for op in training(model, 1, sample=False):
            producer.submit(op)
    before = shard_table(redis_url, config)  # no worker yet: everything queued, nothing owned
    depth = {s: sum(1 for m in models if producer.shard_of(m) == s) * 4 for s in range(config.num_shards)}
    assert [row["queued"] for row in before] == [depth[s] for s in range(config.num_shards)]
    assert all(row["owner"] is None and row["models"] == 0 and row["in_flight"] == 0 for row in before)

    start_worker()
    wait_until(lambda: owns_all(r, config), 60, "the worker's leases")
    wait_until(lambda: all(row["queued"] == 0 for row in shard_table(redis_url, config)), 60, "empty queues")
    wait_until(lambda: sum(row["models"] for row in shard_table(redis_url, config)) == len(models), 30, "models")
    after = shard_table(redis_url, config)
    owners = {row["owner"] for row in after}
    assert len(owners) == 1 and None not in owners
    assert all(row["epoch"] >= 1 for row in after)
    for row in after:
        assert row["models"] == sum(1 for m in models if producer.shard_of(m) == row["shard"])
        assert row["queue"] == keys.queue_name(row["shard"])
    table = cli(redis_url, config, "shards").stdout.splitlines()
    assert table[0].split() == ["shard", "queue", "owner", "epoch", "queued", "in_flight", "held", "models"]
    assert len(table) == 1 + config.num_shards and owners.pop() in table[1]


def test_drain_checkpoints_releases_and_the_standby_carries_on(r, redis_url, config, start_worker):
    producer = Producer(r, config)
    slow = {"TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": "0.2"}  # 0.8 s a sample: the drain lands mid-run
    first = start_worker(**slow)
    wait_until(lambda: owns_all(r, config), 60, "the first worker's leases")
    name = shard_table(redis_url, config)[0]["owner"]
    standby = start_worker(**slow)
    model = "drained:train:0"
    steps = 6
    ops = training(model, steps)
    before = [(op, producer.submit(op)) for op in ops[:9]]  # two steps served by the first worker
    served = answered(producer, before, 60)
    assert not [out for out in served if isinstance(out, ErrorResponse)]
    # the rest arrives with the drain: some of it is served by the draining worker, the rest by the standby
    after = [(op, producer.submit(op)) for op in ops[9:]]
    started = time.monotonic()
    done = cli(redis_url, config, "drain", name, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert first.proc.wait(timeout=30) == 0, first.output()
    print(f"drained in {time.monotonic() - started:.1f} s: {done.stdout.strip()}")
    outs = answered(producer, after, 120)
    assert not [out for out in outs if isinstance(out, ErrorResponse)], outs
    assert standby.alive(), standby.output()
    wait_until(lambda: all(row["owner"] not in (None, name) for row in shard_table(redis_url, config)), 30,
               "the standby owning every shard")

    # the drain made the model durable: the standby loaded its checkpoint, and carried on as the first would have
    samples = [out for (op, _), out in zip(before + after, served + outs) if op.kind == "sample"]
    assert [s.weights_version for s in samples] == list(range(1, steps + 1))
    assert [s.sequences[0].logprobs[0] for s in samples] == [-1.0 / (1 + step) for step in range(1, steps + 1)]
    journal = Journal(r)
    assert journal.length(model) == 1 + 3 * steps and journal.checkpoint(model) is not None, first.output()
    assert "drained: 1 model(s) checkpointed" in first.output()
    extra = producer.submit(SampleRequest(model_id=model, prompt_tokens=[1],
                                          sampling_params=SamplingParams(max_tokens=1)))
    assert producer.wait(extra.request_id, 30).weights_version == steps
    assert f"model {model}: loading its checkpoint" in standby.output()
    assert "replaying journal entries 0.." not in standby.output()  # it did not start over from create_model
    for shard in range(config.num_shards):  # every request ended once: nothing queued or in flight
        assert r.llen(keys.queue_key(shard)) == 0 and r.llen(keys.batched_key(shard)) == 0


def test_drain_refuses_a_worker_that_does_not_exist(redis_url, r, config):
    done = cli(redis_url, config, "drain", "no-such-worker", "--timeout", "2")
    assert done.returncode == 2 and "no worker named" in done.stderr
