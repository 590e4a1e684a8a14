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
from tqdm import tqdm

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


class Direct:
    """The engine in this process, called with every request in one sample() call."""

    def __init__(self, args, tmp: Path) -> None:
        self.rt = build_runtime(RuntimeConfig(runtime="torch", checkpoint_root=str(tmp / "direct")))
        self.rt.execute(CreateModelRequest(model_id=MODEL, base_model=args.model, lora=LoraConfig(rank=16, seed=0)))
        self.version = 0

    def sample(self, requests: list[SampleRequest]) -> float:
        pinned = [r.model_copy(update={"weights_version": self.version}) for r in requests]
        outputs, seconds = timed(lambda: self.rt.sample(pinned))
        return tokens_of(outputs) / seconds

    def sync_ms(self, name: str | None) -> float:
        self.version += 1
        output, seconds = timed(lambda: self.rt.execute(WeightSyncRequest(model_id=MODEL, version=self.version,
                                                                           name=name)))
        assert output.applied and output.persisted == (name is not None)
        return seconds * 1000


class Queued:
    """The same requests through Redis and a `tinkerq worker --runtime torch` process."""

    def __init__(self, args, url: str, tmp: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKERQ_NUM_SHARDS": "1", "TINKERQ_RUNTIME": "torch",
               "TINKERQ_CHECKPOINT_ROOT": str(tmp / "queue")}
        self.worker = subprocess.Popen([sys.executable, "-m", "tinkerq.cli", "worker", "--redis-url", url,
                                        "--log-level", "WARNING"], env=env, cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.producer = Producer(Redis.from_url(url), QueueConfig(num_shards=1))
        create = self.producer.submit(CreateModelRequest(model_id=MODEL, base_model=args.model,
                                                         lora=LoraConfig(rank=16, seed=0)))
        assert self.producer.wait(create.request_id, 600).type == "create_model"

    def _wait_all(self, tickets) -> list:
        outputs = [self.producer.wait(t.request_id, 600) for t in tickets]
        assert all(o is not None and o.type == "sample" for o in outputs), outputs[:1]
        return outputs

    def sample(self, requests: list[SampleRequest], one_by_one: bool = False) -> float:
        def run():
            tickets = [self.producer.submit(r) for r in requests] if one_by_one else \
                self.producer.submit_many(requests)
            return self._wait_all(tickets)

        outputs, seconds = timed(run)
        return tokens_of(outputs) / seconds

    def sync_ms(self, name: str | None) -> float:
        ticket = self.producer.submit(WeightSyncRequest(model_id=MODEL, name=name))
        output, seconds = timed(lambda: self.producer.wait(ticket.request_id, 600))
        assert output.type == "weight_sync" and output.persisted == (name is not None)
        return seconds * 1000

    def close(self) -> None:
        self.producer.close()
        self.worker.terminate()
        self.worker.wait(30)


def measure(args, requests, url: str, tmp: Path) -> dict:
    direct, queued = Direct(args, tmp), Queued(args, url, tmp)
    try:
        direct.sample(requests[:4])
        queued.sample(requests[:4])  # warm-up
        rows: dict[str, list[float]] = {"direct": [], "queue": [], "queue_one_by_one": []}
        # rounds interleave the paths, so drift on a shared machine hits all of them alike
        for _ in tqdm(range(args.repeats), desc="rounds"):
            rows["direct"].append(direct.sample(requests))
            rows["queue"].append(queued.sample(requests))
            rows["queue_one_by_one"].append(queued.sample(requests, one_by_one=True))
        syncs = {where: {kind: statistics.median(path.sync_ms(name) for _ in range(args.repeats))
                         for kind, name in (("transient", None), ("named", "snap"))}
                 for where, path in (("direct", direct), ("queue", queued))}
    finally:
        queued.close()
    ratios = [q / d for q, d in zip(rows["queue"], rows["direct"])]
    ratios_single = [q / d for q, d in zip(rows["queue_one_by_one"], rows["direct"])]
    return {"tokens_per_s": {k: statistics.median(v) for k, v in rows.items()}, "rounds": rows,
            "ratio": statistics.median(ratios), "ratio_one_by_one": statistics.median(ratios_single),
            "sync_ms": syncs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyq-micro")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "sampling_throughput.json"))
    args = parser.parse_args()
    requests = workload(args)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinkerq-bench-{os.getpid()}"
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        Redis.from_url(url).flushdb()
        print(f"{len(requests)} requests x {args.num_samples} samples x {args.max_tokens} tokens on {args.model}")
        result = measure(args, requests, url, tmp)
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        **result,
    }
    rates = result["tokens_per_s"]
    print(f"\n{'path':<34}{'tokens/s':>10}{'ratio':>8}   (medians of {args.repeats} interleaved rounds)")
    print(f"{'engine, one sample() call':<34}{rates['direct']:>10.0f}{1.0:>8.2f}")
    print(f"{'queue, submit_many':<34}{rates['queue']:>10.0f}{result['ratio']:>8.2f}")
    print(f"{'queue, submitted one by one':<34}{rates['queue_one_by_one']:>10.0f}{result['ratio_one_by_one']:>8.2f}")
    sync = result["sync_ms"]
    print(f"\n{'weight sync (median ms)':<34}{'transient':>10}{'named':>8}")
    print(f"{'engine-side, in process':<34}{sync['direct']['transient']:>10.1f}{sync['direct']['named']:>8.1f}")
    print(f"{'through the queue':<34}{sync['queue']['transient']:>10.1f}{sync['queue']['named']:>8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
