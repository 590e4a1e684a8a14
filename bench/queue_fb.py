"""forward_backward through the queue against the same call in process: what the trip costs, and where it goes.

    python bench/queue_fb.py       # a CPU: tinyq-micro, float32, 16,384 tokens in 16 datums
    python bench/queue_fb.py --device cuda --dtype bfloat16 --model randq-0.5b --tokens 16384   # any CUDA machine

    options: [--datums 16] [--repeats 7] [--rank 32] [--replays 9] [--profile] [--tag queue_fb-<device>]
             [--out bench/results]

On a GPU machine the first run builds randq-0.5b's random weights and tokenizer into the local model cache
(tinkerq.local_models; no network), which takes a minute or two before the first call.

Queue: the real tinker SDK (`TrainingClient.forward_backward(data, "cross_entropy").result()`, datums with
`target_tokens` and `weights`) -> HTTP/protobuf -> `tinkerq api` (its own process, as deployed) -> Redis -> a worker
-> result in Redis -> the API -> the SDK. In process: the same request (as the API hands it to the queue) given to
the same trainer, `TorchTrainer.forward(request, backward=True)`, on the same device, in the same run. The two
alternate call by call (drift on a shared machine hits both alike); each is the median of --repeats calls after a
warm-up of each. The goal (issue 18, goal 4) is queue / in-process <= 1.1. A third path repeats the in-process call
after the whole process idled as long as the queued call's lead-in (SDK call -> trainer start), since the trainer ran
5-6% slower inside queued calls on H200s than in process.

Three processes, as deployed: the SDK client (spawned), `tinkerq api`, and this one, the worker (`WorkerProcess` over
the torch runtime, as `tinkerq worker --runtime torch` builds it; its loop in the main thread, since RQ's job
timeouts are SIGALRM). The in-process calls run from a thread beside that loop while it idles, so both paths drive
one trainer: one copy of the weights on the device, the same adapter, the same allocator. Redis is REDIS_URL, or a
private redis-server (on PATH) started here.

On a busy machine the trainer's own time varies from call to call more than the queue's overhead; so the report
also gives the trip less the trainer's time inside it ("outside the trainer"), added to the in-process median.

Where the time goes, two ways:
  * live, from the stamps the trip leaves: the request record's `created` (the API, at enqueue), the RQ job's
    `started_at` (the worker, once it claimed, loaded and admitted the job) and `ended_at` (its result stored),
    and the trainer's own start and end (a TorchTrainer subclass in this bench's worker records them);
  * replayed: each step of the trip run alone on the same payload, through the same functions the trip calls
    (the SDK's encoder, the API's protobuf reader, Producer.submit on a scratch Redis db, RQ's job load,
    admission, the result's JSON, the API's protobuf writer, the SDK's decoder), median of --replays runs.
    --profile prints the top functions of each replayed step, and of the worker's loop over the whole run
    (cProfile; its stats file beside the JSON).

Imports: torch, transformers, peft (the trainer), rq, redis, pydantic, fastapi, uvicorn, zstandard (the API), tinker
(the SDK), numpy (which torch and tinker bring) and this repository's code; a redis-server binary on PATH unless
REDIS_URL is set; matplotlib for the PNG, if installed.
Prints tables; writes <out>/<tag>.json and <tag>.png (out: bench/results).
"""

import argparse
import cProfile
import io
import json
import multiprocessing
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKERQ_NUM_SHARDS"] = "1"  # this process's QueueConfig and the API's agree

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tinker  # noqa: E402
import torch  # noqa: E402
from redis import Redis  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

from commands.redis_server import EmbeddedRedis, free_port  # noqa: E402
from producer import Producer  # noqa: E402
from producer.api import proto  # noqa: E402
from producer.api.render import render  # noqa: E402
from schemas import ForwardBackwardRequest, parse_result  # noqa: E402
from tinkerq import keys  # noqa: E402
from tinkerq.catalog import BaseModelCatalog  # noqa: E402
from tinkerq.config import LimitsConfig, QueueConfig, RuntimeConfig  # noqa: E402
from tinkerq.jobs import JobSerializer  # noqa: E402
from worker.consumer.admission import Admission  # noqa: E402
from worker.consumer.rq_worker import AllowlistJob  # noqa: E402
from worker.durability.journal import Journal  # noqa: E402
from worker.main import WorkerProcess, connect  # noqa: E402
from worker.runtime.process_activity import Activity  # noqa: E402
from worker.runtime.versioned import Runtime  # noqa: E402
from worker.torch_runtime.assembly import make_engine, make_trainer  # noqa: E402
from worker.torch_runtime.base_models import BaseModels  # noqa: E402
from worker.torch_runtime.trainer import TorchTrainer  # noqa: E402

# The live trip, in order: (key, label); each segment runs from the previous stamp to its own.
SEGMENTS = [
    ("to_queue", "SDK call -> enqueued (SDK encode, HTTP, API parse + validate, digest)"),
    ("to_worker", "enqueued -> worker admitted it (Redis, claim, load, validate)"),
    ("to_trainer", "admitted -> trainer starts (dispatch, sequencing, journal checks)"),
    ("trainer", "trainer.forward (tensors in, forward+backward, outputs out)"),
    ("to_stored", "trainer returns -> result stored (result JSON, journal entry, Redis)"),
    ("to_client", "result stored -> SDK returns (wake, read, parse, protobuf, HTTP, SDK decode)"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class TimedTrainer(TorchTrainer):
    """The torch trainer, recording when each forward began and ended (wall clock, comparable across processes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[float, float]] = []
        self.activity: list[Activity] = []  # what else the process did during each call (GC, other threads)

    def forward(self, request, backward):  # TorchTrainer's signature
        started = time.time()
        activity = Activity()
        try:
            with activity:
                return super().forward(request, backward)
        finally:
            self.spans.append((started, time.time()))
            self.activity.append(activity)


def build_runtime(config: RuntimeConfig) -> tuple[Runtime, TimedTrainer]:
    """worker/torch_runtime/assembly.py's make_runtime, with the timed trainer."""
    bases = BaseModels(config.device, config.dtype, BaseModelCatalog.from_env())
    plain = make_trainer(config, bases)
    trainer = TimedTrainer(bases, plain.root, plain.options)
    return Runtime(trainer, make_engine(config, bases, trainer=trainer)), trainer


def wait_http(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def stamp(value: bytes | None) -> float | None:
    """An RQ time field (UTC, ISO with microseconds) as a Unix time."""
    if not value:
        return None
    return datetime.strptime(value.decode(), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


# -- the payload ---------------------------------------------------------------------------------------------------

def lengths_of(tokens: int, datums: int) -> list[int]:
    base, extra = divmod(tokens, datums)
    return [base + (i < extra) for i in range(datums)]


def sdk_data(lengths: list[int], vocab: int, seed: int = 0) -> list[types.Datum]:
    """What an SFT loop hands the SDK: tokens, int64 target tokens and float32 weights per datum."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, vocab, n + 1)
        weights = np.ones(n, dtype=np.float32)
        weights[: n // 4] = 0.0  # a prompt that is not trained on
        inputs = {"target_tokens": types.TensorData.from_numpy(tokens[1:].astype(np.int64)),
                  "weights": types.TensorData.from_numpy(weights)}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs))
    return data


def sdk_request(data: list[types.Datum], model_id: str, seq_id: int) -> types.ForwardBackwardRequest:
    """As the SDK's TrainingClient builds each chunk's request (training_client.py: _send_request)."""
    return types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy", loss_fn_config=None),
        model_id=model_id, seq_id=seq_id)


def sdk_encode(request: types.ForwardBackwardRequest) -> bytes:
    """As the SDK's training resource sends it (resources/training.py: forward_backward)."""
    message = forward_backward_request_to_proto(request)
    message.forward_only = False
    return message.SerializeToString()


# -- the live trip -------------------------------------------------------------------------------------------------

def sdk_client(base_url: str, model: str, rank: int, tokens: int, datums: int, conn) -> None:
    """The client's process: a TrainingClient of the tinker SDK, calling forward_backward when told to."""
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
    client = service.create_lora_training_client(base_model=model, rank=rank, seed=0).result()
    conn.send(client.model_id)
    data = sdk_data(lengths_of(tokens, datums), conn.recv())
    while conn.recv() == "forward_backward":
        started, cpu = time.time(), time.process_time()
        t0 = time.perf_counter()
        result = client.forward_backward(data, "cross_entropy").result()
        seconds = time.perf_counter() - t0
        conn.send({"started": started, "seconds": seconds, "cpu": time.process_time() - cpu,
                   "loss": result.metrics.get("loss:sum")})


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Trip:
    """One forward_backward through the SDK (in its own process), with the stamps it left in Redis."""

    def __init__(self, redis: Redis, client, trainer: TimedTrainer, api_pid: int) -> None:
        self.redis = redis
        self.client = client
        self.trainer = trainer
        self.api_pid = api_pid
        self.seen: set[bytes] = set(redis.scan_iter(keys.request_key("*"), count=1000))

    def run(self) -> dict:
        spans_before = len(self.trainer.spans)
        api_cpu, own_cpu = cpu_seconds(self.api_pid), time.process_time()
        self.client.send("forward_backward")
        call = self.client.recv()
        cpu = {"client": call["cpu"], "api": cpu_seconds(self.api_pid) - api_cpu,
               "worker": time.process_time() - own_cpu}
        started, seconds = call["started"], call["seconds"]
        new = [k for k in self.redis.scan_iter(keys.request_key("*"), count=1000) if k not in self.seen]
        self.seen.update(new)
        ids = [k.decode().removeprefix(keys.request_key("")) for k in new
               if self.redis.hget(k, "kind") == b"forward_backward"]
        if len(ids) != 1 or len(self.trainer.spans) != spans_before + 1:
            raise RuntimeError(f"expected one forward_backward job and one trainer call, saw {ids} and "
                               f"{len(self.trainer.spans) - spans_before}")
        rid = ids[0]
        created = float(self.redis.hget(keys.request_key(rid), "created"))
        for _ in range(200):  # RQ writes ended_at in its bookkeeping after the result (the stamp is taken before)
            job_started, job_ended = map(stamp, self.redis.hmget(f"rq:job:{rid}", "started_at", "ended_at"))
            if job_started is not None and job_ended is not None:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"job {rid} has no started_at / ended_at")
        fwd_start, fwd_end = self.trainer.spans[-1]
        gc_ms, gc_count = self.trainer.activity[-1].gc_ms, self.trainer.activity[-1].collections
        marks = [started, created, job_started, fwd_start, fwd_end, job_ended, started + seconds]
        row = {"seconds": seconds, "request_id": rid, "loss": call["loss"], "cpu": cpu, "gc_ms": gc_ms,
               "gc_collections": gc_count,
               "outside_trainer": seconds - (fwd_end - fwd_start)}
        for (key, _), a, b in zip(SEGMENTS, marks, marks[1:]):
            row[key] = b - a
        return row


def in_process(trainer: TimedTrainer, request: ForwardBackwardRequest, pause_s: float = 0.0) -> dict:
    """The call in process; after `pause_s` of the whole process idling, where given (the worker's loop blocks on
    Redis meanwhile, as it does before a queued call reaches it)."""
    time.sleep(pause_s)
    t0 = time.perf_counter()
    output = trainer.forward(request, True)
    return {"seconds": time.perf_counter() - t0, "loss": output.metrics["loss:sum"],
            "gc_ms": trainer.activity[-1].gc_ms, "gc_collections": trainer.activity[-1].collections}


# -- the replayed steps ----------------------------------------------------------------------------------------------

def replay_steps(data: list[types.Datum], model_id: str, trainer: TimedTrainer, request: ForwardBackwardRequest,
                 scratch_url: str) -> tuple[list[tuple[str, str, callable]], dict[str, int]]:
    """Each step of the trip as a callable on the same payload, through the functions the trip calls; and the
    size of what each step hands on, in bytes."""
    body = sdk_encode(sdk_request(data, model_id, 1))
    scratch = Redis.from_url(scratch_url)
    scratch.flushdb()
    config = QueueConfig(num_shards=1)
    producer = Producer(scratch, config)
    admission = Admission(config, LimitsConfig())
    output = trainer.forward(request, False)  # a forward: the same outputs, no gradients left behind
    result_json = output.model_dump_json()
    stored = parse_result(result_json)
    response = render(stored, {}).body
    counter = iter(range(10**9))

    def enqueue():
        return producer.submit(request, f"bench-{next(counter)}")

    last = enqueue().request_id
    job_data = scratch.hget(f"rq:job:{last}", "data")

    def load_job():
        job = AllowlistJob.fetch(last, connection=scratch, serializer=JobSerializer)
        return job.args

    payload = load_job()[0]
    sizes = {"protobuf request": len(body), "job data in Redis": len(job_data),
             "request JSON (journal entry)": len(Journal.entry(request)), "result JSON": len(result_json),
             "protobuf response": len(response)}
    steps = [
        ("SDK", "build + encode the request (protobuf)", lambda: sdk_encode(sdk_request(data, model_id, 1))),
        ("API", "parse protobuf -> datums -> request (validated)",
         lambda: proto.to_request(proto.parse_forward_backward(body))),
        ("API", "enqueue: limits, digest, job JSON, Redis transaction", enqueue),
        ("worker", "load the job: Redis read, JSON decode", load_job),
        ("worker", "admit: schema validation, limits, routing", lambda: admission.judge_payload(last, 0, payload)),
        ("worker", "result JSON + journal entry", lambda: (output.model_dump_json(), Journal.entry(request))),
        ("API", "read result: parse JSON -> protobuf response", lambda: render(parse_result(result_json), {})),
        ("SDK", "decode the protobuf response", lambda: deserialize_forward_backward_output(response)),
    ]
    return steps, sizes


def run_replays(steps, replays: int, profile: bool) -> list[dict]:
    rows = []
    for where, what, fn in steps:
        fn()
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        row = {"where": where, "step": what, "ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(8)
            row["profile"] = text.getvalue()
        rows.append(row)
    return rows


# -- report ------------------------------------------------------------------------------------------------------------

def summarize(queue: list[dict], local: list[dict], idle: list[dict], replays: list[dict], sizes: dict, args,
              machine: str) -> dict:
    q, p = statistics.median(r["seconds"] for r in queue), statistics.median(r["seconds"] for r in local)
    outside = statistics.median(r["outside_trainer"] for r in queue)
    trainer = statistics.median(r["trainer"] for r in queue)
    return {"machine": machine, "torch": torch.__version__, "tinker": tinker.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "options": vars(args),
            "queue_ms": 1000 * q, "in_process_ms": 1000 * p, "ratio": q / p,
            # the trip less the trainer's own time in it: what the queue adds, free of the trainer's noise
            "outside_trainer_ms": 1000 * outside, "trainer_in_queue_ms": 1000 * trainer,
            "in_process_after_idle_ms": 1000 * statistics.median(r["seconds"] for r in idle),
            # garbage collection inside the trainer's call, by path (median ms per call)
            "trainer_gc_ms": {path: statistics.median(r["gc_ms"] for r in rows)
                              for path, rows in (("queue", queue), ("in_process", local), ("after_idle", idle))},
            "ratio_outside_trainer": (p + outside) / p,
            "segments_ms": {key: 1000 * statistics.median(r[key] for r in queue) for key, _ in SEGMENTS},
            # the least of each over the calls: on a shared machine, what the step costs when nothing intervenes
            "segments_min_ms": {key: 1000 * min(r[key] for r in queue) for key, _ in SEGMENTS},
            "outside_trainer_min_ms": 1000 * min(r["outside_trainer"] for r in queue),
            "cpu_ms_per_call": {who: 1000 * statistics.median(r["cpu"][who] for r in queue)
                                for who in ("client", "api", "worker")},
            "replay": [{k: v for k, v in row.items() if k != "profile"} for row in replays],
            "sizes_bytes": sizes, "queue_calls": queue, "in_process_calls": local, "in_process_after_idle_calls": idle}


def table(report: dict) -> str:
    o = report["options"]
    cpu = report["cpu_ms_per_call"]
    title = (f"forward_backward of {o['tokens']:,} tokens ({o['datums']} datums), {o['model']} {o['dtype']} on "
             f"{o['device']}, LoRA rank {o['rank']}; median of {o['repeats']} calls each, alternating")
    queue = (f"| through the queue: SDK -> API -> Redis -> worker -> SDK | {report['queue_ms']:,.1f} | "
             f"{report['ratio']:.3f} |")
    outside = (f"| in process + the queue's time outside the trainer | "
               f"{report['in_process_ms'] + report['outside_trainer_ms']:,.1f} | "
               f"{report['ratio_outside_trainer']:.3f} |")
    gc = report["trainer_gc_ms"]
    segments = ("live trip, ms per segment (the trainer's own time in it, median: "
                f"{report['trainer_in_queue_ms']:,.1f}; garbage collection inside the trainer's call: queued "
                f"{gc['queue']:.1f} ms, in process {gc['in_process']:.1f}, after idling {gc['after_idle']:.1f}; "
                f"CPU ms per call: client {cpu['client']:.0f}, API {cpu['api']:.0f}, worker {cpu['worker']:.0f}):")
    lines = [title, "", "| path | ms | ratio |", "| --- | --- | --- |",
             f"| in process: TorchTrainer.forward(request, backward=True) | {report['in_process_ms']:,.1f} | 1.000 |",
             f"| in process, after the process idled as long as the queued call's lead-in | "
             f"{report['in_process_after_idle_ms']:,.1f} | "
             f"{report['in_process_after_idle_ms'] / report['in_process_ms']:.3f} |",
             queue, outside, "", segments, "", "| segment | median ms | min ms |", "| --- | --- | --- |"]
    for key, label in SEGMENTS:
        lines.append(f"| {label} | {report['segments_ms'][key]:,.1f} | {report['segments_min_ms'][key]:,.1f} |")
    lines.append("| outside the trainer, all segments (per-call sums) | "
                 f"{report['outside_trainer_ms']:,.1f} | {report['outside_trainer_min_ms']:,.1f} |")
    lines += ["", "each step replayed alone on the same payload (ms):", "",
              "| where | step | median | min |", "| --- | --- | --- | --- |"]
    for row in report["replay"]:
        lines.append(f"| {row['where']} | {row['step']} | {row['ms']:.2f} | {row['min_ms']:.2f} |")
    lines.append(f"| | total | {sum(r['ms'] for r in report['replay']):.2f} | "
                 f"{sum(r['min_ms'] for r in report['replay']):.2f} |")
    lines += ["", "sizes: " + ", ".join(f"{k} {v:,} B" for k, v in report["sizes_bytes"].items())]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [1, 1.6]},
                                      constrained_layout=True)
    left = 0.0
    colors = plt.get_cmap("tab10").colors
    for i, (key, label) in enumerate(SEGMENTS):
        if key == "trainer":
            continue
        width = report["segments_ms"][key]
        top.barh(["queue,\noutside the\ntrainer"], [width], left=left, color=colors[i], label=label.split(" (")[0])
        left += width
    budget = 0.1 * report["in_process_ms"]
    top.axvline(budget, color="black", linestyle="--", label=f"10% of the in-process call ({budget:,.0f} ms)")
    top.set_xlabel("ms (medians of the live trip's segments)")
    top.set_title(f"forward_backward, {report['options']['tokens']:,} tokens, {report['options']['model']} on "
                  f"{report['options']['device']}: in process {report['in_process_ms']:,.0f} ms, queue / in process "
                  f"= {report['ratio']:.3f} (outside the trainer: {report['ratio_outside_trainer']:.3f})", fontsize=10)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    rows = report["replay"]
    bottom.barh([f"{r['where']}: {r['step']}" for r in rows][::-1], [r["ms"] for r in rows][::-1], color="tab:gray")
    bottom.set_xlabel("ms, each step replayed alone (median)")
    bottom.tick_params(axis="y", labelsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def measure(args, base_url: str, redis: Redis, trainer: TimedTrainer, scratch_url: str, api_pid: int) -> dict:
    ours, theirs = multiprocessing.Pipe()
    client = multiprocessing.get_context("spawn").Process(
        target=sdk_client, args=(base_url, args.model, args.rank, args.tokens, args.datums, theirs), daemon=True)
    client.start()
    try:
        return _measure(args, ours, redis, trainer, scratch_url, api_pid)
    finally:
        ours.send("stop")
        client.join(30)


def _measure(args, conn, redis: Redis, trainer: TimedTrainer, scratch_url: str, api_pid: int) -> dict:
    model_id = conn.recv()
    vocab = min(trainer.models[model_id].base.vocab_size, 4096)
    conn.send(vocab)
    data = sdk_data(lengths_of(args.tokens, args.datums), vocab)  # the client's data (the same seed)
    # the request exactly as the API hands it to the queue, less its seq_id (the trainer does not read it)
    request = proto.to_request(proto.parse_forward_backward(sdk_encode(sdk_request(data, model_id, 1))))
    request = request.model_copy(update={"seq_id": None})
    trip = Trip(redis, conn, trainer, api_pid)
    log("warm-up: one call of each path")
    trip.run()
    in_process(trainer, request)
    queue, local, idle = [], [], []
    for i in range(args.repeats):
        queue.append(trip.run())
        local.append(in_process(trainer, request))
        # the trainer ran 5-6% slower inside queued calls on H200s; a process idle for the trip's lead-in is one
        # difference between the paths: this third path has only that one
        lead_in = sum(queue[-1][key] for key in ("to_queue", "to_worker", "to_trainer"))
        idle.append(in_process(trainer, request, pause_s=lead_in))
        parts = " + ".join(f"{1000 * queue[-1][key]:.0f}" for key, _ in SEGMENTS)
        log(f"call {i + 1}/{args.repeats}: queue {1000 * queue[-1]['seconds']:,.1f} ms ({parts}), in process "
            f"{1000 * local[-1]['seconds']:,.1f} ms, after {1000 * lead_in:.0f} ms idle "
            f"{1000 * idle[-1]['seconds']:,.1f} ms; GC in the trainer's call {queue[-1]['gc_ms']:.0f} / "
            f"{local[-1]['gc_ms']:.0f} / {idle[-1]['gc_ms']:.0f} ms")
    log("replaying each step alone")
    steps, sizes = replay_steps(data, model_id, trainer, request, scratch_url)
    replays = run_replays(steps, args.replays, args.profile)
    Redis.from_url(scratch_url).flushdb()
    return {"queue": queue, "local": local, "idle": idle, "replays": replays, "sizes": sizes}


# -- main --------------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinyq-micro", help="a local model (tinkerq.local_models), e.g. randq-0.5b")
    parser.add_argument("--device", default="cpu", help="the trainer's device: cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per forward_backward (all datums)")
    parser.add_argument("--datums", type=int, default=16, help="datums the tokens are split into, evenly")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each path, after one warm-up each")
    parser.add_argument("--replays", type=int, default=9, help="runs of each replayed step")
    parser.add_argument("--profile", action="store_true",
                        help="print each replayed step's top functions and the worker loop's (cProfile)")
    parser.add_argument("--tag", default="", help="file name of the JSON and PNG (default queue_fb-<device type>)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")),
                        help="directory of the JSON and PNG (default $OUT, else bench/results)")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.tag = args.tag or f"queue_fb-{device.type}"
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" else
               f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cpus")
    log(f"{machine}, torch {torch.__version__}, tinker {tinker.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-queue-fb-"))
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        redis = Redis.from_url(url)
        redis.flushdb()
        scratch_url = url.rsplit("/", 1)[0] + "/" + str(int(url.rsplit("/", 1)[1] or 0) + 1)
        env = {**os.environ, "TINKERQ_CHECKPOINT_ROOT": str(tmp),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        port = free_port()
        api = subprocess.Popen([sys.executable, "-m", "commands.cli", "api", "--redis-url", url, "--port", str(port),
                                "--log-level", "warning"], cwd=ROOT, env=env)
        stack.callback(api.wait)
        stack.callback(api.terminate)
        config = QueueConfig(num_shards=1)
        log(f"loading {args.model} on {args.device} ({args.dtype})")
        runtime, trainer = build_runtime(RuntimeConfig(runtime="torch", engine="torch", device=args.device,
                                                       dtype=args.dtype, checkpoint_root=str(tmp / "ckpt")))
        worker = WorkerProcess(connect(url, config, "bench-worker"), runtime, config, name="bench-worker")
        outcome: dict = {}

        def drive() -> None:
            try:
                wait_http(f"http://127.0.0.1:{port}/api/v1/healthz", api)
                outcome.update(measure(args, f"http://127.0.0.1:{port}", redis, trainer, scratch_url, api.pid))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = exc
            finally:
                worker.stop()

        # RQ's job timeouts are SIGALRM: the worker loop takes the main thread, the calls run beside it
        driver = threading.Thread(target=drive, name="bench-driver")
        driver.start()
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:  # the worker's main thread: claim, load, admit, dispatch, trainer, result
            profiler.enable()
        worker.run(logging_level="WARNING")
        if profiler is not None:
            profiler.disable()
        driver.join()
        if "error" in outcome:
            raise outcome["error"]
    report = summarize(outcome["queue"], outcome["local"], outcome["idle"], outcome["replays"], outcome["sizes"], args,
                       f"{platform.node()}: {machine}")
    replays = outcome["replays"]
    report["table"] = table(report)
    print("\n" + report["table"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        for row in replays:
            print(f"\n== {row['where']}: {row['step']}\n{row['profile']}")
        profiler.dump_stats(out / f"{args.tag}-worker.prof")
        print(f"\n== the worker's loop over all calls ({out / (args.tag + '-worker.prof')}), by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    (out / f"{args.tag}.json").write_text(json.dumps(report, indent=2, default=str))
    wrote = plot(report, out / f"{args.tag}.png")
    log(f"wrote {out / (args.tag + '.json')}" + (" and .png" if wrote else " (no matplotlib: no PNG)"))


if __name__ == "__main__":
    main()
