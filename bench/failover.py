"""How long a dead worker's requests wait: SIGKILL of the shard owner to the first result served by the standby.

    python bench/failover.py [--rounds 5] [--lease-ttl-ms 3000] [--train-steps 5] [--runtime reference]
                             [--preload auto] [--standby-log-level INFO]

Each round, on a private redis-server: worker A takes every shard, worker B stands by; a model is created and
trained `--train-steps` steps (forward_backward + optim_step) and synced, so the standby must rebuild it from its
journal before it can serve. Then samples of the model arrive every 20 ms, A is SIGKILLed, and the clock runs from
the kill to B's first stored result (A is gone: whatever is stored after the kill is B's), the takeover itself;
the target (issue 17) is at most 2x the lease TTL: a standby cannot take a shard before the dead owner's lease
lapses. Also timed: the first result of a sample submitted after the kill, which waits behind the backlog A left
(50 samples a second for a TTL) and so measures the engine's catching up too. Every sample
submitted around the kill must get exactly one result, none an error. Prints a table and writes
bench/results/failover.json and a PNG of the per-round times against the TTL.

The standby warms the model's base (TINKERQ_PRELOAD_BASES, `--preload`; default auto: the bases of the models on
the shards it may take) once the model exists; with the torch runtime the kill waits for its log to say so, so the
round times the takeover and not the standby's start. `--preload none` times the lazy start. From the standby's log
(at `--standby-log-level INFO`) each round also gets when, after the kill, it owned the shards and began the model's
restore.
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commands.processes import TinkerqProc  # noqa: E402
from commands.redis_server import EmbeddedRedis  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import (  # noqa: E402
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq import keys  # noqa: E402
from tinkerq.config import QueueConfig  # noqa: E402
from tinkerq.shards import shard_rows  # noqa: E402


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def served(producer: Producer, request_id: str, timeout_s: float = 120):
    out = producer.wait(request_id, timeout_s)
    if out is None or isinstance(out, ErrorResponse):
        raise RuntimeError(f"{request_id}: {out}")
    return out


def log_times(text: str, after: float) -> dict[str, float]:
    """Seconds from `after` (a wall-clock time) to the first line of each event in a standby's log."""
    events = {"owned_s": "now owns shards", "restore_s": ("replaying journal entries", "loading its checkpoint")}
    out: dict[str, float] = {}
    for line in text.splitlines():
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if stamp < after:
            continue
        for name, marks in events.items():
            if name not in out and any(mark in line for mark in ([marks] if isinstance(marks, str) else marks)):
                out[name] = stamp - after
    return out


def train(producer: Producer, model: str, steps: int, base: str) -> None:
    ops = [CreateModelRequest(model_id=model, base_model=base, lora=LoraConfig(rank=4))]  # a real model's needs
    datum = Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2.0, 3.0, 4.0]})
    for step in range(steps):
        ops += [ForwardBackwardRequest(model_id=model, seq_id=2 * step + 1, data=[datum]),
                OptimStepRequest(model_id=model, seq_id=2 * step + 2)]
    ops.append(WeightSyncRequest(model_id=model))
    for ticket in [producer.submit(op) for op in ops]:
        served(producer, ticket.request_id)


def one_round(args, redis: Redis, url: str, workdir: Path, index: int) -> dict:
    config = QueueConfig(num_shards=args.shards, lease_ttl_ms=args.lease_ttl_ms)
    env = {"TINKERQ_RUNTIME": args.runtime, "TINKERQ_NUM_SHARDS": str(args.shards),
           "TINKERQ_LEASE_TTL_MS": str(args.lease_ttl_ms), "TINKERQ_CHECKPOINT_ROOT": str(workdir),
           "TINKERQ_PRELOAD_BASES": args.preload}
    redis.flushdb()

    def start(level: str = "WARNING") -> TinkerqProc:
        return TinkerqProc(["worker", "--redis-url", url, "--log-level", level], env, workdir)

    owner, standby = start(), None
    producer = Producer(redis, config)
    try:
        wait_until(lambda: all(r.owner for r in shard_rows(redis, args.shards)), 60, "A's leases")
        standby = start(args.standby_log_level)
        # B is standing by once its runtime is loaded and it talks to Redis (its connections carry its pid in their
        # name): a kill before that would time B's start-up, not the takeover
        wait_until(lambda: any(f"-{standby.proc.pid}-" in (c.get("name") or "") for c in redis.client_list()), 120,
                   "B standing by")
        model = f"failover:train:{index}"
        train(producer, model, args.train_steps, args.base)
        if args.runtime != "reference" and args.preload != "none" and args.standby_log_level in ("INFO", "DEBUG"):
            wait_until(lambda: f"warmed base model {args.base}" in standby.output(), 120, "B warming its base")
        sample = SampleRequest(model_id=model, prompt_tokens=[1, 2], sampling_params=SamplingParams(max_tokens=2))
        tickets: list[tuple[float, str]] = []
        stop = threading.Event()

        def stream() -> None:
            while not stop.is_set():
                tickets.append((time.monotonic(), producer.submit(sample).request_id))
                time.sleep(0.02)

        feeder = threading.Thread(target=stream, daemon=True)
        feeder.start()
        time.sleep(0.5)
        killed, killed_wall = time.monotonic(), time.time()
        owner.kill()  # returns once A is dead: every result stored from now on is B's
        done = {rid for _, rid in list(tickets) if redis.exists(keys.result_key(rid))}
        first = after = None
        while after is None and time.monotonic() - killed < 120:
            for submitted, rid in list(tickets):
                if rid in done or not redis.exists(keys.result_key(rid)):
                    continue
                first = first or time.monotonic()  # B's first result (the backlog A left comes first)
                if submitted > killed:
                    after = time.monotonic()  # the first sample submitted after the kill: the backlog served too
                    break
            time.sleep(0.005)
        time.sleep(0.5)
        stop.set()
        feeder.join(5)
        outs = [producer.wait(rid, 120) for _, rid in tickets]
        errors = [o.code for o in outs if isinstance(o, ErrorResponse)]
        lost = sum(o is None for o in outs)
        return {"round": index, "first_result_s": None if first is None else first - killed,
                "backlog_served_s": None if after is None else after - killed,
                "samples": len(tickets), "errors": errors, "lost": lost,
                **log_times(standby.output(), killed_wall), "standby_log": str(standby.log_path)}
    finally:
        producer.close()
        for proc in (owner, standby):
            if proc is not None:
                proc.kill()


def plot(rows: list[dict], ttl_s: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["round"] for r in rows], [r["first_result_s"] or 0 for r in rows], label="SIGKILL → first result")
    ax.axhline(ttl_s, color="gray", linestyle="--", label="lease TTL")
    ax.axhline(2 * ttl_s, color="red", linestyle=":", label="target: 2 × TTL")
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease-ttl-ms", type=int, default=3000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--runtime", default="reference")
    parser.add_argument("--base", default="ref")
    parser.add_argument("--preload", default="auto", help="the standby's TINKERQ_PRELOAD_BASES (none: start lazily)")
    parser.add_argument("--standby-log-level", default="INFO")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "failover.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tinkerq-failover-"))
    rows = []
    with EmbeddedRedis() as server:
        redis = Redis.from_url(server.url)
        for index in range(args.rounds):
            rows.append(one_round(args, redis, server.url, workdir, index))
            r = rows[-1]
            print(f"round {index}: B's first result {r['first_result_s']:.2f} s after SIGKILL (it owned the shards "
                  f"at {r.get('owned_s', float('nan')):.2f} s, began the restore at "
                  f"{r.get('restore_s', float('nan')):.2f} s), the backlog served "
                  f"{r['backlog_served_s']:.2f} s after; {r['samples']} samples, "
                  f"{len(r['errors'])} errors, {r['lost']} without a result", flush=True)
    ttl_s = args.lease_ttl_ms / 1000
    times = [r["first_result_s"] for r in rows if r["first_result_s"] is not None]
    backlog = [r["backlog_served_s"] for r in rows if r["backlog_served_s"] is not None]
    summary = {"lease_ttl_s": ttl_s, "median_s": statistics.median(times), "max_s": max(times),
               "backlog_served_median_s": statistics.median(backlog),
               "max_over_ttl": max(times) / ttl_s, "median_over_ttl": statistics.median(times) / ttl_s,
               **{f"{event}_median": statistics.median(r[event] for r in rows if event in r)
                  for event in ("owned_s", "restore_s") if any(event in r for r in rows)},
               "errors": sum(len(r["errors"]) for r in rows),
               "lost": sum(r["lost"] for r in rows)}
    print(f"\n{'lease TTL s':>11} {'median s':>9} {'max s':>7} {'max / TTL':>9} {'backlog s':>9} {'errors':>6} "
          f"{'lost':>5}")
    print(f"{ttl_s:11.1f} {summary['median_s']:9.2f} {summary['max_s']:7.2f} {summary['max_over_ttl']:9.2f} "
          f"{summary['backlog_served_median_s']:9.2f} {summary['errors']:6d} {summary['lost']:5d}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": vars(args), "machine": platform.node(), "summary": summary,
                               "rounds": rows}, indent=2))
    print(f"wrote {out}")
    plot(rows, ttl_s, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
