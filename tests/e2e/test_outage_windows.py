"""Redis fails at every Redis command of the worker's loop in turn, once, before the command reaches Redis or after
(its reply lost): every time, the worker rides the outage out and every request is answered exactly once.

A Redis restart or a connection reset can land between any two commands of RQ's loop and of ours; the end-to-end
tests in test_outages.py hit a few such windows per run, at random. Here each window is hit on purpose."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from redis.client import Pipeline, Redis
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from rq.registry import FailedJobRegistry

from producer import Producer
from schemas import CreateModelRequest, SampleOutput, SampleRequest, WeightSyncRequest
from support.stack import burst_worker
from tinkerq import keys

M = "windows:train:0"


class FailOnce:
    """Counts the Redis commands (a pipeline is one) the main thread sends while armed, and fails the `at`-th."""

    def __init__(self, at: int, error: type[Exception], after: bool) -> None:
        self.at, self.error, self.after = at, error, after
        self.count = 0
        self.failed_in: str | None = None

    def wrap(self, send):
        def sent(client, *args, **kwargs):
            if threading.current_thread() is not threading.main_thread() or self.failed_in is not None:
                return send(client, *args, **kwargs)
            self.count += 1
            if self.count != self.at:
                return send(client, *args, **kwargs)
            self.failed_in = str(args[0]) if args else "pipeline"
            if self.after:
                send(client, *args, **kwargs)  # it ran in Redis; the reply never came back
            raise self.error(f"injected at command {self.at}")

        return sent


@contextmanager
def failing(monkeypatch: pytest.MonkeyPatch, plan: FailOnce) -> Iterator[FailOnce]:
    with monkeypatch.context() as patch:
        patch.setattr(Redis, "execute_command", plan.wrap(Redis.execute_command))
        patch.setattr(Pipeline, "execute", plan.wrap(Pipeline.execute))
        yield plan


def submit_run(producer: Producer) -> list[str]:
    """A sample, a weight sync and a sample that must see it."""
    requests = [SampleRequest(model_id=M, prompt_tokens=[3]), WeightSyncRequest(model_id=M),
                SampleRequest(model_id=M, prompt_tokens=[4])]
    return [producer.submit(request).request_id for request in requests]


def commands_of_a_clean_run(r, config, tmp_path, monkeypatch) -> int:
    producer = Producer(r, config)
    producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
    submit_run(producer)
    worker = burst_worker(r, config, tmp_path)
    with failing(monkeypatch, FailOnce(at=0, error=RedisConnectionError, after=False)) as plan:
        worker.run(burst=True, logging_level="WARNING")
    return plan.count


@pytest.mark.parametrize("error", [RedisConnectionError, RedisTimeoutError], ids=["reset", "timeout"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_redis_failing_at_any_command_of_the_loop_is_an_outage_ridden_out(r, config, tmp_path, monkeypatch, error,
                                                                           after):
    n = commands_of_a_clean_run(r, config, tmp_path / "clean", monkeypatch)
    assert n > 20, f"the clean run sent only {n} commands from the main thread"
    for at in range(1, n + 1):
        r.flushdb()
        producer = Producer(r, config)
        producer.submit(CreateModelRequest(model_id=M, base_model="ref"))
        first, sync, last = submit_run(producer)
        plan = FailOnce(at, error, after)
        worker = burst_worker(r, config, tmp_path / str(at))
        with failing(monkeypatch, plan):
            worker.run(burst=True, logging_level="ERROR")
        where = f"failure injected at command {at} of {n} ({plan.failed_in}, {'after' if after else 'before'} it ran)"
        if plan.failed_in is None:
            continue  # this run sent fewer commands (an outage's recovery changes the path); nothing was injected
        for rid in (first, sync, last):
            result = producer.get(rid)
            assert result is not None, f"{rid} unanswered; {where}"
        assert isinstance(producer.get(first), SampleOutput), where
        assert producer.get(sync).type == "weight_sync", where
        outputs = [producer.get(rid) for rid in (first, last)]
        assert all(isinstance(out, SampleOutput) for out in outputs), (outputs, where)
        # the sample queued after the sync is served on its weights (the reference runtime's tokens are the version)
        assert outputs[1].sequences[0].tokens[0] > outputs[0].sequences[0].tokens[0], (outputs, where)
        for shard in range(config.num_shards):
            failed = FailedJobRegistry(keys.queue_name(shard), connection=r)
            assert failed.count == 0, f"jobs marked FAILED for an outage: {failed.get_job_ids()}; {where}"
