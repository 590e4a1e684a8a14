"""Weight-sync time of the vLLM engine, by mode and model size, against the copy floor.

    python bench/gpu_sync.py [--device cuda] [--models randq-0.5b,randq-1.5b] [--rank 32] [--n 20] [--graphs]
    python bench/gpu_sync.py --device cpu --dtype float32 --models tinyq-micro --rank 8 --n 10   # CPU smoke

Modes: lora (in place into vLLM's LoRA slots), merged (base + scale*B@A in place into the parameters), and
the paths they replace, lora-file (peft files + vLLM's loader) and merged-reload (reload_weights). For each:
a training step, then the sync, N times. Two times per sync, median over N:
* engine: the engine's part, VllmEngine.apply_weights on tensors already exported (synchronised);
* whole: the WeightSyncRequest as the worker runs it (export from the trainer, apply, bookkeeping).
Floor: a plain torch copy_ of as many bytes as the sync writes, on the same device (best of N). After every sync the
served prompt logprobs of a fixed completion are compared with the trainer's (gap to synced) and with the
previous weights' (gap to previous): served right when the first is under a tenth of the second.
Prints a table, writes bench/results/gpu_sync[-TAG].json and a PNG of sync time vs floor (with matplotlib).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.vllm_sync_check import TARGET, datum, gap, served_logprobs, trainer_logprobs  # noqa: E402
from schemas import (  # noqa: E402
    AdamParams,
    CreateModelRequest,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    WeightSyncRequest,
)
from tinkerq.config import RuntimeConfig  # noqa: E402
from worker.runtime.registry import build_runtime  # noqa: E402

AWAY = [t + 20 for t in TARGET]  # another completion, trained on every other step
MODES = {"lora": ("lora", True), "merged": ("merged", True), "lora-file": ("lora", False),
         "merged-reload": ("merged", False)}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def written_bytes(rt, model_id: str, weights, merged: bool) -> int:
    """What the sync must write: the adapter's A and B, or (merged) the full weights of the modules it targets."""
    if not merged:
        return sum(t.numel() * t.element_size() for k, t in weights.tensors.items() if ".lora_" in k)
    base = rt.engine._base_weights(rt.engine.base_of[model_id])
    names = {k.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight" for k in weights.tensors
             if ".lora_A." in k}
    return sum(base[n].numel() * base[n].element_size() for n in names)


def copy_floor_ms(nbytes: int, device: str, n: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(n + 2):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times[2:])  # a floor: the best of N (a shared CPU's medians wander)


def run_mode(args, model_name: str, mode: str) -> dict:
    sync, inplace = MODES[mode]
    config = RuntimeConfig(runtime="torch", engine="vllm", vllm_sync=sync, vllm_inplace_sync=inplace,
                           device=args.device, dtype=args.dtype, vllm_enforce_eager=not args.graphs,
                           vllm_gpu_memory_utilization=args.gpu_memory_utilization, vllm_max_lora_rank=args.rank,
                           checkpoint_root=tempfile.mkdtemp(prefix="tinkerq-gpu-sync-"))
    rt = build_runtime(config)
    model = "bench:train:0"
    unembed = sync == "lora"  # a merged lm_head adapter is refused on tied bases
    rt.execute(CreateModelRequest(model_id=model, base_model=model_name,
                                  lora=LoraConfig(rank=args.rank, seed=0, train_unembed=unembed)))
    engine_ms, whole_ms, checks = [], [], []
    version = 0
    try:
        n = args.n if inplace else max(3, args.n // 4)
        for i in range(n + 1):  # the first sync warms up (slot layout, fused-name map) and is not counted
            previous = trainer_logprobs(rt, model)
            # alternate the completion trained on: on one datum the logprobs saturate within ~7 steps (then a step
            # moves them by less than bf16's merge noise, and "right" cannot be told from "stale")
            target = TARGET if i % 2 == 0 else AWAY
            rt.execute(ForwardBackwardRequest(model_id=model, data=[datum(target)], loss_fn="cross_entropy"))
            # beta1=0: Adam's momentum would cancel the alternating steps (CPU, randq-0.5b, float32: each step
            # moves the logprobs by 1.2-5 with it off, 0.05-0.3 after 6 steps with it on)
            rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=args.lr, beta1=0.0)))
            weights = rt.trainer.export_weights(model)
            version += 1
            synchronize(args.device)
            start = time.perf_counter()
            rt.engine.apply_weights(model, version, weights)
            synchronize(args.device)
            engine = (time.perf_counter() - start) * 1e3
            version += 1
            start = time.perf_counter()
            rt.execute(WeightSyncRequest(model_id=model, version=version))
            synchronize(args.device)
            whole = (time.perf_counter() - start) * 1e3
            served = served_logprobs(rt, model, version)
            checks.append({"gap_to_synced": gap(served, trainer_logprobs(rt, model)),
                           "gap_to_previous": gap(served, previous)})
            if i:
                engine_ms.append(engine)
                whole_ms.append(whole)
        if args.profile and inplace:
            version = profile_syncs(args, rt, model, version, f"{model_name}-{mode}")
        nbytes = written_bytes(rt, model, weights, sync == "merged")
        used_inplace = (rt.engine.writers.get(model_name) if sync == "merged" else rt.engine.slots.get(model_name))
    finally:
        rt.engine.close()
    return {"model": model_name, "mode": mode, "cuda_graphs": args.graphs, "rank": args.rank, "n": len(engine_ms),
            "engine_ms": statistics.median(engine_ms), "whole_ms": statistics.median(whole_ms),
            "floor_ms": copy_floor_ms(nbytes, args.device, args.n), "bytes": nbytes,
            "inplace_path": used_inplace is not None and inplace,
            "max_gap_to_synced": max(c["gap_to_synced"] for c in checks),
            "min_gap_to_previous": min(c["gap_to_previous"] for c in checks),
            "served_right": all(c["gap_to_synced"] < c["gap_to_previous"] / 10 for c in checks),
            "checks": checks}


def profile_syncs(args, rt, model: str, version: int, tag: str, n: int = 5) -> int:
    """Where a whole sync's time goes: Python (cProfile, by own and cumulative time) and kernels (torch.profiler),
    over `n` syncs after the timed ones, written to PROFILE/profile-TAG.txt. Returns the last version synced."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    python = cProfile.Profile()
    with profile(activities=activities) as kernels:
        for _ in range(n):
            version += 1
            python.enable()
            rt.execute(WeightSyncRequest(model_id=model, version=version))
            synchronize(args.device)
            python.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(python, stream=text).sort_stats(order).print_stats(30)
    sort = "cuda_time_total" if args.device != "cpu" else "cpu_time_total"
    text.write(kernels.key_averages().table(sort_by=sort, row_limit=30))
    out = Path(args.profile) / f"profile-{tag}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())
    return version


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["engine_ms"] for r in rows], 0.27, label="engine part")
    ax.bar(list(x), [r["whole_ms"] for r in rows], 0.27, label="whole sync")
    ax.bar([i + 0.27 for i in x], [r["floor_ms"] for r in rows], 0.27, label="copy floor")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, log scale)")
    graphs = "CUDA graphs" if rows[0]["cuda_graphs"] else "eager"
    ax.set_title(f"vLLM weight sync vs copy floor ({graphs}, rank {rows[0]['rank']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--models", default=None, help="default: randq-0.5b,randq-1.5b on cuda, tinyq-micro on cpu")
    parser.add_argument("--modes", default="lora,merged,lora-file,merged-reload")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs on (default: eager)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--tag", default="")
    parser.add_argument("--profile", default="", help="a folder: profile 5 more syncs of each in-place mode there")
    args = parser.parse_args()
    models = (args.models or ("tinyq-micro" if args.device == "cpu" else "randq-0.5b,randq-1.5b")).split(",")
    rows = [run_mode(args, m, mode) for m in models for mode in args.modes.split(",")]
    print(f"{'model':12} {'mode':14} {'graphs':6} {'n':>3} {'engine ms':>10} {'whole ms':>9} {'floor ms':>9} "
          f"{'MB':>8} {'x floor':>8} {'gap synced':>11} {'gap prev':>9} right")
    for r in rows:
        print(f"{r['model']:12} {r['mode']:14} {str(r['cuda_graphs']):6} {r['n']:3d} {r['engine_ms']:10.3f} "
              f"{r['whole_ms']:9.3f} {r['floor_ms']:9.4f} {r['bytes'] / 2**20:8.2f} "
              f"{r['engine_ms'] / max(r['floor_ms'], 1e-6):8.1f} {r['max_gap_to_synced']:11.2e} "
              f"{r['min_gap_to_previous']:9.3f} {'yes' if r['served_right'] else 'NO'}")
    name = "gpu_sync" + (f"-{args.tag}" if args.tag else "")
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": vars(args), "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))
    sys.exit(0 if all(r["served_right"] for r in rows) else 1)


if __name__ == "__main__":
    main()
