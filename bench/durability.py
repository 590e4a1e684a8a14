"""What durability costs: the worker's time per training op with durability off, with the journal alone
(TINKERQ_DURABLE_EVERY=0), with the journal plus a durable checkpoint every `--every` optim_steps written by the
step itself (TINKERQ_DURABLE_ASYNC=0), and the same written on a side thread (the default: the step copies the
tensors to host memory, pinned on a GPU), interleaved in one run on one runtime; and what a takeover costs:
rebuilding a model on a fresh runtime from its whole journal, and from its last checkpoint plus the journal's tail.

    python bench/durability.py [--base tinyq-micro] [--steps 20] [--every 10] [--rounds 3] [--batch 8] \
        [--rank 32] [--device cpu|cuda] [--out bench/out/durability.json]

On a GPU: `--device cuda --base randq-0.5b --rank 32` (bfloat16; each op's time ends with a CUDA synchronize).
The time per op is the dispatcher's (restore check, the op itself, the fenced result write with or without the
journal entry, the checkpoint's copy or write), measured inside an in-process worker; REDIS_URL, or a private
redis-server is started. Prints a table and writes the JSON to `--out`.
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

from commands.redis_server import EmbeddedRedis  # noqa: E402
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
from worker.durability.journal import Journal  # noqa: E402
from worker.durability.restore import Restorer  # noqa: E402
from worker.main import WorkerProcess  # noqa: E402
from worker.runtime.registry import build_runtime  # noqa: E402


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


def synchronize() -> None:
    """A GPU's queued kernels are part of the op that queued them (a no-op on the CPU)."""
    if ARGS.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(worker: WorkerProcess, times: dict[str, list[float]]) -> None:
    """Record the wall time the dispatcher spends on each training op, by kind."""
    execute = worker.dispatcher.training.execute

    def each(shard, rid, request):
        t0 = time.perf_counter()
        execute(shard, rid, request)
        synchronize()
        times.setdefault(request.kind, []).append(time.perf_counter() - t0)

    worker.dispatcher.sequencer.execute = each


def run(r: Redis, runtime, durable: bool, model_id: str, times: dict, every: int = 0, background: bool = True) -> float:
    """One model's create + steps; the seconds its training ops took in all (what a round costs this arm)."""
    config = QueueConfig(num_shards=1, durable=durable, durable_every=every, durable_async=background)
    producer = Producer(r, config)
    worker = WorkerProcess(r, runtime, config)
    mine: dict[str, list[float]] = {}
    timed(worker, mine)
    for op in ops(model_id, ARGS.steps, ARGS.batch, ARGS.length, ARGS.rank):
        producer.submit(op)
    worker.run(burst=True, logging_level="WARNING")
    for kind, values in mine.items():
        times.setdefault(kind, []).extend(values)
    return sum(mine.get("forward_backward", [])) + sum(mine.get("optim_step", []))


def write_costs(r: Redis, request, n: int = 300) -> dict[str, float]:
    """The result write alone, p50 ms, without and with the journal entry of a forward_backward of this shape
    (interleaved): the part of the overhead the shared machine's noise does not drown."""
    from tinkerq import keys
    from worker.shards.fencing import Fence

    fence = Fence(r, "bench", 60_000)
    fence.acquire([0])
    plain, journaled = [], []
    entry = request.model_dump_json()
    for i in range(n):
        t0 = time.perf_counter()
        fence.put_result(0, f"plain-{i}", '{"type": "forward_backward"}', 60, "done")
        t1 = time.perf_counter()
        fence.put_result_journaled(0, f"journaled-{i}", '{"type": "forward_backward"}', 60, "done",
                                   keys.journal_key("w:train:0"), entry, keys.last_seq_key("w:train:0"), i,
                                   keys.journal_base_key("w:train:0"))
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
        arms = {"off": (False, 0, False), "journal": (True, 0, False), "checkpoints": (True, ARGS.every, False),
                "async": (True, ARGS.every, True)}
        times: dict[str, dict] = {arm: {} for arm in arms}
        totals: dict[str, list[float]] = {arm: [] for arm in arms}  # per round: robust to one round's spike
        run(r, runtime, True, "warmup:train:0", {}, ARGS.every)
        for i in range(ARGS.rounds):  # interleaved, each round in another order: drift hits every arm alike
            order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
            for arm in order:
                totals[arm].append(run(r, runtime, arms[arm][0], f"m{i}-{arm}:train:0", times[arm], arms[arm][1],
                                       arms[arm][2]))
        journal_bytes = sum(len(e) for e in r.lrange(Journal.key("m0-journal:train:0"), 0, -1))
        tail = Journal(r).listed("m0-checkpoints:train:0")
        writes = write_costs(r, ops("w:train:0", 1, ARGS.batch, ARGS.length, ARGS.rank)[1])
        checkpoint_s, capture_s, write_s = [], [], []  # one durable checkpoint alone, on the trained model
        for i in range(5):
            t0 = time.perf_counter()
            made = runtime.checkpoint("m0-journal:train:0", f"bench{i}")
            synchronize()
            checkpoint_s.append(time.perf_counter() - t0)
            Path(made.path).unlink()
            t0 = time.perf_counter()
            pending = runtime.capture("m0-journal:train:0")  # the part a step pays when the write is off its thread
            t1 = time.perf_counter()
            Path(pending.write(f"bench-async{i}").path).unlink()
            capture_s.append(t1 - t0)
            write_s.append(time.perf_counter() - t1)
        archive_bytes = os.path.getsize(Journal(r).checkpoint("m0-checkpoints:train:0").path)
        restores: dict[str, list[float]] = {"journal": [], "checkpoints": [], "async": []}
        for _ in range(3):
            for arm in restores:
                fresh = build_runtime(rc)
                t0 = time.perf_counter()
                assert Restorer(r, fresh, Journal(r)).ensure(f"m0-{arm}:train:0") is None
                restores[arm].append(time.perf_counter() - t0)
        if server is not None:
            server.stop()

    def ms(values: list[float], how) -> float:
        return how(values) * 1e3

    rows = []
    for kind in ("forward_backward", "optim_step"):
        row = {"op": kind, "n": len(times["off"][kind])}
        for arm in arms:
            row[f"{arm}_p50_ms"] = ms(times[arm][kind], statistics.median)
            row[f"{arm}_mean_ms"] = ms(times[arm][kind], statistics.mean)  # a checkpoint lands on one step in N
        rows.append(row)
    step = {arm: sum(row[f"{arm}_mean_ms"] for row in rows) for arm in arms}
    step_p50 = sum(row["off_p50_ms"] for row in rows)
    checkpoint_ms = statistics.median(checkpoint_s) * 1e3
    capture_ms, write_ms = statistics.median(capture_s) * 1e3, statistics.median(write_s) * 1e3
    round_ms = {arm: statistics.median(values) * 1e3 / ARGS.steps for arm, values in totals.items()}
    out = {"machine": platform.platform(), "python": platform.python_version(), "args": vars(ARGS), "ops": rows,
           "step_mean_ms": step, "journal_ratio": step["journal"] / step["off"],
           "checkpoints_ratio": step["checkpoints"] / step["off"], "async_ratio": step["async"] / step["off"],
           "capture_ms_p50": capture_ms, "write_ms_p50": write_ms,
           "step_ms_median_round": round_ms, "round_totals_s": totals,
           "round_ratio": {arm: round_ms[arm] / round_ms["off"] for arm in arms},
           "journal_bytes_per_model": journal_bytes,
           "journal_entries_after_checkpoints": tail,
           "restore_s_p50": {arm: statistics.median(v) for arm, v in restores.items()}, "writes": writes,
           "restore_steps": ARGS.steps, "checkpoint_ms_p50": checkpoint_ms, "checkpoint_bytes": archive_bytes,
           "checkpoint_share_of_step": checkpoint_ms / ARGS.every / step_p50}
    print("| op | off p50 / mean ms | journal p50 / mean ms | journal + checkpoints p50 / mean ms | "
          "journal + async checkpoints p50 / mean ms |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['op']} | " + " | ".join(f"{row[f'{a}_p50_ms']:.2f} / {row[f'{a}_mean_ms']:.2f}" for a in arms)
              + " |")
    print(f"| fb + optim_step (mean) | {step['off']:.2f} | {step['journal']:.2f} ({out['journal_ratio']:.3f}x) | "
          f"{step['checkpoints']:.2f} ({out['checkpoints_ratio']:.3f}x) | "
          f"{step['async']:.2f} ({out['async_ratio']:.3f}x) |")
    print("| fb + optim_step, a round's total / steps (median of rounds) | " + " | ".join(
        f"{round_ms[a]:.2f} ({round_ms[a] / round_ms['off']:.3f}x)" for a in arms) + " |")
    print(f"one checkpoint ({archive_bytes / 1024:.0f} KiB archive): {checkpoint_ms:.1f} ms p50 of 5; every "
          f"{ARGS.every} steps that is {checkpoint_ms / ARGS.every:.2f} ms per step, "
          f"{100 * out['checkpoint_share_of_step']:.1f}% of the step's p50 ({step_p50:.1f} ms, durability off); "
          f"off the step: {capture_ms:.1f} ms copy in the step, {write_ms:.1f} ms write on the side thread")
    print(f"journal of one model after {ARGS.steps} steps: {journal_bytes / 1024:.1f} KiB without checkpoints, "
          f"{tail} entries left with one every {ARGS.every} steps")
    print(f"rebuilding it on a fresh runtime (p50 of 3): {out['restore_s_p50']['journal'] * 1e3:.0f} ms from the "
          f"whole journal, {out['restore_s_p50']['checkpoints'] * 1e3:.0f} ms from the last checkpoint + tail")
    print(f"result write alone: {writes['put_result_p50_ms']:.3f} ms plain, "
          f"{writes['put_result_journaled_p50_ms']:.3f} ms with a {writes['entry_bytes']} B journal entry (p50)")
    target = Path(ARGS.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=2))
    print(f"wrote {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="tinyq-micro")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="optim_steps between durable checkpoints")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the torch runtime's TINKERQ_DEVICE)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "durability.json"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ARGS = parser.parse_args()
    main()
