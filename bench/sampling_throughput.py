"""Sampling throughput through the queue against the engine called directly, in one run; and the
cost of a transient against a named (persisted) weight sync.

    python bench/sampling_throughput.py [--model tinyq-micro] [--requests 64] [--num-samples 4] [--max-tokens 32]

The same sample requests (fixed length: stop=[] so every sequence is max_tokens long) go
(a) straight to an in-process torch runtime in one `sample()` call, and
(b) through Producer.submit_many -> Redis -> a `tinkerq worker --runtime torch` process -> waiters,
and (c) through the queue submitted one request at a time. Prints a table, writes JSON.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer import Producer  # noqa: E402
from schemas import (  # noqa: E402
    CreateModelRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import QueueConfig, RuntimeConfig  # noqa: E402
from tinkerq.redis_server import EmbeddedRedis  # noqa: E402
from worker.runtime.factory import build_runtime  # noqa: E402

MODEL = "bench:train:0"


def workload(args) -> list[SampleRequest]:
    return [SampleRequest(model_id=MODEL, prompt_tokens=[(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)],
                          num_samples=args.num_samples,
                          sampling_params=SamplingParams(max_tokens=args.max_tokens, seed=i, stop=[]))
            for i in range(args.requests)]


def tokens_of(outputs) -> int:
    return sum(len(s.tokens) for o in outputs for s in o.sequences)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def direct(args, requests, tmp: Path) -> dict:
    rt = build_runtime(RuntimeConfig(runtime="torch", checkpoint_root=str(tmp / "direct")))
    rt.execute(CreateModelRequest(model_id=MODEL, base_model=args.model, lora=LoraConfig(rank=16, seed=0)))
    pinned = [r.model_copy(update={"weights_version": 0}) for r in requests]
    rt.sample(pinned[:4])  # warm-up
    rates = []
    for _ in range(args.repeats):
        outputs, seconds = timed(lambda: rt.sample(pinned))
        rates.append(tokens_of(outputs) / seconds)
    syncs, version = {}, 0
    for name in (None, "snap"):
        times = []
        for _ in range(args.repeats):
            version += 1
            sync = WeightSyncRequest(model_id=MODEL, version=version, name=name)
            output, seconds = timed(lambda: rt.execute(sync))
            assert output.applied and output.persisted == (name is not None)
            times.append(seconds * 1000)
        syncs["named" if name else "transient"] = statistics.median(times)
    return {"tokens_per_s": statistics.median(rates), "sync_ms": syncs}


def through_queue(args, requests, url: str, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKERQ_NUM_SHARDS": "1", "TINKERQ_RUNTIME": "torch",
           "TINKERQ_CHECKPOINT_ROOT": str(tmp / "queue")}
    worker = subprocess.Popen([sys.executable, "-m", "tinkerq.cli", "worker", "--redis-url", url,
                               "--log-level", "WARNING"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    producer = Producer(Redis.from_url(url), QueueConfig(num_shards=1))
    try:
        def wait_all(tickets):
            outputs = [producer.wait(t.request_id, 600) for t in tickets]
            assert all(o is not None and o.type == "sample" for o in outputs), outputs[:1]
            return outputs

        create = producer.submit(CreateModelRequest(model_id=MODEL, base_model=args.model,
                                                    lora=LoraConfig(rank=16, seed=0)))
        assert producer.wait(create.request_id, 600).type == "create_model"
        wait_all(producer.submit_many(requests[:4]))  # warm-up
        batched, single = [], []
        for _ in range(args.repeats):
            outputs, seconds = timed(lambda: wait_all(producer.submit_many(requests)))
            batched.append(tokens_of(outputs) / seconds)
            outputs, seconds = timed(lambda: wait_all([producer.submit(r) for r in requests]))
            single.append(tokens_of(outputs) / seconds)
        syncs = {}
        for name in (None, "snap"):
            times = []
            for _ in range(args.repeats):
                ticket = producer.submit(WeightSyncRequest(model_id=MODEL, name=name))
                _, seconds = timed(lambda: producer.wait(ticket.request_id, 600))
                times.append(seconds * 1000)
            syncs["named" if name else "transient"] = statistics.median(times)
        return {"tokens_per_s": statistics.median(batched), "tokens_per_s_one_by_one": statistics.median(single),
                "sync_ms": syncs}
    finally:
        producer.close()
        worker.terminate()
        worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyq-micro")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "sampling_throughput.json"))
    args = parser.parse_args()
    requests = workload(args)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinkerq-bench-{os.getpid()}"
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        Redis.from_url(url).flushdb()
        print(f"{len(requests)} requests x {args.num_samples} samples x {args.max_tokens} tokens on {args.model}")
        print("direct engine ...", flush=True)
        engine = direct(args, requests, tmp)
        print("through the queue ...", flush=True)
        queue = through_queue(args, requests, url, tmp)
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "workload": vars(args) | {"out": None},
        "direct": engine, "queue": queue,
        "ratio": queue["tokens_per_s"] / engine["tokens_per_s"],
        "ratio_one_by_one": queue["tokens_per_s_one_by_one"] / engine["tokens_per_s"],
    }
    print(f"\n{'path':<34}{'tokens/s':>10}{'ratio':>8}")
    print(f"{'engine, one sample() call':<34}{engine['tokens_per_s']:>10.0f}{1.0:>8.2f}")
    print(f"{'queue, submit_many':<34}{queue['tokens_per_s']:>10.0f}{report['ratio']:>8.2f}")
    print(f"{'queue, submitted one by one':<34}{queue['tokens_per_s_one_by_one']:>10.0f}"
          f"{report['ratio_one_by_one']:>8.2f}")
    print(f"\n{'weight sync (median ms)':<34}{'transient':>10}{'named':>8}")
    print(f"{'engine-side, in process':<34}{engine['sync_ms']['transient']:>10.1f}{engine['sync_ms']['named']:>8.1f}")
    print(f"{'through the queue':<34}{queue['sync_ms']['transient']:>10.1f}{queue['sync_ms']['named']:>8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
