"""The Ray runtime against the in-process one, in one run: sampling throughput by number of engine replicas, and
weight-sync time by model size (base model x LoRA rank) and transport.

    python bench/ray_scaling.py [--device cuda] [--replicas 1,2,4,8] [--ray-address auto]
    python bench/ray_scaling.py --device cpu --replicas 1,2     # CPU smoke: tinyq-micro/-small, PyTorch engine

Both runtimes are built in this process from the same settings (`bench/sampling_throughput.py`'s `Direct`: a model
created with a LoRA adapter, trained one step and synced, so that sampling goes through a live adapter); the Ray one
is the worker's own (worker/ray_runtime, `tinkerq worker --gpus N`): N bundles of a placement group, an engine replica
and a data-parallel trainer rank on each. For each replica count N:

* **sampling**: the same requests (stop=[]: every sequence is max_tokens long) in one `Runtime.sample` call, which
  spreads them over the replicas; rounds alternate with the in-process runtime, so drift on a shared machine hits
  both alike. tokens/s, medians of --repeats rounds after a warm-up.
* **weight sync**: a transient WeightSyncRequest (export from the trainer, to every engine replica, applied), for
  each --sync-models x --sync-ranks, median of --syncs, alternating with the in-process runtime's. The payload is the
  LoRA adapter, sent by each of --transports (worker/ray_runtime/trainers.TRANSPORTS: "group", a broadcast over a
  gloo group of trainer rank 0 and the replicas; "object_store", a copy through Ray's object store), on the same
  actors.

No queue, Redis or worker process: this measures the runtime the worker drives (bench/sampling_throughput.py and
bench/gpu_rl_step.py measure the queue around it). On a GPU machine the in-process runtime shares GPU 0 with replica 0
(they take turns, never run at once); --gpu-memory-utilization is what each vLLM engine takes, both runtimes alike.
Prints two tables, writes bench/results/ray_scaling[-TAG].json and a PNG.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from bench.sampling_throughput import MODEL, Direct, setup_ops, weight_bytes, workload  # noqa: E402
from worker.ray_runtime import cluster  # noqa: E402
from worker.ray_runtime.trainers import TRANSPORTS  # noqa: E402

IN_PROCESS = "in_process"
DEFAULTS = {"cuda": dict(model="randq-0.5b", dtype="bfloat16", engine="auto", requests=256, num_samples=1,
                         max_tokens=128, sync_models="randq-0.5b,randq-1.5b", sync_ranks="32,128", repeats=5,
                         syncs=10, torch_threads=0),
            "cpu": dict(model="tinyq-micro", dtype="float32", engine="torch", requests=32, num_samples=4,
                        max_tokens=32, sync_models="tinyq-micro,tinyq-small", sync_ranks="8,64", repeats=3, syncs=5,
                        torch_threads=1)}


def sync_cases(args) -> list[tuple[str, str, int]]:
    """(model id, base model, LoRA rank) of every model whose sync is timed."""
    return [(f"bench:sync:{base}:r{rank}", base, int(rank))
            for base in args.sync_models.split(",") for rank in args.sync_ranks.split(",")]


def build(args, tmp: Path, replicas: int | None) -> Direct:
    """The in-process runtime (replicas None) or the Ray one on `replicas` bundles, holding the sampled model and
    every sync case's model."""
    # every sync case's adapter must fit the engine's LoRA slots (vLLM pads each to max_lora_rank)
    ranks = [args.lora_rank, *(rank for _, _, rank in sync_cases(args))]
    overrides = {"torch_threads": args.torch_threads, "vllm_max_lora_rank": max(ranks)}
    if replicas is not None:
        overrides.update(runtime="ray", ray_gpus=replicas, checkpoint_root=str(tmp / f"ray-{replicas}"))
    started = time.perf_counter()
    direct = Direct(args, tmp, args.engine, **overrides)
    for model_id, base, rank in sync_cases(args):
        direct.add_model(setup_ops(args, model_id, base, rank))
    label = IN_PROCESS if replicas is None else f"Ray, {replicas} replica(s)"
    print(f"{label}: built with {1 + len(sync_cases(args))} models in {time.perf_counter() - started:.1f} s",
          flush=True)
    return direct


def alternate(rounds: int, paths: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """`rounds` values of each path, the paths taking turns in every round."""
    values: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, measure in paths.items():
            values[name].append(measure())
    return values


def sampling_row(args, base: Direct, ray_rt: Direct, replicas: int) -> dict:
    requests = workload(args)
    base.sample(requests[:4]), ray_rt.sample(requests[:4])  # warm-up: first batch shapes, Ray's first streams
    rounds = alternate(args.repeats, {IN_PROCESS: lambda: base.sample(requests),
                                      "ray": lambda: ray_rt.sample(requests)})
    return {"replicas": replicas, "tokens_per_s": statistics.median(rounds["ray"]),
            "in_process_tokens_per_s": statistics.median(rounds[IN_PROCESS]),
            "ratio_to_in_process": statistics.median(r / b for r, b in zip(rounds["ray"], rounds[IN_PROCESS])),
            "rounds": rounds}


def sync_rows(args, base: Direct, ray_rt: Direct, replicas: int) -> list[dict]:
    rows = []
    trainer = ray_rt.rt.trainer
    for model_id, base_model, rank in sync_cases(args):
        def over(transport: str, model_id: str = model_id) -> Callable[[], float]:
            def sync() -> float:
                trainer.transport = transport  # what its exports are: the engine facade takes either
                ms = ray_rt.sync_ms(None, model_id)
                # The group's record copy is made after the sync, delaying the trainer's next call: not the next
                # sync timed here.
                ray.wait([record_of(ray_rt, model_id)], timeout=600)
                return ms
            return sync

        times = alternate(args.syncs, {IN_PROCESS: lambda model_id=model_id: base.sync_ms(None, model_id),
                                       **{t: over(t) for t in args.transports.split(",")}})
        for transport in args.transports.split(","):
            rows.append({"replicas": replicas, "base_model": base_model, "lora_rank": rank,
                         "payload_bytes": weight_bytes(base, model_id)["lora"], "transport": transport,
                         "ms": statistics.median(times[transport]),
                         "in_process_ms": statistics.median(times[IN_PROCESS]), "all_ms": times[transport],
                         "in_process_all_ms": times[IN_PROCESS]})
    return rows


def record_of(ray_rt: Direct, model_id: str) -> ray.ObjectRef:
    """The reference the Ray engine facade keeps of the model's latest snapshot."""
    versions = next(v for m, _, v in ray_rt.rt.engine.record.records() if m == model_id)
    return versions[-1][1]


def measure(args, tmp: Path, counts: list[int]) -> tuple[list[dict], list[dict]]:
    base = build(args, tmp, None)
    sampling, syncs = [], []
    for replicas in counts:
        ray_rt = build(args, tmp, replicas)
        try:
            sampling.append(sampling_row(args, base, ray_rt, replicas))
            syncs.extend(sync_rows(args, base, ray_rt, replicas))
        finally:
            ray_rt.rt.engine.close()  # its actors and placement group; the next count places its own
        row = sampling[-1]
        print(f"{replicas} replica(s): {row['tokens_per_s']:.0f} tok/s, in process {row['in_process_tokens_per_s']:.0f}"
              f" tok/s", flush=True)
    base.rt.engine.close()
    one = next((r["tokens_per_s"] for r in sampling if r["replicas"] == 1), None)
    for row in sampling:
        row["speedup_over_one_replica"] = row["tokens_per_s"] / one if one else None
    return sampling, syncs


def default_replicas(device: str) -> str:
    """1, 2, 4, ... up to the GPUs this host has (its Ray cluster may have more: name them with --replicas)."""
    count = 2
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
    return ",".join(str(n) for n in [1, 2, 4, 8, 16, 32] if n <= count) or "1"


def print_tables(args, sampling: list[dict], syncs: list[dict]) -> None:
    print(f"\nsampling: {args.requests} requests x {args.num_samples} x {args.max_tokens} tokens on {args.model} "
          f"({args.device}, {args.engine} engine); medians of {args.repeats} rounds, alternating with in process")
    print(f"{'replicas':>8}{'tok/s':>10}{'in process':>12}{'ratio':>8}{'x 1 replica':>13}")
    for r in sampling:
        speedup = r["speedup_over_one_replica"]
        print(f"{r['replicas']:>8}{r['tokens_per_s']:>10.0f}{r['in_process_tokens_per_s']:>12.0f}"
              f"{r['ratio_to_in_process']:>8.2f}{speedup if speedup is None else f'{speedup:.2f}':>13}")
    print(f"\nweight sync (transient, LoRA adapter): the Ray runtime by transport vs in process; median of "
          f"{args.syncs}, alternating")
    print(f"{'replicas':>8}  {'base':<14}{'rank':>5}{'payload':>11}  {'transport':<13}{'ray ms':>9}{'in proc ms':>12}"
          f"{'extra ms':>10}")
    for r in syncs:
        print(f"{r['replicas']:>8}  {r['base_model']:<14}{r['lora_rank']:>5}{r['payload_bytes'] / 2**20:>8.2f}MiB"
              f"  {r['transport']:<13}{r['ms']:>9.1f}{r['in_process_ms']:>12.1f}{r['ms'] - r['in_process_ms']:>10.1f}")


def plot(sampling: list[dict], syncs: list[dict], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    counts = [r["replicas"] for r in sampling]
    left.plot(counts, [r["tokens_per_s"] for r in sampling], marker="o", label="Ray runtime")
    left.plot(counts, [r["in_process_tokens_per_s"] for r in sampling], marker="s", linestyle=":",
              label="in process (same rounds)")
    left.set(xlabel="engine replicas", ylabel="sampled tokens/s", title="sampling", xticks=counts)
    left.legend(fontsize=8)
    for replicas, transport in sorted({(r["replicas"], r["transport"]) for r in syncs}):
        mine = sorted((r for r in syncs if (r["replicas"], r["transport"]) == (replicas, transport)),
                      key=lambda r: r["payload_bytes"])
        right.plot([r["payload_bytes"] / 2**20 for r in mine], [r["ms"] for r in mine], marker="o",
                   label=f"Ray, {replicas} replica(s), {transport}")
    first = (syncs[0]["replicas"], syncs[0]["transport"])
    base = sorted((r for r in syncs if (r["replicas"], r["transport"]) == first), key=lambda r: r["payload_bytes"])
    right.plot([r["payload_bytes"] / 2**20 for r in base], [r["in_process_ms"] for r in base], marker="s",
               linestyle=":", label="in process")
    right.set(xlabel="adapter payload (MiB)", ylabel="sync ms (median)", xscale="log", yscale="log",
              title="weight sync by transport")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--replicas", help="engine replica counts (bundles), default 1, 2, 4, ... up to the GPUs")
    parser.add_argument("--ray-address", default="",
                        help="join this Ray cluster (auto: this host's); default: start one")
    parser.add_argument("--engine", choices=["auto", "vllm", "torch"])
    parser.add_argument("--model", help="the sampled model's base")
    parser.add_argument("--dtype")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--num-samples", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--lora-rank", type=int, default=16, help="the sampled model's adapter rank")
    parser.add_argument("--sync-models", help="comma-separated bases whose sync is timed")
    parser.add_argument("--sync-ranks", help="comma-separated LoRA ranks whose sync is timed")
    parser.add_argument("--repeats", type=int, help="sampling rounds")
    parser.add_argument("--syncs", type=int, help="syncs per case")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="the Ray runtime's weight transports")
    # On the CPU both runtimes get Ray's one thread per actor: at two threads on this 2-vCPU VM the in-process
    # runtime's rounds swung from 0.3k to 13k tokens/s (OpenMP threads spinning against the other processes).
    parser.add_argument("--torch-threads", type=int, help="torch threads per process, both runtimes (0: torch's)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="each vLLM engine's share of its GPU; default: 0.8 over the engines GPU 0 holds (one per "
                             "base, in each runtime), so that they fit beside each other and the trainers")
    parser.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    for key, value in DEFAULTS["cpu" if args.device == "cpu" else "cuda"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.replicas = args.replicas or default_replicas(args.device)
    if args.gpu_memory_utilization is None:
        # GPU 0 holds an engine per base in process and one in replica 0 (a run with --sync-models 0.5b,1.5b asked
        # 4 x 0.25 of an H100 and the last engine found 6 of 79 GiB free)
        bases = {args.model, *(args.sync_models.split(",") if args.sync_models else [])}
        args.gpu_memory_utilization = round(0.8 / (2 * len(bases)), 3)
    args.vllm_sync = "lora"  # what sampling_throughput's runtime settings read: the adapter stays an adapter
    return args


def main() -> None:
    args = parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-ray-scaling-"))
    # One Ray cluster for every replica count; each Ray runtime places and removes its own placement group.
    cluster.connect(args.ray_address or None, cpus=max(os.cpu_count() or 1, max(counts)))
    try:
        sampling, syncs = measure(args, tmp, counts)
    finally:
        cluster.disconnect()
    print_tables(args, sampling, syncs)
    name = "ray_scaling" + (f"-{args.tag}" if args.tag else "")
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}"
    out.write_text(json.dumps({"date": date.today().isoformat(), "machine": machine, "transports": args.transports,
                               "sampled_model": MODEL, "workload": vars(args), "sampling": sampling, "sync": syncs},
                              indent=2))
    print(f"wrote {out}")
    plot(sampling, syncs, f"{args.model} on {args.device} ({args.engine} engine), {machine}", out.with_suffix(".png"))


if __name__ == "__main__":
    main()
