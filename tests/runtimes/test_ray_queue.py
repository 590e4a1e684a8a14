"""`tinkerq worker --runtime ray --gpus 2 --ray-address ...` as users run it: a real worker process joined to a
Ray head this module starts (CPU bundles: 2 engine replicas, 2 data-parallel trainer ranks on gloo), driven
through the real queue. It serves what the in-process torch runtime serves, and an engine replica killed
mid-batch costs only its own requests (a retryable error, or their result), comes back re-synced to the
model's latest weights, and the worker goes on."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import ray  # the `ray` extra is part of `make test`: a missing one fails here, never skips
import torch
from redis import Redis

from commands.redis_server import free_port
from producer import Producer
from schemas import (
    AdamParams,
    CreateModelOutput,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from support.stack import WorkerProc, burst_worker, job_spans
from tinkerq.config import QueueConfig
from worker.ray_runtime import cluster

pytestmark = pytest.mark.slow
BASE = "tinyq-micro"
NAMESPACE = "tinkerq-test-ray-queue"
TOLERANCE = 1e-5  # sampled logprobs: the engine's batch composition differs (support/ray_helpers.py: close)
SAMPLER_TRAINER = 1e-4  # the project's bound between what is sampled and what the trainer computes
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]
WAIT_S = 240.0
# The settings both runtimes share: bitwise-equal training needs equal passes and thread counts.
RUNTIME = {"engine": "torch", "device": "cpu", "dtype": "float32", "max_snapshots": 3, "torch_threads": 1,
           "train_micro_batch_tokens": 20}


class RayHead:
    """`ray start --head --block` on free ports of its own (other Ray clusters may run on this host), stopped by
    its pid: SIGTERM makes it stop what it started; SIGKILL after a bound."""

    PORTS = ("--port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port")

    def __init__(self) -> None:
        ports = {flag: free_port() for flag in self.PORTS}
        self.address = f"127.0.0.1:{ports['--port']}"
        self.temp = tempfile.mkdtemp(prefix="tq-ray-")  # short: Ray's socket paths live under it
        self.log = open(Path(self.temp) / "head.log", "w+")
        ray_bin = str(Path(os.sys.executable).with_name("ray"))
        args = [ray_bin, "start", "--head", "--block", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
                "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp}", "--disable-usage-stats",
                *(f"{flag}={port}" for flag, port in ports.items())]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 90.0) -> None:
        import socket

        host, port = self.address.split(":")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {self.output()}")
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((host, int(port))) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the Ray head did not come up: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    if ray.is_initialized():  # another module's cluster: this one joins its own
        cluster.disconnect()
    head = RayHead()
    try:
        head.wait_ready()
        ray.init(address=head.address, namespace=NAMESPACE, log_to_driver=False)
        yield head
    finally:
        cluster.disconnect()
        head.stop()


@pytest.fixture(scope="module")
def queue_config() -> QueueConfig:
    return QueueConfig(num_shards=4, lease_ttl_ms=3000, seq_gap_timeout_s=5.0)


@pytest.fixture(scope="module")
def connection(redis_url) -> Redis:
    connection = Redis.from_url(redis_url)
    connection.flushdb()  # once: the Ray worker below holds leases for the whole module
    return connection


@pytest.fixture(scope="module")
def ray_worker(head, connection, queue_config, redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-worker")
    env = {"TINKERQ_NUM_SHARDS": str(queue_config.num_shards), "TINKERQ_LEASE_TTL_MS": str(queue_config.lease_ttl_ms),
           "TINKERQ_SEQ_GAP_TIMEOUT_S": str(queue_config.seq_gap_timeout_s), "TINKERQ_CHECKPOINT_ROOT": str(root),
           "TINKERQ_RAY_NAMESPACE": NAMESPACE, **{f"TINKERQ_{k.upper()}": str(v) for k, v in RUNTIME.items()}}
    worker = WorkerProc(redis_url, env, ["--runtime", "ray", "--gpus", "2", "--ray-address", head.address])
    try:
        yield worker
    finally:
        try:
            worker.kill(signal.SIGTERM)  # stops within its grace (TINKERQ_STOP_GRACE_S), closing its actors
        finally:
            worker.kill(signal.SIGKILL)


def datum(prompt: list[int], completion: list[int], advantage: float) -> Datum:
    full = prompt + completion
    n = len(full) - 1
    return Datum(model_input=full[:-1], loss_fn_inputs={
        "target_tokens": [float(t) for t in full[1:]], "logprobs": [0.0] * n,
        "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(completion)})


def program(model: str) -> list:
    """create → sample → (forward_backward → optim_step → sync → sample) × 2, as one RL client sends it."""
    def samples():
        return [SampleRequest(model_id=model, prompt_tokens=p, num_samples=2, prompt_logprobs=True,
                              sampling_params=SamplingParams(max_tokens=6, seed=100 + i))
                for i, p in enumerate(PROMPTS)]

    data = [datum(p, [40 + k, 41, 42 + k, 43, 44, 45], 1.0 if k == 0 else -0.5) for p in PROMPTS for k in range(2)]
    ops = [CreateModelRequest(model_id=model, base_model=BASE, lora=LoraConfig(rank=4, seed=3, train_unembed=True)),
           *samples()]
    for step in range(2):
        ops += [ForwardBackwardRequest(model_id=model, seq_id=2 * step + 1, data=data, loss_fn="importance_sampling"),
                OptimStepRequest(model_id=model, seq_id=2 * step + 2, adam_params=AdamParams(learning_rate=0.05)),
                WeightSyncRequest(model_id=model), *samples()]
    return ops


def hello_once_back(replica) -> tuple[str, int]:  # an actor handle
    """The replica's hello once Ray has restarted it: a call while it restarts fails at once (ActorUnavailableError)
    instead of waiting, and the worker rebuilds it only when it next needs it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return ray.get(replica.hello.remote(), timeout=WAIT_S)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def results(producer: Producer, tickets, timeout: float = WAIT_S) -> list:
    out = []
    for ticket in tickets:
        result = producer.wait(ticket.request_id, timeout)
        assert result is not None, f"no result for {ticket.request_id} within {timeout} s"
        out.append(result)
    return out


def close(a: list[float], b: list[float], bound: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= bound * max(1.0, abs(x)) for x, y in zip(a, b))


def test_the_ray_worker_serves_through_the_queue_what_the_in_process_worker_serves(
        connection, queue_config, ray_worker, tmp_path):
    # The in-process reference drains its own Redis database: the Ray worker holds every shard of this one.
    where = connection.connection_pool.connection_kwargs
    other = Redis(host=where["host"], port=where["port"], db=1)
    other.flushdb()
    reference = Producer(other, queue_config)
    threads = torch.get_num_threads()  # the in-process runtime sets this process's; given back after
    try:
        local_tickets = [reference.submit(op) for op in program("same:train:0")]
        burst_worker(other, queue_config, tmp_path, runtime="torch", **RUNTIME).run(burst=True, logging_level="WARNING")
    finally:
        torch._C.set_num_threads(threads)  # torch.set_num_threads is a no-op once vLLM ran here
    local = results(reference, local_tickets, timeout=5)
    producer = Producer(connection, queue_config)
    distributed = results(producer, [producer.submit(op) for op in program("same:train:0")])
    assert ray_worker.alive(), ray_worker.output()

    for a, b in zip(local, distributed, strict=True):
        assert type(a) is type(b), (a, b)
        match a:
            case SampleOutput():
                assert a.weights_version == b.weights_version
                assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
                assert all(close(sa.logprobs, sb.logprobs, TOLERANCE) for sa, sb in zip(a.sequences, b.sequences))
                assert close(a.prompt_logprobs[1:], b.prompt_logprobs[1:], TOLERANCE)
            case CreateModelOutput():
                assert a.base_model == b.base_model
            case _ if hasattr(a, "version"):  # the syncs: the same version numbers
                assert (a.version, a.persisted) == (b.version, b.persisted)
            case _:  # forward_backward and optim_step: the trainer's outputs, equal bit for bit
                assert a == b, (a, b)
    versions = [b.weights_version for b in distributed if isinstance(b, SampleOutput)]
    assert versions == [0] * 4 + [1] * 4 + [2] * 4


def test_samples_are_served_on_the_replicas_during_a_forward_backward(connection, queue_config, ray_worker):
    """The sampling lane drives the engine replicas while the training lane's forward_backward runs on the trainer
    ranks: samples queued behind it, pinned to weights the replicas hold, start and finish inside its run (the times
    RQ's job hashes record: RQ's own for the forward_backward, the lane's for the samples)."""
    producer = Producer(connection, queue_config)
    model = "lanes:train:0"
    logged = len(ray_worker.output())
    created = results(producer, [producer.submit(CreateModelRequest(
        model_id=model, base_model=BASE, lora=LoraConfig(rank=4, seed=3, train_unembed=True)))])
    assert isinstance(created[0], CreateModelOutput), created
    # 128 passes of 99 tokens over two ranks: seconds here, long beside a sample's few decode steps
    data = [datum(list(range(5, 55)), list(range(60, 110)), 1.0) for _ in range(128)]
    fb = ForwardBackwardRequest(model_id=model, seq_id=1, data=data, loss_fn="importance_sampling")
    samples = [SampleRequest(model_id=model, prompt_tokens=p, sampling_params=SamplingParams(max_tokens=4, seed=i))
               for i, p in enumerate(PROMPTS * 2)]
    tickets = producer.submit_many([fb, *samples])  # one transaction: all queued behind it when it starts
    answers = results(producer, tickets)
    assert not isinstance(answers[0], ErrorResponse), answers[0]
    assert all(isinstance(a, SampleOutput) and a.weights_version == 0 for a in answers[1:]), answers[1:]
    (fb_start, fb_end), *served = job_spans(connection, [t.request_id for t in tickets])
    inside = [(start, end) for start, end in served if fb_start < start and end < fb_end]
    assert inside, f"forward_backward ran {fb_start}..{fb_end}; no sample ran inside it: {served}"
    log = ray_worker.output()[logged:]
    assert ray_worker.alive() and "Traceback" not in log and "sampling lane:" not in log, log[-3000:]


def test_an_engine_replica_killed_mid_batch_is_restarted_and_resynced(connection, queue_config, ray_worker):
    producer = Producer(connection, queue_config)
    model = "fault:train:0"
    trained = program(model)[:1] + [op for op in program(model) if not isinstance(op, SampleRequest)][1:]
    assert all(not isinstance(r, ErrorResponse) for r in results(producer, [producer.submit(op) for op in trained]))
    replica = ray.get_actor("engine-0", namespace=NAMESPACE)
    incarnation, pid = ray.get(replica.hello.remote(), timeout=WAIT_S)

    # One short request, then long ones: once the short one is answered, the batch is running on both replicas.
    long = SamplingParams(max_tokens=900, seed=7, stop=[])
    batch = [SampleRequest(model_id=model, prompt_tokens=[5, 6], sampling_params=SamplingParams(max_tokens=1))] + \
        [SampleRequest(model_id=model, prompt_tokens=p, num_samples=2, sampling_params=long) for p in PROMPTS * 2]
    tickets = producer.submit_many(batch)
    assert producer.wait(tickets[0].request_id, WAIT_S) is not None
    os.kill(pid, signal.SIGKILL)
    answered = results(producer, tickets[1:])

    lost = [a for a in answered if isinstance(a, ErrorResponse)]
    assert lost, f"the kill came after the replica had finished, nothing was mid-batch: {ray_worker.output()[-2000:]}"
    assert all(e.retryable and e.code == "engine_restarted" for e in lost), lost
    assert all(a.weights_version == 2 for a in answered if isinstance(a, SampleOutput))
    assert ray_worker.alive(), ray_worker.output()

    # Ray restarted it (same name, a new process), and the worker rebuilt it before serving again.
    again, new_pid = hello_once_back(replica)
    assert (again, new_pid) != (incarnation, pid)
    after = results(producer, producer.submit_many(
        [SampleRequest(model_id=model, prompt_tokens=p, num_samples=2, sampling_params=SamplingParams(max_tokens=8))
         for p in PROMPTS * 2]))
    assert all(isinstance(a, SampleOutput) and a.weights_version == 2 for a in after), after

    # What the restarted replica serves as version 2 is the trainer's current (version 2) adapter.
    probe = SampleRequest(model_id=model, prompt_tokens=PROMPTS[0], weights_version=2,
                          sampling_params=SamplingParams(max_tokens=8, seed=11, stop=[]))
    chunks = ray.get(list(replica.serve.options(num_returns="streaming").remote(again, [("p", probe)])),
                     timeout=WAIT_S)
    served = dict(pair for chunk in chunks for pair in chunk)["p"]
    assert isinstance(served, SampleOutput) and served.weights_version == 2, served
    tokens = served.sequences[0].tokens
    full = PROMPTS[0] + tokens
    forward = results(producer, [producer.submit(ForwardRequest(
        model_id=model, loss_fn="cross_entropy",
        data=[Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})]))])[0]
    trainer = forward.loss_fn_outputs[0]["logprobs"][len(PROMPTS[0]) - 1:]
    assert close(served.sequences[0].logprobs, trainer, SAMPLER_TRAINER)
