"""Queue overhead: a trivial sample through producer -> Redis -> worker -> result -> waiter,
beside a bare RQ no-op job measured the same way, plus enqueue throughput; and the queue's fixed cost
of a round of `--batch` requests (4 samples x 128 tokens each, `submit_many`, one engine run: the shape of
bench/sampling_throughput.py) with an engine that costs nothing. One run, one machine.

    python bench/queue_overhead.py [--n 300] [--batch 32]   (REDIS_URL, or a private redis-server is started)
    python bench/queue_overhead.py --quick                   (small rounds, a few seconds: what CI runs)

The worker it starts serves the reference runtime (`--runtime reference`): the engine's cost is not what is
measured, and a worker's default runtime loads a real model, which knows no `ref` base. Every answer it waits for
is checked: one that is not what was asked for (an error, or nothing before the timeout) stops the bench with the
answer, not a number measured over errors.

Prints a table and writes bench/out/queue_overhead.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from redis import Redis
from rq import Queue
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.answers import BenchFailed, expect, percentiles  # noqa: E402
from commands.redis_server import EmbeddedRedis  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import CreateModelRequest, SampleRequest, SamplingParams  # noqa: E402
from tinkerq.config import QueueConfig  # noqa: E402

BARE_QUEUE = "bench.bare"
# --quick: a few seconds, enough to show every path answers (CI runs it; tests/e2e/test_readme_commands.py)
QUICK = {"n": 25, "warmup": 5, "batch": 8, "rounds": 3, "enqueues": 200}


def start(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    out = log.open("w") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, *cmd], env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    finally:
        if log:
            out.close()


def bare_rq_worker(url: str) -> subprocess.Popen:
    code = (f"from redis import Redis; from rq import Queue, SimpleWorker; r = Redis.from_url({url!r}); "
            f"SimpleWorker([Queue({BARE_QUEUE!r}, connection=r, serializer='json')], connection=r, "
            "serializer='json').work(logging_level='WARNING')")
    return start(["-c", code])


def tinkerq_worker(url: str, log: Path) -> subprocess.Popen:
    return start(["-m", "commands.cli", "worker", "--redis-url", url, "--runtime", "reference", "--log-level",
                  "WARNING"], {"TINKERQ_NUM_SHARDS": "1"}, log)


def stop(procs: list[subprocess.Popen], grace_s: float = 6.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`: the bare RQ worker's warm stop, once it has served jobs, can wait up to
    a minute on its pub/sub thread, and it holds nothing a kill loses; the tinkerq worker's own stop is bounded
    within the grace."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure_bare(r: Redis, n: int) -> list[float]:
    queue = Queue(BARE_QUEUE, connection=r, serializer="json")
    latencies = []
    for _ in tqdm(range(n), desc="bare RQ no-op", leave=False):
        t0 = time.perf_counter()
        job = queue.enqueue("os.getpid", result_ttl=60)
        result = job.latest_result(timeout=10)
        if result is None or result.type != result.Type.SUCCESSFUL:
            answer = "no answer within 10 s" if result is None else result.exc_string or result.type
            raise BenchFailed(f"bare RQ no-op job {job.id}: {answer}")
        latencies.append(time.perf_counter() - t0)
    return latencies


def measure_tinkerq(producer: Producer, n: int) -> list[float]:
    request = SampleRequest(model_id="bench", prompt_tokens=[1], sampling_params=SamplingParams(max_tokens=1))
    latencies = []
    for _ in tqdm(range(n), desc="tinkerq sample", leave=False):
        t0 = time.perf_counter()
        ticket = producer.submit(request)
        expect(producer.wait(ticket.request_id, 10), "sample", f"sample {ticket.request_id}", 10)
        latencies.append(time.perf_counter() - t0)
    return latencies


def measure_batch(producer: Producer, size: int, rounds: int) -> list[float]:
    requests = [SampleRequest(model_id="bench", prompt_tokens=list(range(3, 19)), num_samples=4,
                              sampling_params=SamplingParams(max_tokens=128, seed=i, stop=[])) for i in range(size)]
    latencies = []
    for _ in tqdm(range(rounds), desc=f"rounds of {size}", leave=False):
        t0 = time.perf_counter()
        tickets = producer.submit_many(requests)
        for t in tickets:
            expect(producer.wait(t.request_id, 30), "sample", f"sample {t.request_id} of a round of {size}", 30)
        latencies.append(time.perf_counter() - t0)
    return latencies


def enqueue_rate(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="single samples (and bare jobs) measured")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="requests per round in the batch measurement")
    parser.add_argument("--rounds", type=int, help="rounds of --batch requests (default: max(10, n / 10))")
    parser.add_argument("--enqueues", type=int, default=2000, help="jobs enqueued for each enqueue rate")
    parser.add_argument("--quick", action="store_true",
                        help=f"small rounds, a few seconds ({', '.join(f'--{k} {v}' for k, v in QUICK.items())})")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "queue_overhead.json"))
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    rounds = args.rounds or max(10, args.n // 10)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    worker_log = out.with_name(out.stem + "-worker.log")
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        r = Redis.from_url(url)
        r.flushdb()
        config = QueueConfig(num_shards=1)
        producer = Producer(r, config)
        procs = [bare_rq_worker(url), tinkerq_worker(url, worker_log)]
        stack.callback(stop, procs)
        ticket = producer.submit(CreateModelRequest(model_id="bench", base_model="ref"))
        expect(producer.wait(ticket.request_id, 60), "create_model", "create_model 'bench' (base 'ref')", 60,
               worker_log)
        measure_bare(r, args.warmup)
        measure_tinkerq(producer, args.warmup)
        # interleave the two in rounds so drift on a shared 2-core machine hits both alike
        bare, ours = [], []
        for _ in range(5):
            bare += measure_bare(r, args.n // 5)
            ours += measure_tinkerq(producer, args.n // 5)
        batch = measure_batch(producer, args.batch, rounds)
        stop(procs)
        producer.close()
        r.flushdb()
        producer = Producer(r, config)
        queue = Queue("bench.enqueue", connection=r, serializer="json")
        sample = SampleRequest(model_id="bench", prompt_tokens=[1, 2, 3, 4])
        rq_rate = enqueue_rate(lambda: queue.enqueue("os.getpid"), args.enqueues)
        our_rate = enqueue_rate(lambda: producer.submit(sample), args.enqueues)
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "n": len(ours),
        "bare_rq": percentiles(bare),
        "tinkerq": percentiles(ours),
        "p50_ratio": statistics.median(ours) / statistics.median(bare),
        "enqueue_per_s": {"bare_rq": rq_rate, "tinkerq": our_rate},
        "batch_round": {"requests": args.batch, "rounds": len(batch), **percentiles(batch)},
        "quick": args.quick,
    }
    rows = [("bare RQ no-op", report["bare_rq"]), ("tinkerq sample", report["tinkerq"])]
    print(f"\n{'path':<16}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for name, p in rows:
        print(f"{name:<16}{p['p50_ms']:>9.2f}{p['p90_ms']:>9.2f}{p['p99_ms']:>9.2f}{p['mean_ms']:>9.2f}")
    print(f"p50 ratio tinkerq / bare RQ: {report['p50_ratio']:.2f}  (target <= 1.3, and p50 < 3 ms)")
    print(f"enqueue: bare RQ {rq_rate:,.0f}/s, tinkerq {our_rate:,.0f}/s")
    b = report["batch_round"]
    print(f"a round of {args.batch} requests x 4 samples x 128 tokens (submit_many, no engine time): "
          f"p50 {b['p50_ms']:.1f} ms, p90 {b['p90_ms']:.1f} ms")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
