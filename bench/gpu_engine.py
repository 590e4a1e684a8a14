"""Engine-side figures of the PyTorch runtime on a GPU: sampling tokens/s and weight-sync time.

    python bench/gpu_engine.py [--models randq-0.5b,randq-1.5b] [--requests 64] [--num-samples 4] [--max-tokens 128]

For each model (random weights in a real model's shape, bfloat16): create a LoRA model, then
  * sampling: every request in one `Runtime.sample()` call (what the worker does with a batch);
  * syncs: transient (LoRA tensors into a new frozen adapter) and named (+ merged HF tar.gz), medians;
  * floors: LoRA bytes and full model bytes over the HBM bandwidth measured in the same run.
No Redis and no queue here: this is the engine side of the worker. Prints a table, writes JSON.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from schemas import CreateModelRequest, LoraConfig, SampleRequest, SamplingParams, WeightSyncRequest  # noqa: E402
from tinkerq.config import RuntimeConfig  # noqa: E402
from tinkerq.local_models import resolve  # noqa: E402
from worker.runtime.registry import build_runtime  # noqa: E402


def hbm_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * (2 << 30) / statistics.median(times[3:])


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_model(name: str, args, bandwidth: float) -> dict:
    log(f"{name}: building/loading")
    path = resolve(name)
    rt = build_runtime(RuntimeConfig(runtime="torch", device="cuda", dtype="bfloat16",
                                     checkpoint_root=tempfile.mkdtemp(prefix="gpu-bench-"), max_snapshots=8))
    model = f"bench-{name}:train:0"
    rt.execute(CreateModelRequest(model_id=model, base_model=name, lora=LoraConfig(rank=args.rank, seed=0)))
    base = rt.trainer.models[model].base
    model_bytes = sum(p.numel() * p.element_size() for n, p in base.model.named_parameters() if "lora_" not in n)
    lora_bytes = sum(t.numel() * t.element_size() for t in rt.trainer.export_weights(model).tensors.values())
    requests = [SampleRequest(model_id=model, prompt_tokens=[(13 * i + j) % 4000 + 2 for j in range(args.prompt_len)],
                              num_samples=args.num_samples, weights_version=0,
                              sampling_params=SamplingParams(max_tokens=args.max_tokens, seed=i, stop=[]))
                for i in range(args.requests)]
    log(f"{name}: model ready ({model_bytes / 2**30:.2f} GiB), sampling")
    rt.sample(requests[:2])  # warm-up
    rates = []
    for _ in range(args.repeats):
        outputs, seconds = timed(lambda: rt.sample(requests))
        rates.append(sum(len(s.tokens) for o in outputs for s in o.sequences) / seconds)
        log(f"{name}: {rates[-1]:.0f} tokens/s")
    syncs: dict[str, list[float]] = {"transient": [], "named": []}
    version = 0
    for kind in ("transient", "named"):
        log(f"{name}: {kind} syncs")
        for _ in range(args.sync_repeats):
            version += 1
            request = WeightSyncRequest(model_id=model, version=version, name="snap" if kind == "named" else None)
            _, seconds = timed(lambda request=request: rt.execute(request))
            syncs[kind].append(seconds * 1000)
    return {
        "model": name, "path": str(path), "params_bytes": model_bytes, "lora_bytes": lora_bytes,
        "rows": args.requests * args.num_samples, "tokens_per_s": statistics.median(rates),
        "sync_ms": {k: statistics.median(v) for k, v in syncs.items()},
        "floor_ms": {"lora_over_hbm": 1000 * lora_bytes / bandwidth,
                     "full_weights_over_hbm": 1000 * model_bytes / bandwidth},
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="randq-0.5b,randq-1.5b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-repeats", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")) + "/gpu_engine.json")
    args = parser.parse_args()
    log("measuring HBM bandwidth")
    bandwidth = hbm_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: device copy {bandwidth / 1e12:.2f} TB/s (read+write)", flush=True)
    results = []
    for name in args.models.split(","):
        print(f"{name} ...", flush=True)
        results.append(run_model(name, args, bandwidth))
        torch.cuda.empty_cache()
    print(f"\n{'model':<12}{'rows':>6}{'tok/s':>10}{'sync ms':>9}{'named ms':>10}{'LoRA floor ms':>15}"
          f"{'full floor ms':>15}{'peak GiB':>10}")
    for r in results:
        print(f"{r['model']:<12}{r['rows']:>6}{r['tokens_per_s']:>10.0f}{r['sync_ms']['transient']:>9.1f}"
              f"{r['sync_ms']['named']:>10.1f}{r['floor_ms']['lora_over_hbm']:>15.4f}"
              f"{r['floor_ms']['full_weights_over_hbm']:>15.3f}{r['peak_gpu_gib']:>10.1f}")
    report = {"machine": f"{platform.node()} {torch.cuda.get_device_name()}", "torch": torch.__version__,
              "hbm_copy_bytes_per_s": bandwidth, "workload": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
