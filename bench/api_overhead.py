"""What the HTTP layer costs: the real tinker SDK sampling through `tinkerq api`, against the same
samples submitted with the producer library directly, in one run, at C concurrent samplers.

    python bench/api_overhead.py [--concurrency 64] [--rounds 8] [--max-tokens 16]

Both paths share one Redis and one `tinkerq worker --runtime torch` (tinyq-micro). Each round sends
C requests at once and waits for all of them; the paths alternate round by round.
Prints a table and writes bench/out/api_overhead.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tinker  # noqa: E402
from redis import Redis  # noqa: E402
from tinker import types  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer import Producer  # noqa: E402
from schemas import SampleRequest, SamplingParams  # noqa: E402
from tinkerq.config import QueueConfig  # noqa: E402
from tinkerq.redis_server import EmbeddedRedis, free_port  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def start(args: list[str], env: dict[str, str], cpus: str | None = None) -> subprocess.Popen:
    pin = ["taskset", "-c", cpus] if cpus else []
    return subprocess.Popen([*pin, sys.executable, "-m", "tinkerq.cli", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_http(url: str) -> None:
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def sdk_round(sampler, n: int, params: types.SamplingParams) -> tuple[float, list[float]]:
    started = time.perf_counter()
    futures = [(time.perf_counter(), sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                                    sampling_params=params)) for _ in range(n)]
    latencies = []
    for sent, future in futures:
        future.result()
        latencies.append(time.perf_counter() - sent)
    return time.perf_counter() - started, latencies


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
    parser.add_argument("--split-cores", action="store_true",
                        help="worker on the last core, API and clients on the others (as on separate hosts)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "api_overhead.json"))
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    worker_cpus = client_cpus = None
    if args.split_cores:
        worker_cpus, client_cpus = str(cores[-1]), ",".join(map(str, cores[:-1]))
        os.sched_setaffinity(0, set(cores[:-1]))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinkerq-api-bench-{os.getpid()}"
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        Redis.from_url(url).flushdb()
        env = {"TINKERQ_NUM_SHARDS": "1", "TINKERQ_CHECKPOINT_ROOT": str(tmp)}
        port = free_port()
        procs = [start(["worker", "--redis-url", url, "--runtime", "torch", "--log-level", "WARNING"], env, worker_cpus),
                 start(["api", "--redis-url", url, "--port", str(port), "--log-level", "warning"], env, client_cpus)]
        stack.callback(lambda: [p.terminate() for p in procs])
        base_url = f"http://127.0.0.1:{port}"
        wait_http(f"{base_url}/api/v1/healthz")
        client = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
        trainer = client.create_lora_training_client(base_model="tinyq-micro", rank=8, seed=0).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[])
        # the same snapshot for the direct path: the one sampling session this run created
        redis = Redis.from_url(url)
        sampler_state = redis.hgetall(next(redis.scan_iter("tq:sampler:*")))
        producer = Producer(Redis.from_url(url, max_connections=4 * args.concurrency), QueueConfig(num_shards=1))
        stack.callback(producer.close)
        request = SampleRequest(model_id=sampler_state[b"model_id"].decode(), prompt_tokens=PROMPT,
                                weights_version=int(sampler_state[b"version"]),
                                sampling_params=SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[]))
        pool = stack.enter_context(ThreadPoolExecutor(args.concurrency))
        sdk_round(sampler, 8, params)
        direct_round(pool, producer, request, 8)  # warm-up
        rows = {"sdk_via_api": ([], []), "producer_direct": ([], [])}
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for name, run in (("sdk_via_api", lambda: sdk_round(sampler, args.concurrency, params)),
                              ("producer_direct", lambda: direct_round(pool, producer, request, args.concurrency))):
                seconds, latencies = run()
                rows[name][0].append(args.concurrency / seconds)
                rows[name][1].extend(latencies)
        client.close("success").result()
    report = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "workload": {k: v for k, v in vars(args).items() if k != "out"}}
    for name, (rates, latencies) in rows.items():
        report[name] = {"samples_per_s": statistics.median(rates), "p50_ms": 1000 * statistics.median(latencies),
                        "p99_ms": 1000 * sorted(latencies)[int(0.99 * len(latencies)) - 1]}
    sdk, direct = report["sdk_via_api"], report["producer_direct"]
    report["throughput_overhead"] = 1 - sdk["samples_per_s"] / direct["samples_per_s"]
    report["p50_latency_overhead"] = sdk["p50_ms"] / direct["p50_ms"] - 1
    print(f"\n{'path':<28}{'samples/s':>10}{'p50 ms':>9}{'p99 ms':>9}   ({args.concurrency} concurrent, "
          f"{args.rounds} rounds)")
    for name in rows:
        print(f"{name:<28}{report[name]['samples_per_s']:>10.1f}{report[name]['p50_ms']:>9.1f}"
              f"{report[name]['p99_ms']:>9.1f}")
    print(f"HTTP layer + SDK cost: throughput -{report['throughput_overhead']:.1%}, "
          f"p50 latency +{report['p50_latency_overhead']:.1%} (target < 10%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
