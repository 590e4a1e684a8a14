"""What the HTTP layer costs: the real tinker SDK sampling through `tinkerq api`, against the same
samples submitted with the producer library directly, in one run, at C concurrent samplers; and, to
tell the SDK's client-side cost from the server's, the same two HTTP calls per sample (asample,
retrieve_future) from a bare asyncio HTTP client.

    python bench/api_overhead.py [--concurrency 64] [--rounds 8] [--max-tokens 16] [--api-workers 1]
        [--model tinyq-micro] [--split-cores | --worker-cpus 0-3 --api-cpus 4-5 --client-cpus 6-9]

Both paths share one Redis and one `tinkerq worker --runtime torch` (--model, tinyq-micro by default). Each round sends
C requests at once and waits for all of them; the paths alternate round by round. The CPU time each
process spends per sample (client, API, worker) is measured with psutil over the same rounds: on a
small machine the client and the API take their CPU from the worker. The --*-cpus options pin each
process to its own cores, as separate hosts would.
Prints a table and writes bench/out/api_overhead.json.
"""

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import psutil
import pyqwest
import tinker
from pyqwest.httpx import AsyncPyqwestTransport
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from tinker import types
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commands.redis_server import EmbeddedRedis, free_port  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import SampleRequest, SamplingParams  # noqa: E402
from tinkerq import keys  # noqa: E402
from tinkerq.config import QueueConfig  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
PROTO_TYPE = "application/x-protobuf"


def start(args: list[str], env: dict[str, str], cpus: str | None = None) -> subprocess.Popen:
    pin = ["taskset", "-c", cpus] if cpus else []
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([*pin, sys.executable, "-m", "commands.cli", *args], cwd=ROOT,
                            env={**os.environ, **env, "PYTHONPATH": path},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cpu_list(spec: str) -> list[int]:
    """taskset's syntax: 0-3,8,10-11."""
    cpus = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


class CpuMeter:
    """CPU seconds of a process, with its children (an API's worker processes) where asked."""

    def __init__(self, pid: int, children: bool = True) -> None:
        self.process = psutil.Process(pid)
        self.children = children

    def seconds(self) -> float:
        total = 0.0
        for proc in [self.process, *(self.process.children(recursive=True) if self.children else ())]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total


def wait_http(url: str) -> None:
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def sdk_round(pool: ThreadPoolExecutor, sampler, n: int, params: types.SamplingParams):
    """n samples through the SDK; each is timed by a thread of its own, from the call to its result (awaiting
    them in call order would charge a result that lands early with the wait for the ones before it)."""
    def finished(sent_and_future) -> float:
        sent, future = sent_and_future
        future.result()
        return time.perf_counter() - sent

    started = time.perf_counter()
    futures = [(time.perf_counter(), sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                                    sampling_params=params)) for _ in range(n)]
    latencies = list(pool.map(finished, futures))
    return time.perf_counter() - started, latencies


class RawHttp:
    """The same asample + retrieve_future calls from a bare asyncio HTTP client (one event loop):
    what the HTTP layer costs without the SDK's own client-side work."""

    def __init__(self, base_url: str, sampler_id: str, max_tokens: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        # the SDK's own transport (pyqwest, in Rust): httpx's pure-Python one costs several times more CPU
        transport = AsyncPyqwestTransport(transport=pyqwest.HTTPTransport())
        self.client = httpx.AsyncClient(base_url=f"{base_url}/api/v1", headers={"X-API-Key": "tml-bench"},
                                        transport=transport, timeout=120)
        self.body = {"sampling_session_id": sampler_id, "num_samples": 1,
                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                     "sampling_params": {"max_tokens": max_tokens, "seed": 1, "stop": []}}
        self.seq = itertools.count(10**6)  # clear of the SDK's seq ids on the same sampling session

    async def _one(self) -> float:
        sent = time.perf_counter()
        response = await self.client.post("/asample", json={**self.body, "seq_id": next(self.seq)})
        request_id = response.json()["request_id"]
        while True:
            result = await self.client.post("/retrieve_future", json={"request_id": request_id})
            if result.headers["content-type"] == PROTO_TYPE:
                return time.perf_counter() - sent
            assert result.json().get("type") == "try_again", result.text

    async def _round(self, n: int) -> tuple[float, list[float]]:
        started = time.perf_counter()
        latencies = await asyncio.gather(*(self._one() for _ in range(n)))
        return time.perf_counter() - started, list(latencies)

    def round(self, n: int) -> tuple[float, list[float]]:
        return asyncio.run_coroutine_threadsafe(self._round(n), self.loop).result()


def direct_round(pool: ThreadPoolExecutor, producer: Producer, request: SampleRequest, n: int):
    def one(_):
        sent = time.perf_counter()
        ticket = producer.submit(request)
        assert producer.wait(ticket.request_id, 300).type == "sample"
        return time.perf_counter() - sent

    started = time.perf_counter()
    latencies = list(pool.map(one, range(n)))
    return time.perf_counter() - started, latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tinyq-micro", help="a local model name (tinkerq.local_models)")
    parser.add_argument("--device", default="auto", help="the worker's torch device (TINKERQ_DEVICE)")
    parser.add_argument("--dtype", default="float32", help="the worker's TINKERQ_DTYPE (float32, as the recorded runs)")
    parser.add_argument("--api-workers", type=int, default=1, help="`tinkerq api --workers`")
    parser.add_argument("--split-cores", action="store_true",
                        help="worker on the last core, API and clients on the others (as on separate hosts)")
    parser.add_argument("--worker-cpus", help="taskset list for the worker, e.g. 0-3")
    parser.add_argument("--api-cpus", help="taskset list for the API process(es)")
    parser.add_argument("--client-cpus", help="taskset list for this process (the SDK client and the producer)")
    parser.add_argument("--only", help="run only these paths (comma-separated), e.g. to profile one of them")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "api_overhead.json"))
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.split_cores:
        args.worker_cpus, args.api_cpus = str(cores[-1]), ",".join(map(str, cores[:-1]))
        args.client_cpus = args.api_cpus
    if args.client_cpus:
        os.sched_setaffinity(0, set(cpu_list(args.client_cpus)))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinkerq-api-bench-{os.getpid()}"
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        Redis.from_url(url).flushdb()
        env = {"TINKERQ_NUM_SHARDS": "1", "TINKERQ_CHECKPOINT_ROOT": str(tmp), "TINKERQ_DEVICE": args.device,
               "TINKERQ_DTYPE": args.dtype}
        # pinned, the worker's torch uses its own cores and no more
        worker_env = {**env, "OMP_NUM_THREADS": str(len(cpu_list(args.worker_cpus)))} if args.worker_cpus else env
        port = free_port()
        procs = [start(["worker", "--redis-url", url, "--runtime", "torch", "--engine", "torch",
                        "--log-level", "WARNING"], worker_env, args.worker_cpus),
                 start(["api", "--redis-url", url, "--port", str(port), "--workers", str(args.api_workers),
                        "--log-level", "warning"], env, args.api_cpus)]
        stack.callback(lambda: [p.terminate() for p in procs])
        base_url = f"http://127.0.0.1:{port}"
        wait_http(f"{base_url}/api/v1/healthz")
        client = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
        trainer = client.create_lora_training_client(base_model=args.model, rank=8, seed=0).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[])
        # the same snapshot for the direct path: the one sampling session this run created
        redis = Redis.from_url(url)
        sampler_key = next(redis.scan_iter(keys.sampler_key("*"))).decode()
        sampler_state = redis.hgetall(sampler_key)
        producer = Producer(Redis.from_url(url, max_connections=4 * args.concurrency), QueueConfig(num_shards=1))
        stack.callback(producer.close)
        request = SampleRequest(model_id=sampler_state[b"model_id"].decode(), prompt_tokens=PROMPT,
                                weights_version=int(sampler_state[b"version"]),
                                sampling_params=SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[]))
        pool = stack.enter_context(ThreadPoolExecutor(args.concurrency))
        raw = RawHttp(base_url, sampler_key.removeprefix(keys.sampler_key("")), args.max_tokens)
        paths = {"sdk_via_api": lambda: sdk_round(pool, sampler, args.concurrency, params),
                 "http_via_api": lambda: raw.round(args.concurrency),
                 "producer_direct": lambda: direct_round(pool, producer, request, args.concurrency)}
        if args.only:
            paths = {name: run for name, run in paths.items() if name in args.only.split(",")}
        sdk_round(pool, sampler, 8, params)
        raw.round(8)
        direct_round(pool, producer, request, 8)  # warm-up
        meters = {"client": CpuMeter(os.getpid(), children=False), "api": CpuMeter(procs[1].pid),
                  "worker": CpuMeter(procs[0].pid)}
        rows = run_rounds(paths, meters, RoundProbe(redis), args)
        client.close("success").result()
    report = summarize(rows, args)
    print_report(report, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot_latencies(rows, Path(args.out).with_suffix(".png"), args)
    print(f"wrote {args.out} and its latency plot")


def plot_latencies(rows: dict[str, dict], out: Path, args) -> None:
    """Latency CDF per path: where the paths part (the first samples, the median, the tail) shows at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in rows.items():
        latencies = sorted(1000 * x for x in row["latencies"])
        ax.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], label=name)
    ax.set(xlabel="sample latency, ms (call to result)", ylabel="fraction of samples",
           title=f"{args.concurrency} concurrent samplers, {args.rounds} rounds per path")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


class RoundProbe:
    """What the queue saw of each round, read back from Redis: when its requests reached the queue (the
    producer's `created` stamp on each request record, from the moment the round began: how long the client
    side takes to hand them all over), and the engine calls that served them (the worker's RQ summary of
    each batch's leading job: how the arrivals were grouped)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.seen: set[bytes] = set()

    def after(self, started: float) -> tuple[float, float, list[int]]:
        """(first, last) arrival and the batch sizes of the requests that came in since the last call."""
        new = [key for key in self.redis.scan_iter(f"{keys.PREFIX}:req:*", count=1000) if key not in self.seen]
        self.seen.update(new)
        ids = [key.decode().removeprefix(keys.request_key("")) for key in new]
        with self.redis.pipeline(transaction=False) as pipe:
            for key in new:
                pipe.hget(key, "created")
            created = [float(c) for c in pipe.execute() if c is not None]
        batches = self._batches(ids)
        if not created:
            return 0.0, 0.0, batches
        return min(created) - started, max(created) - started, batches

    def _batches(self, ids: list[str]) -> list[int]:
        """Sizes of the engine calls that served these requests, in the order they ran. RQ writes a batch's
        summary after its results, so wait a little for the last one."""
        for _ in range(50):
            jobs = [job for job in Job.fetch_many(ids, connection=self.redis, serializer=JSONSerializer) if job]
            runs = []  # (started, size) of each batch's leading job
            for job in jobs:
                summary = job.return_value()
                if isinstance(summary, dict) and "batch" in summary:
                    runs.append((job.started_at, summary["batch"]))
            batches = [size for _, size in sorted(runs)]
            if sum(batches) >= len(jobs):
                return batches
            time.sleep(0.02)
        return batches


def run_rounds(paths: dict, meters: dict[str, CpuMeter], probe: RoundProbe, args) -> dict[str, dict]:
    """Rounds alternate the paths, so drift on a shared machine hits all of them alike."""
    rows = {name: {"rates": [], "latencies": [], "first_arrival": [], "last_arrival": [], "batches": [],
                   "cpu": dict.fromkeys(meters, 0.0)}
            for name in paths}
    probe.after(time.time())  # everything before the first round
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, run in paths.items():
            before = {who: meter.seconds() for who, meter in meters.items()}
            started = time.time()
            seconds, latencies = run()
            first, last, batches = probe.after(started)
            rows[name]["batches"].append(batches)
            rows[name]["first_arrival"].append(first)
            rows[name]["last_arrival"].append(last)
            for who, meter in meters.items():
                rows[name]["cpu"][who] += meter.seconds() - before[who]
            rows[name]["rates"].append(args.concurrency / seconds)
            rows[name]["latencies"].extend(latencies)
    return rows


def summarize(rows: dict[str, dict], args) -> dict:
    report = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "workload": {k: v for k, v in vars(args).items() if k != "out"}}
    samples = args.rounds * args.concurrency
    for name, row in rows.items():
        latencies = sorted(row["latencies"])
        report[name] = {"samples_per_s": statistics.median(row["rates"]), "min_ms": 1000 * latencies[0],
                        "p50_ms": 1000 * statistics.median(latencies),
                        "p99_ms": 1000 * latencies[int(0.99 * len(latencies)) - 1],
                        "first_arrival_ms": 1000 * statistics.median(row["first_arrival"]),
                        "last_arrival_ms": 1000 * statistics.median(row["last_arrival"]),
                        "engine_calls_per_round": statistics.median(len(b) for b in row["batches"]),
                        "batches_per_round": row["batches"],
                        "cpu_ms_per_sample": {who: 1000 * cpu / samples for who, cpu in row["cpu"].items()}}
    direct = report.get("producer_direct")
    for name in ("sdk_via_api", "http_via_api") if direct else ():
        if name not in report:
            continue
        report[name]["throughput_overhead"] = 1 - report[name]["samples_per_s"] / direct["samples_per_s"]
        report[name]["p50_latency_overhead"] = report[name]["p50_ms"] / direct["p50_ms"] - 1
    return report


def print_report(report: dict, args) -> None:
    print(f"\n{'path':<20}{'samples/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'in: first-last':>16}{'calls':>6}"
          "   CPU ms per sample: "
          f"client / API / worker   ({args.concurrency} concurrent, {args.rounds} rounds; in: ms from the "
          f"round's start to its first and last request reaching the queue; calls: engine calls per round)")
    for name in [n for n in ("sdk_via_api", "http_via_api", "producer_direct") if n in report]:
        row, cpu = report[name], report[name]["cpu_ms_per_sample"]
        print(f"{name:<20}{row['samples_per_s']:>10.1f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}"
              f"{row['first_arrival_ms']:>9.1f}-{row['last_arrival_ms']:<6.1f}{row['engine_calls_per_round']:>6g}"
              f"   {cpu['client']:>6.2f} / {cpu['api']:>5.2f} / {cpu['worker']:>5.2f}")
    for name, label in (("sdk_via_api", "tinker SDK + HTTP layer"), ("http_via_api", "HTTP layer alone")):
        row = report.get(name, {})
        if "throughput_overhead" not in row:
            continue
        print(f"{label} against the producer library: throughput {-row['throughput_overhead']:+.1%}, "
              f"p50 latency {row['p50_latency_overhead']:+.1%} (target: within 10%)")


if __name__ == "__main__":
    main()
