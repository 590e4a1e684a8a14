"""Where a GPU waits on its host: idle gaps in a torch.profiler trace, charged to what the CPU was issuing.

    python bench/trace_gaps.py TRACE.json[.gz] [--min-us 20] [--top 25]

A pass is launch-bound where the GPU finishes kernels faster than the CPU issues them. This reads the trace that
`torch.profiler` exports (`prof.export_chrome_trace`), merges every kernel, memcpy and memset into the GPU's busy
time, and for each gap of at least --min-us microseconds finds the launch of the kernel that ended it (the CUDA
runtime or driver call with the same correlation id: cuBLAS and Triton launch through the driver) and the CPU ops
around that launch (innermost first). Gaps are summed by that op chain and by thread (the forward runs on the main
thread, the backward on autograd's device thread). Prints the busy fraction and the top chains; `summary()` returns the
same as a dict.
"""

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _busy(gpu: list[dict]) -> tuple[float, list[tuple[float, float, dict]]]:
    """Merged busy time, and the gaps between busy stretches as (start, length, event after the gap)."""
    gpu = sorted(gpu, key=lambda e: e["ts"])
    busy, gaps = 0.0, []
    start, end = gpu[0]["ts"], gpu[0]["ts"] + gpu[0].get("dur", 0)
    for e in gpu[1:]:
        if e["ts"] > end:
            busy += end - start
            gaps.append((end, e["ts"] - end, e))
            start = e["ts"]
        end = max(end, e["ts"] + e.get("dur", 0))
    return busy + end - start, gaps


class _CpuOps:
    """CPU ops by thread, to find the ones enclosing a moment (innermost first)."""

    def __init__(self, events: list[dict]) -> None:
        self.by_tid: dict = defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e:
                self.by_tid[e["tid"]].append(e)
        for ops in self.by_tid.values():
            ops.sort(key=lambda e: e["ts"])
        self.starts = {tid: [e["ts"] for e in ops] for tid, ops in self.by_tid.items()}

    def around(self, tid, ts: float, depth: int) -> list[str]:
        ops, starts = self.by_tid.get(tid, []), self.starts.get(tid, [])
        i = bisect.bisect_right(starts, ts)
        enclosing = [e for e in ops[max(0, i - 4000): i] if e["ts"] + e["dur"] >= ts]
        enclosing.sort(key=lambda e: e["dur"])  # innermost (shortest) first
        return [e["name"][:60] for e in enclosing[:depth]]


def summary(events: list[dict], min_us: float = 20.0, depth: int = 3, top: int = 25) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu = _CpuOps(events)
    busy, gaps = _busy(gpu)
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    by_chain: dict = defaultdict(lambda: [0.0, 0])
    by_tid: dict = defaultdict(float)
    counted = 0.0
    for _, length, after in gaps:
        if length < min_us:
            continue
        counted += length
        launch = launches.get(after.get("args", {}).get("correlation"))
        chain = " < ".join(cpu.around(launch["tid"], launch["ts"], depth)) if launch else "(no launch found)"
        by_chain[chain][0] += length
        by_chain[chain][1] += 1
        by_tid[launch["tid"] if launch else None] += length
    rows = sorted(by_chain.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "busy_fraction": busy / span,
            "gaps_ms": (span - busy) / 1e3, f"gaps_over_{min_us:g}us_ms": counted / 1e3,
            "gaps_by_thread_ms": {str(k): v / 1e3 for k, v in by_tid.items()},
            "top_chains": [{"ms": v[0] / 1e3, "gaps": v[1], "chain": k} for k, v in rows]}


def report(result: dict) -> str:
    if "error" in result:
        return result["error"]
    lines = [f"GPU busy {result['gpu_busy_ms']:.1f} of {result['gpu_span_ms']:.1f} ms "
             f"({100 * result['busy_fraction']:.1f}%), idle {result['gaps_ms']:.1f} ms; "
             f"by launching thread: " + ", ".join(f"{k}: {v:.1f} ms" for k, v in result["gaps_by_thread_ms"].items()),
             "| idle ms | gaps | CPU op issuing the next kernel (innermost < outer) |", "| --- | --- | --- |"]
    lines += [f"| {r['ms']:.2f} | {r['gaps']} | {r['chain']} |" for r in result["top_chains"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min-us", type=float, default=20.0)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(report(summary(load(args.trace), args.min_us, args.depth, args.top)))


if __name__ == "__main__":
    main()
