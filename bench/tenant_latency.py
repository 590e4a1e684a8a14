"""Head-of-line blocking between tenants: tenant B's short samples, submit -> result, while tenant A is idle and
while A runs forward_backward + optim_step back to back on the same shard. One worker, one shard, both tenants'
models on one base. The ratio of B's busy p99 to its idle p99 is what the lanes are to bring down (a worker that
does one job at a time makes B wait for A's whole op); this measures it for whatever schedule the worker runs.

    python bench/tenant_latency.py [--samples 60] [--engine torch] [--fb-datums 32 --fb-tokens 256]
    python bench/tenant_latency.py --quick          (a few samples: shows every path answers)

REDIS_URL, or a private redis-server is started. Prints a table, writes bench/out/tenant_latency.json and a
histogram of B's latencies (.png beside it).
"""

import argparse
import json
import os
import platform
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from redis import Redis
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.answers import expect, percentiles  # noqa: E402
from commands.processes import TinkerqProc  # noqa: E402
from commands.redis_server import EmbeddedRedis  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import (  # noqa: E402
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
)
from tinkerq.config import QueueConfig  # noqa: E402

QUICK = {"samples": 8, "fb_datums": 2, "fb_tokens": 32}


def tenant_b(producer: Producer, n: int, label: str, log: Path) -> list[float]:
    """B's samples one after another, as a latency-bound client sends them: each waits for the one before."""
    request = SampleRequest(model_id="tenant-b", prompt_tokens=[5, 6, 7, 8],
                            sampling_params=SamplingParams(max_tokens=8, temperature=0))
    latencies = []
    for _ in tqdm(range(n), desc=f"B's samples, A {label}", leave=False):
        t0 = time.perf_counter()
        ticket = producer.submit(request)
        expect(producer.wait(ticket.request_id, 120), "sample", f"B's sample {ticket.request_id}", 120, log)
        latencies.append(time.perf_counter() - t0)
    return latencies


def tenant_a(producer: Producer, datums: list[Datum], stop: threading.Event, log: Path, ops: list[float]) -> None:
    """A's training, back to back until `stop`: each op submitted once the one before answered."""
    step = [ForwardBackwardRequest(model_id="tenant-a", data=datums),
            OptimStepRequest(model_id="tenant-a", adam_params=AdamParams(learning_rate=1e-3))]
    while not stop.is_set():
        for request in step:
            t0 = time.perf_counter()
            ticket = producer.submit(request)
            expect(producer.wait(ticket.request_id, 300), request.kind, f"A's {request.kind}", 300, log)
            ops.append(time.perf_counter() - t0)


def plot(idle: list[float], busy: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    top = max(idle + busy) * 1000
    bins = [top * i / 40 for i in range(41)]
    ax.hist([s * 1000 for s in idle], bins=bins, alpha=0.6, label="A idle")
    ax.hist([s * 1000 for s in busy], bins=bins, alpha=0.6, label="A training back to back")
    ax.set_xlabel("tenant B's sample latency, submit -> result (ms)")
    ax.set_ylabel("samples")
    ax.set_title("Head-of-line blocking between tenants on one shard")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60, help="B's samples measured with A idle, and with A busy")
    parser.add_argument("--engine", default="torch", help="the worker's sampling engine (torch, vllm)")
    parser.add_argument("--base", default="tinyq-micro")
    parser.add_argument("--fb-datums", type=int, default=32, help="datums in each of A's forward_backwards")
    parser.add_argument("--fb-tokens", type=int, default=256, help="tokens in each of those datums")
    quick = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"a few samples ({quick})")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "tenant_latency.json"))
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = [(7 * i) % 200 + 3 for i in range(args.fb_tokens + 1)]
    datums = [Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in tokens[1:]],
                                                             "weights": [1.0] * args.fb_tokens})] * args.fb_datums
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        r = Redis.from_url(url)
        r.flushdb()
        config = QueueConfig(num_shards=1)  # both tenants on one shard: the case a serial worker blocks
        worker = TinkerqProc(["worker", "--redis-url", url, "--runtime", "torch", "--engine", args.engine,
                              "--log-level", "WARNING"], {"TINKERQ_NUM_SHARDS": "1"}, out.parent)
        stack.callback(worker.kill, signal.SIGTERM)
        producer, trainer = Producer(r, config), Producer(Redis.from_url(url), config)
        for model in ("tenant-a", "tenant-b"):
            ticket = producer.submit(CreateModelRequest(model_id=model, base_model=args.base,
                                                        lora=LoraConfig(rank=8)))
            expect(producer.wait(ticket.request_id, 600), "create_model", f"create {model}", 600,
                   worker.log_path)
        tenant_b(producer, 3, "idle (warm-up)", worker.log_path)
        idle = tenant_b(producer, args.samples, "idle", worker.log_path)
        stop, ops = threading.Event(), []
        a = threading.Thread(target=tenant_a, args=(trainer, datums, stop, worker.log_path, ops), daemon=True)
        a.start()
        while not ops and a.is_alive():  # A's first op has been answered: it is training back to back
            time.sleep(0.05)
        busy = tenant_b(producer, args.samples, "training", worker.log_path)
        stop.set()
        a.join(300)
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "engine": args.engine, "base": args.base, "a_op": {"datums": args.fb_datums, "tokens": args.fb_tokens},
        "b_idle": percentiles(idle), "b_busy": percentiles(busy), "a_ops": percentiles(ops), "quick": args.quick,
    }
    report["p99_ratio"] = report["b_busy"]["p99_ms"] / report["b_idle"]["p99_ms"]
    print(f"\n{'tenant B, A is':<24}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for label, key in (("idle", "b_idle"), ("training back to back", "b_busy")):
        p = report[key]
        print(f"{label:<24}{p['p50_ms']:>9.1f}{p['p90_ms']:>9.1f}{p['p99_ms']:>9.1f}{p['max_ms']:>9.1f}")
    print(f"A's ops (forward_backward, optim_step): p50 {report['a_ops']['p50_ms']:.1f} ms over {len(ops)}")
    print(f"B's p99, A training / A idle: {report['p99_ratio']:.2f}  (the lanes' goal: <= 2)")
    out.write_text(json.dumps(report, indent=2))
    plot(idle, busy, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
