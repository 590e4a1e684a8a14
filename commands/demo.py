"""`tinkerq demo`: a worker plus a producer-side loop, on an embedded Redis when none is configured."""

import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

from redis import Redis

from commands.processes import TinkerqProc
from commands.redis_server import EmbeddedRedis
from producer import Producer
from schemas import (
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    OptimStepRequest,
    Result,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import QueueConfig


def start_worker(redis_url: str, runtime: str, workdir: Path) -> TinkerqProc:
    env = {"TINKERQ_RUNTIME": runtime, "TINKERQ_CHECKPOINT_ROOT": str(workdir / "checkpoints")}
    return TinkerqProc(["worker", "--redis-url", redis_url], env, workdir)


def wait_ok(producer: Producer, request_id: str, timeout: float = 600) -> Result:
    """The request's output; raises if it failed or did not come within `timeout` seconds."""
    result = producer.wait(request_id, timeout)
    if result is None:
        raise TimeoutError(f"no result for {request_id} within {timeout}s")
    if result.type == "error":
        raise RuntimeError(f"{request_id} failed: {result.code}: {result.error}")
    return result


def ordering_demo(producer: Producer, steps: int) -> None:
    """Reference runtime: every sampled token is the weights version that served it."""
    model = "demo:train:0"
    wait_ok(producer, producer.submit(CreateModelRequest(model_id=model, base_model="reference")).request_id)
    print(f"{'step':>4}  {'sync v':>6}  tokens of 4 samples enqueued before that sync (token = version that served it)")
    for step in range(steps):
        samples = [producer.submit(SampleRequest(model_id=model, prompt_tokens=[1, 2, 3], num_samples=2,
                                                 sampling_params=SamplingParams(max_tokens=3))) for _ in range(4)]
        seq = 2 * step + 1
        producer.submit(ForwardBackwardRequest(model_id=model, seq_id=seq, data=[Datum(model_input=[1, 2, 3])]))
        producer.submit(OptimStepRequest(model_id=model, seq_id=seq + 1))
        sync = producer.submit(WeightSyncRequest(model_id=model))
        outs = [wait_ok(producer, s.request_id) for s in samples]
        synced = wait_ok(producer, sync.request_id)
        tokens = " ".join(str(o.sequences[0].tokens) for o in outs)
        print(f"{step:>4}  {synced.version:>6}  {tokens}")


def run(runtime: str, steps: int, workdir: Path, model: str = "tinyq-micro") -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL")
        if not url:
            url = stack.enter_context(EmbeddedRedis()).url
            print(f"no REDIS_URL: started an embedded redis-server at {url}")
        worker = start_worker(url, runtime, workdir)
        stack.callback(worker.kill, signal.SIGTERM)
        producer = Producer(Redis.from_url(url), QueueConfig())
        stack.callback(producer.close)
        print(f"worker pid {worker.proc.pid} (log: {worker.log_path}); watch it with `make dashboard`")
        started = time.monotonic()
        if runtime == "reference":
            ordering_demo(producer, steps)
        else:
            from commands.rl_demo import rl_loop

            rl_loop(producer, model, steps, workdir)
        print(f"done in {time.monotonic() - started:.1f}s")
