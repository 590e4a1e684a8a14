"""Head-of-line blocking between tenants: tenant B's short samples, submit -> result, while tenant A is idle and
while A runs forward_backward + optim_step back to back on the same shard. One worker, one shard, both tenants'
models on one base, for each schedule in one run: the serial one (TINKERQ_LANES=0: one job at a time, so B waits
for A's whole op) and the lanes (B's samples served while A trains). The goal: with the lanes, B's busy p99 at
most 2x its idle p99.

    python bench/tenant_latency.py [--samples 60] [--engine torch] [--fb-datums 32 --fb-tokens 256]
    python bench/tenant_latency.py --quick          (a few samples: shows every path answers)

REDIS_URL, or a private redis-server is started. Prints a table, writes bench/out/tenant_latency.json, a
histogram of B's latencies (.png beside it) and a timeline of both lanes (-timeline.png).
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


def tenant_b(producer: Producer, n: int, label: str, log: Path, ids: list[str] | None = None) -> list[float]:
    """B's samples one after another, as a latency-bound client sends them: each waits for the one before."""
    request = SampleRequest(model_id="tenant-b", prompt_tokens=[5, 6, 7, 8],
                            sampling_params=SamplingParams(max_tokens=8, temperature=0))
    latencies = []
    for _ in tqdm(range(n), desc=f"B's samples, A {label}", leave=False):
        t0 = time.perf_counter()
        ticket = producer.submit(request)
        expect(producer.wait(ticket.request_id, 120), "sample", f"B's sample {ticket.request_id}", 120, log)
        latencies.append(time.perf_counter() - t0)
        if ids is not None:
            ids.append(ticket.request_id)
    return latencies


def tenant_a(producer: Producer, datums: list[Datum], stop: threading.Event, log: Path, ops: list[float],
             ids: list[str]) -> None:
    """A's training, back to back until `stop`: each op submitted once the one before answered."""
    step = [ForwardBackwardRequest(model_id="tenant-a", data=datums),
            OptimStepRequest(model_id="tenant-a", adam_params=AdamParams(learning_rate=1e-3))]
    while not stop.is_set():
        for request in step:
            t0 = time.perf_counter()
            ticket = producer.submit(request)
            expect(producer.wait(ticket.request_id, 300), request.kind, f"A's {request.kind}", 300, log)
            ops.append(time.perf_counter() - t0)
            ids.append(ticket.request_id)


def spans(r: Redis, ids: list[str]) -> list[tuple[float, float]]:
    """When the worker started and ended each job (its RQ job hash; marked just after the result is stored)."""
    from rq.utils import utcparse

    found = []
    for rid in ids:
        for _ in range(100):
            started, ended = r.hmget(f"rq:job:{rid}", "started_at", "ended_at")
            if started and ended:
                found.append((utcparse(started.decode()).timestamp(), utcparse(ended.decode()).timestamp()))
                break
            time.sleep(0.05)
    return found


def measure(schedule: str, args: argparse.Namespace, url: str, datums: list[Datum], out_dir: Path) -> dict:
    """One schedule: a fresh worker and database; B idle, then B while A trains. Latencies and the jobs' spans."""
    r = Redis.from_url(url)
    r.flushdb()
    config = QueueConfig(num_shards=1)  # both tenants on one shard: the case a serial worker blocks
    env = {"TINKERQ_NUM_SHARDS": "1", "TINKERQ_LANES": "1" if schedule == "lanes" else "0"}
    worker = TinkerqProc(["worker", "--redis-url", url, "--runtime", "torch", "--engine", args.engine,
                          "--log-level", "WARNING"], env, out_dir)
    try:
        producer, trainer = Producer(r, config), Producer(Redis.from_url(url), config)
        for model in ("tenant-a", "tenant-b"):
            ticket = producer.submit(CreateModelRequest(model_id=model, base_model=args.base,
                                                        lora=LoraConfig(rank=8)))
            expect(producer.wait(ticket.request_id, 600), "create_model", f"create {model}", 600,
                   worker.log_path)
        tenant_b(producer, 3, f"idle (warm-up, {schedule})", worker.log_path)
        idle = tenant_b(producer, args.samples, f"idle ({schedule})", worker.log_path)
        stop, ops, a_ids, b_ids = threading.Event(), [], [], []
        a = threading.Thread(target=tenant_a, args=(trainer, datums, stop, worker.log_path, ops, a_ids), daemon=True)
        a.start()
        while not ops and a.is_alive():  # A's first op has been answered: it is training back to back
            time.sleep(0.05)
        busy = tenant_b(producer, args.samples, f"training ({schedule})", worker.log_path, b_ids)
        stop.set()
        a.join(300)
        timeline = {"a_ops": spans(r, a_ids), "b_samples": spans(r, b_ids)}
    finally:
        worker.kill(signal.SIGTERM)
    return {"idle": idle, "busy": busy, "ops": ops, "timeline": timeline}


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = [("A idle", runs["lanes" if "lanes" in runs else next(iter(runs))]["idle"])]
    series += [(f"A training, {name}", run["busy"]) for name, run in runs.items()]
    top = max(max(values) for _, values in series) * 1000
    bins = [top * i / 40 for i in range(41)]
    ax.hist([[s * 1000 for s in values] for _, values in series], bins=bins, alpha=0.7,
            label=[label for label, _ in series])
    ax.set_xlabel("tenant B's sample latency, submit -> result (ms)")
    ax.set_ylabel("samples")
    ax.set_title("Head-of-line blocking between tenants on one shard")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_timeline(runs: dict[str, dict], path: Path, window_s: float = 5.0) -> None:
    """Each schedule's first seconds of A training: A's ops (the training lane) and B's samples (the sampling
    lane) as bars over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.8 * len(runs) + 0.6), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        lanes = [("A's forward_backward / optim_step", run["timeline"]["a_ops"], "tab:orange"),
                 ("B's samples", run["timeline"]["b_samples"], "tab:blue")]
        t0 = min((s for _, spans_, _ in lanes for s, _ in spans_), default=0.0)
        for row, (_, spans_, color) in enumerate(lanes):
            bars = [(s - t0, e - s) for s, e in spans_ if s - t0 < window_s]
            ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(lanes)), [label for label, _, _ in lanes])
        ax.set_xlim(0, window_s)
        ax.set_title(f"{name} schedule", fontsize=10)
    axes[-1, 0].set_xlabel("seconds since A's first measured op (job start to end, from RQ's job hashes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60, help="B's samples measured with A idle, and with A busy")
    parser.add_argument("--engine", default="torch", help="the worker's sampling engine (torch, vllm)")
    parser.add_argument("--base", default="tinyq-micro")
    parser.add_argument("--fb-datums", type=int, default=32, help="datums in each of A's forward_backwards")
    parser.add_argument("--fb-tokens", type=int, default=256, help="tokens in each of those datums")
    parser.add_argument("--schedules", default="serial,lanes", help="the worker's schedules to measure, in order")
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
        runs = {schedule: measure(schedule, args, url, datums, out.parent) for schedule in args.schedules.split(",")}
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "engine": args.engine, "base": args.base, "a_op": {"datums": args.fb_datums, "tokens": args.fb_tokens},
        "quick": args.quick, "schedules": {},
    }
    print(f"\n{'schedule':<8}{'tenant B, A is':<24}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for name, run in runs.items():
        row = {"b_idle": percentiles(run["idle"]), "b_busy": percentiles(run["busy"]),
               "a_ops": percentiles(run["ops"])}
        row["p99_ratio"] = row["b_busy"]["p99_ms"] / row["b_idle"]["p99_ms"]
        report["schedules"][name] = row
        for label, key in (("idle", "b_idle"), ("training back to back", "b_busy")):
            p = row[key]
            print(f"{name:<8}{label:<24}{p['p50_ms']:>9.1f}{p['p90_ms']:>9.1f}{p['p99_ms']:>9.1f}{p['max_ms']:>9.1f}")
    for name, row in report["schedules"].items():
        print(f"{name}: B's p99, A training / A idle: {row['p99_ratio']:.2f}; A's ops p50 "
              f"{row['a_ops']['p50_ms']:.1f} ms over {len(runs[name]['ops'])}")
    print("the lanes' goal: B's p99 ratio <= 2")
    out.write_text(json.dumps(report, indent=2))
    plot(runs, out.with_suffix(".png"))
    timeline = out.with_name(out.stem + "-timeline.png")
    plot_timeline(runs, timeline)
    print(f"wrote {out}, {out.with_suffix('.png')} and {timeline}")


if __name__ == "__main__":
    main()
