"""A client's load on a live worker, for the outage and shutdown tests: requests over four models on four shards,
each resent under its request id until a submit returns (what counts as acknowledged), and the busy worker that
serves them."""

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from producer import Producer
from schemas import CreateModelRequest, Request, SampleRequest, WeightSyncRequest, new_request_id
from support.stack import WorkerProc
from tinkerq.config import QueueConfig

CONFIG = QueueConfig(num_shards=4, lease_ttl_ms=3000)
MODELS = [f"outage:train:{i}" for i in range(4)]


@dataclass
class Sent:
    rid: str
    request: Request
    version: int | None = None


def connect(url: str) -> Redis:
    # a short socket timeout: a frozen server fails calls instead of hanging the test
    return Redis.from_url(url, socket_timeout=3, socket_connect_timeout=1)


def submit_until_acknowledged(producer: Producer, sent: Sent, stop: threading.Event) -> bool:
    """A client's retry loop: resend under the same request id until a submit returns (idempotent)."""
    while not stop.is_set():
        try:
            sent.version = producer.submit(sent.request, sent.rid).version
            return True
        except RedisError:
            time.sleep(0.1)
    return False


class Load(threading.Thread):
    """Samples (and every 10th a weight sync) over four models on four shards, paced so the outage hits
    mid-stream; `acked` holds each request whose submit returned."""

    def __init__(self, url: str, count: int, pace_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.producer = Producer(connect(url), CONFIG)
        self.count, self.pace_s = count, pace_s
        self.acked: list[Sent] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for i in range(self.count):
            model = MODELS[i % len(MODELS)]
            request = WeightSyncRequest(model_id=model) if i % 10 == 9 else SampleRequest(
                model_id=model, prompt_tokens=[1, 2, 3])
            sent = Sent(new_request_id(request.kind[:2]), request)
            if not submit_until_acknowledged(self.producer, sent, self.stop):
                return
            self.acked.append(sent)
            time.sleep(self.pace_s)

    def finish(self, timeout_s: float = 120) -> list[Sent]:
        self.join(timeout_s)
        self.stop.set()
        self.join(10)
        assert len(self.acked) == self.count, f"only {len(self.acked)} of {self.count} submits returned"
        return self.acked



def loaded_worker(url: str, tmp_path: Path, **env: str) -> WorkerProc:
    """A reference-runtime worker whose engine runs take ~30 ms (busy), with MODELS created."""
    proc = WorkerProc(url, {
        "TINKERQ_RUNTIME": "reference",
        "TINKERQ_NUM_SHARDS": str(CONFIG.num_shards),
        "TINKERQ_LEASE_TTL_MS": str(CONFIG.lease_ttl_ms),
        "TINKERQ_CHECKPOINT_ROOT": str(tmp_path),
        "TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": "0.002",  # each engine run takes ~30 ms: the worker is busy
        **env,
    })
    r = connect(url)
    producer = Producer(r, CONFIG)
    for model in MODELS:
        out = producer.wait(producer.submit(CreateModelRequest(model_id=model, base_model="ref")).request_id, 60)
        assert out is not None and out.type == "create_model", proc.output()
    producer.close()
    return proc

