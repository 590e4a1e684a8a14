"""What durability costs: the worker's time per training op with the journal on (TINKERQ_DURABLE=1, the
default) and off, interleaved in one run on one runtime, and what a takeover costs: rebuilding a model from its
journal on a fresh runtime, against the number of steps journaled.

    python bench/durability.py [--base tinyq-micro] [--steps 20] [--rounds 4] [--batch 8] [--device cpu|cuda]

The time per op is the dispatcher's (restore check, the op itself, the fenced result write with or without the
journal entry), measured inside an in-process worker; REDIS_URL, or a private redis-server is started.
Prints a table and writes bench/out/durability.json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer import Producer  # noqa: E402
from schemas import (  # noqa: E402
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
)
from tinkerq.config import QueueConfig, RuntimeConfig  # noqa: E402
from commands.redis_server import EmbeddedRedis  # noqa: E402
from worker.journal import Journal  # noqa: E402
from worker.main import WorkerProcess  # noqa: E402
from worker.restore import Restorer  # noqa: E402
from worker.runtime.factory import build_runtime  # noqa: E402


def datum(i: int, length: int) -> Datum:
    tokens = [(7 * i + j) % 1000 + 3 for j in range(length + 1)]
    return Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in tokens[1:]]})


def ops(model_id: str, steps: int, batch: int, length: int, rank: int) -> list:
    out: list = [CreateModelRequest(model_id=model_id, base_model=ARGS.base, lora=LoraConfig(rank=rank, seed=1))]
    for step in range(steps):
        out += [ForwardBackwardRequest(model_id=model_id, seq_id=2 * step + 1,
                                       data=[datum(step * batch + i, length) for i in range(batch)]),
                OptimStepRequest(model_id=model_id, seq_id=2 * step + 2, adam_params=AdamParams(learning_rate=1e-3))]
    return out


def timed(worker: WorkerProcess, times: dict[str, list[float]]) -> None:
    """Record the wall time the dispatcher spends on each training op, by kind."""
    execute = worker.dispatcher._execute

    def each(shard, rid, request):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        execute(shard, rid, request)
        times.setdefault(request.kind, []).append(time.perf_counter() - t0)

    worker.dispatcher.sequencer.execute = each


def run(r: Redis, runtime, durable: bool, model_id: str, times: dict) -> None:
    config = QueueConfig(num_shards=1, durable=durable)
    producer = Producer(r, config)
    worker = WorkerProcess(r, runtime, config)
    timed(worker, times)
    for op in ops(model_id, ARGS.steps, ARGS.batch, ARGS.length, ARGS.rank):
        producer.submit(op)
    worker.run(burst=True, logging_level="WARNING")


def write_costs(r: Redis, request, n: int = 300) -> dict[str, float]:
    """The result write alone, p50 ms, without and with the journal entry of a forward_backward of this shape
    (interleaved): the part of the overhead the shared machine's noise does not drown."""
    from tinkerq import keys
    from worker.fencing import Fence

    fence = Fence(r, "bench", 60_000)
    fence.acquire([0])
    plain, journaled = [], []
    entry = request.model_dump_json()
    for i in range(n):
        t0 = time.perf_counter()
        fence.put_result(0, f"plain-{i}", '{"type": "forward_backward"}', 60, "done")
        t1 = time.perf_counter()
        fence.put_result_journaled(0, f"journaled-{i}", '{"type": "forward_backward"}', 60, "done",
                                   keys.journal_key("w:train:0"), entry, keys.last_seq_key("w:train:0"), i)
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        journaled.append(t2 - t1)
    fence.release()
    return {"put_result_p50_ms": statistics.median(plain) * 1e3,
            "put_result_journaled_p50_ms": statistics.median(journaled) * 1e3, "entry_bytes": len(entry)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = None if ARGS.redis_url else EmbeddedRedis().start()
        url = ARGS.redis_url or server.url
        r = Redis.from_url(url)
        r.flushall()
        rc = RuntimeConfig(runtime="torch", checkpoint_root=tmp, device=ARGS.device, engine="torch")
        runtime = build_runtime(rc)
        times = {True: {}, False: {}}
        run(r, runtime, True, "warmup:train:0", {})
        for i in range(ARGS.rounds):  # interleaved: drift on a shared machine hits both alike
            for durable in (i % 2 == 0, i % 2 == 1):
                run(r, runtime, durable, f"m{i}{int(durable)}:train:0", times[durable])
        journal_bytes = sum(len(e) for e in r.lrange(Journal.key("m01:train:0"), 0, -1))
        writes = write_costs(r, ops("w:train:0", 1, ARGS.batch, ARGS.length, ARGS.rank)[1])
        restores = []
        for _ in range(3):
            fresh = build_runtime(rc)
            t0 = time.perf_counter()
            assert Restorer(r, fresh, Journal(r)).ensure("m01:train:0") is None
            restores.append(time.perf_counter() - t0)
        if server is not None:
            server.stop()

    rows = []
    for kind in ("forward_backward", "optim_step"):
        on, off = statistics.median(times[True][kind]) * 1e3, statistics.median(times[False][kind]) * 1e3
        rows.append({"op": kind, "off_p50_ms": off, "on_p50_ms": on, "ratio": on / off, "n": len(times[True][kind])})
    step_on = sum(r_["on_p50_ms"] for r_ in rows)
    step_off = sum(r_["off_p50_ms"] for r_ in rows)
    out = {"machine": platform.platform(), "python": platform.python_version(), "args": vars(ARGS), "ops": rows,
           "step_ratio": step_on / step_off, "journal_bytes_per_model": journal_bytes,
           "restore_s_p50": statistics.median(restores), "writes": writes, "restore_steps": ARGS.steps}
    print("| op | durable off p50 ms | on p50 ms | on / off |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['op']} | {row['off_p50_ms']:.2f} | {row['on_p50_ms']:.2f} | {row['ratio']:.3f} |")
    print(f"| fb + optim_step | {step_off:.2f} | {step_on:.2f} | {step_on / step_off:.3f} |")
    print(f"journal of one model after {ARGS.steps} steps: {journal_bytes / 1024:.1f} KiB; "
          f"rebuilding it on a fresh runtime: {out['restore_s_p50'] * 1e3:.0f} ms (p50 of 3)")
    print(f"result write alone: {writes['put_result_p50_ms']:.3f} ms plain, "
          f"{writes['put_result_journaled_p50_ms']:.3f} ms with a {writes['entry_bytes']} B journal entry (p50)")
    target = ROOT / "bench" / "out"
    target.mkdir(exist_ok=True)
    (target / "durability.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="tinyq-micro")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ARGS = parser.parse_args()
    main()
