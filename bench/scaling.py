"""Throughput with 1, 2, 4 workers on the same shards: does adding a worker add capacity?

    python bench/scaling.py [--workers 1,2,4] [--shards 8] [--models 16] [--requests 2000] \
        [--delays 0,0.01] [--runtime reference]

For each worker count and each simulated engine time per token (`--delays`, the reference runtime's
TINKERQ_REFERENCE_DELAY_PER_TOKEN_S; 0 = the queue's own cost alone), on a private redis-server: N `tinkerq worker`
processes, each given shards i, i+N, ... (so N workers split K shards evenly), and `--requests` samples of
`--models` models (spread over the shards) submitted in one go; the clock runs from the submit to the last
result. Prints requests/s and the speed-up over one worker, writes bench/results/scaling.json and a PNG.

On this project's 2-vCPU machine the ceiling is the CPU: with no engine time every worker process and Redis
compete for two cores, so a second worker adds little and a fourth nothing; with engine time (a GPU's work, here a
sleep) the workers overlap it and throughput grows with their count until the cores are busy again.
"""

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.failover import served, wait_until  # noqa: E402
from commands.processes import TinkerqProc  # noqa: E402
from commands.redis_server import EmbeddedRedis  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import CreateModelRequest, SampleRequest, SamplingParams  # noqa: E402
from tinkerq.config import QueueConfig  # noqa: E402
from tinkerq.shards import shard_rows  # noqa: E402


def measure(args, redis: Redis, url: str, workdir: Path, workers: int, delay: float) -> dict:
    redis.flushdb()
    config = QueueConfig(num_shards=args.shards)
    env = {"TINKERQ_RUNTIME": args.runtime, "TINKERQ_NUM_SHARDS": str(args.shards),
           "TINKERQ_CHECKPOINT_ROOT": str(workdir), "TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": str(delay)}
    procs = [TinkerqProc(["worker", "--redis-url", url, "--log-level", "WARNING",
                          "--shards", ",".join(str(s) for s in range(i, args.shards, workers))], env, workdir)
             for i in range(workers)]
    producer = Producer(redis, config)
    try:
        wait_until(lambda: all(r.owner for r in shard_rows(redis, args.shards)), 60, "every shard's lease")
        models = [f"scale:train:{m}" for m in range(args.models)]
        for ticket in [producer.submit(CreateModelRequest(model_id=m, base_model=args.base)) for m in models]:
            served(producer, ticket.request_id)
        params = SamplingParams(max_tokens=args.max_tokens)
        requests = [SampleRequest(model_id=models[i % len(models)], prompt_tokens=[1, 2, 3], sampling_params=params)
                    for i in range(args.requests)]
        start = time.monotonic()
        tickets = producer.submit_many(requests)
        for ticket in tickets:
            served(producer, ticket.request_id, 600)
        took = time.monotonic() - start
    finally:
        producer.close()
        for proc in procs:
            proc.kill(signal.SIGTERM)
    return {"workers": workers, "delay_per_token_s": delay, "requests": args.requests, "seconds": took,
            "requests_per_s": args.requests / took}


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for delay in sorted({r["delay_per_token_s"] for r in rows}):
        mine = [r for r in rows if r["delay_per_token_s"] == delay]
        ax.plot([r["workers"] for r in mine], [r["speedup"] for r in mine], marker="o",
                label=f"engine {delay * 1e3:g} ms/token")
    ax.plot([1, max(r["workers"] for r in rows)], [1, max(r["workers"] for r in rows)], color="gray",
            linestyle=":", label="linear")
    ax.set_xlabel("workers")
    ax.set_ylabel("throughput / one worker")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--delays", default="0,0.01")
    parser.add_argument("--runtime", default="reference")
    parser.add_argument("--base", default="ref")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaling.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tinkerq-scaling-"))
    rows = []
    with EmbeddedRedis() as server:
        redis = Redis.from_url(server.url)
        for delay in [float(d) for d in args.delays.split(",")]:
            for workers in [int(w) for w in args.workers.split(",")]:
                rows.append(measure(args, redis, server.url, workdir, workers, delay))
                print(f"{workers} worker(s), engine {delay * 1e3:g} ms/token: {rows[-1]['requests_per_s']:.1f} req/s",
                      flush=True)
    for row in rows:
        one = next(r for r in rows if r["delay_per_token_s"] == row["delay_per_token_s"] and r["workers"] == 1)
        row["speedup"] = row["requests_per_s"] / one["requests_per_s"]
    print(f"\n{'engine ms/token':>15} {'workers':>7} {'req/s':>8} {'x one worker':>12}")
    for r in rows:
        print(f"{r['delay_per_token_s'] * 1e3:15g} {r['workers']:7d} {r['requests_per_s']:8.1f} {r['speedup']:12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": vars(args), "machine": platform.node(), "cpus": os.cpu_count(),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
