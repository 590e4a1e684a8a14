"""A standby warms the base models it may have to serve before it owns a shard (TINKERQ_PRELOAD_BASES).

Real Redis, the real torch runtime (its PyTorch engine, and vLLM's where it imports), the worker's own loop in a
thread; every shard is held by another lease holder, so the worker under test stays a standby throughout. What is
checked is the runtime's own state (the trainer's loaded bases, vLLM's engines), not a stand-in.
"""

import importlib.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis

from producer import Producer
from schemas import CreateModelRequest, LoraConfig
from support.stack import wait_until
from tinkerq import keys
from tinkerq.config import QueueConfig, RuntimeConfig
from worker.main import WorkerProcess
from worker.runtime import DomainError
from worker.runtime.registry import build_runtime
from worker.shards.fencing import Fence

BASE = "tinyq-micro"
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                   reason="vLLM is not installed"))]


@contextmanager
def every_shard_owned(r: Redis, config: QueueConfig) -> Iterator[Fence]:
    """Another worker's leases on every shard, kept alive until the block ends."""
    owner = Fence(r, "the-owner", config.lease_ttl_ms)
    assert owner.acquire(list(range(config.num_shards))) == list(range(config.num_shards))
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(config.lease_ttl_ms / 3000):
            owner.renew()

    keeper = threading.Thread(target=renew, daemon=True)
    keeper.start()
    try:
        yield owner
    finally:
        stop.set()
        keeper.join(5)
        owner.release()


@contextmanager
def standby(r: Redis, config: QueueConfig, tmp_path: Path, engine: str) -> Iterator[WorkerProcess]:
    runtime = build_runtime(RuntimeConfig(runtime="torch", engine=engine, checkpoint_root=str(tmp_path / "ckpt")))
    worker = WorkerProcess(r, runtime, config)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        runtime.engine.close()
        assert not thread.is_alive(), "the standby did not stop"


def warm(worker: WorkerProcess, base: str) -> bool:
    """The base is loaded in the trainer and its engine is up (vLLM's engine object, or the shared torch model)."""
    runtime = worker.dispatcher.runtime
    engine_ready = base in runtime.engine.llms if hasattr(runtime.engine, "llms") else True
    return runtime.trainer.bases.loaded(base) is not None and engine_ready


@pytest.mark.parametrize("engine", ENGINES)
def test_a_standby_warms_the_named_bases_before_it_owns_a_shard(r: Redis, tmp_path: Path, engine: str) -> None:
    config = QueueConfig(num_shards=4, lease_ttl_ms=3000, preload_bases=BASE)
    with every_shard_owned(r, config), standby(r, config, tmp_path, engine) as worker:
        wait_until(lambda: warm(worker, BASE), 120, f"{BASE} warmed by the standby")
        assert not worker.fence.tokens  # still a standby: the warming did not wait for a shard


def test_auto_warms_the_bases_of_the_models_on_the_shards_it_may_take(r: Redis, tmp_path: Path, config: QueueConfig,
                                                                      start_worker) -> None:
    """The default: a model created on a shard by its owner (a real worker process) makes a standby of that shard
    warm the model's base, though the model was created after the standby started."""
    assert config.preload_bases == "auto"
    owner = start_worker()
    wait_until(lambda: all(r.exists(keys.lease_key(s)) for s in range(config.num_shards)), 30, "the owner's leases")
    with standby(r, config, tmp_path, "torch") as worker:
        wait_until(lambda: worker.preloader.wanted() == [], 10, "the standby's first look")
        assert worker.dispatcher.runtime.trainer.bases.loaded(BASE) is None  # no model on any shard yet
        producer = Producer(r, config)
        ticket = producer.submit(CreateModelRequest(model_id="warm-me", base_model=BASE, lora=LoraConfig(rank=4)))
        assert producer.wait(ticket.request_id, 30).type == "create_model"
        shard = keys.shard_of("warm-me", config.num_shards)
        assert r.hget(keys.shard_bases_key(shard), BASE) == b"warm-me"
        wait_until(lambda: warm(worker, BASE), 120, f"{BASE} warmed by the standby")
        assert not worker.fence.tokens and owner.alive()


def test_none_warms_nothing_and_a_named_base_not_served_is_refused(r: Redis, tmp_path: Path) -> None:
    runtime = build_runtime(RuntimeConfig(runtime="torch", engine="torch", checkpoint_root=str(tmp_path)))
    config = QueueConfig(num_shards=4, lease_ttl_ms=3000, preload_bases="none")
    assert WorkerProcess(r, runtime, config).preloader.warm() == []
    wrong = QueueConfig(num_shards=4, lease_ttl_ms=3000, preload_bases="auto,no-such-base")
    with pytest.raises(DomainError, match="no-such-base"):
        WorkerProcess(r, runtime, wrong).preloader.warm()
    assert runtime.trainer.bases.loaded(BASE) is None
