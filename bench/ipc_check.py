"""The Ray runtime's CUDA IPC hop (worker/ray_runtime/weight_group.py) between two processes on one GPU, without Ray:
what trainer rank 0 and the engine replica that shares its GPU do in a sync.

    python bench/ipc_check.py [--rank 32] [--dtype bfloat16] [--repeats 20]

A sender process stages a LoRA export shaped as Qwen2.5-0.5B's (attention + MLP, rank --rank; one buffer, the
tensors views of it, as lora_io.AdapterExport makes) with `GroupMember.stage`; the receiver takes it with
`GroupMember.receive` (the IPC path: map the handles, copy, synchronise) and checks every tensor equals what was
sent. Timed beside the host path a gloo broadcast starts from (the sender's `.cpu()` and the receiver's copy back to
its GPU, no network). Prints a table; writes bench/results/ipc_check[-TAG].json. Needs a CUDA GPU (torch, peft).
"""

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.ray_runtime.weight_group import GroupMember  # noqa: E402
from worker.torch_runtime.lora_io import LoraWeights  # noqa: E402

# Qwen2.5-0.5B: hidden 896, MLP 4864, 24 layers; k/v project to 2 heads of 64
MODULES = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128), "o_proj": (896, 896),
           "gate_proj": (896, 4864), "up_proj": (896, 4864), "down_proj": (4864, 896)}


def export(rank: int, dtype: torch.dtype, seed: int) -> LoraWeights:
    from peft import LoraConfig

    generator = torch.Generator().manual_seed(seed)
    shapes = {f"layers.{layer}.{name}.lora_{ab}.weight": (rank, fan_in) if ab == "A" else (fan_out, rank)
              for layer in range(24) for name, (fan_in, fan_out) in MODULES.items() for ab in "AB"}
    sizes = [a * b for a, b in shapes.values()]
    buffer = torch.randn(sum(sizes), generator=generator).to(dtype).cuda()
    parts = buffer.split(sizes)
    return LoraWeights(LoraConfig(r=rank), {key: part.view(shape) for (key, shape), part in zip(shapes.items(), parts)})


def sender(args, metas: mp.Queue, done: mp.Queue, timings: mp.Queue) -> None:
    member = GroupMember("cuda")
    dtype = getattr(torch, args.dtype)
    for i in range(args.repeats + 1):
        weights = export(args.rank, dtype, seed=i)
        torch.cuda.synchronize()
        start = time.perf_counter()
        meta = member.stage(weights)
        staged = time.perf_counter() - start
        expected = {key: tensor.cpu() for key, tensor in weights.tensors.items()}
        metas.put((meta, expected))
        done.get()  # the receiver has its copy: the staged buffers may go
        start = time.perf_counter()
        host = member.unstage()  # the host copy the record keeps (and the gloo path broadcasts)
        to_host = time.perf_counter() - start
        start = time.perf_counter()
        back = {key: tensor.cuda() for key, tensor in host.tensors.items()}
        torch.cuda.synchronize()
        to_device = time.perf_counter() - start
        del back
        timings.put({"stage_ms": staged * 1e3, "host_copy_ms": to_host * 1e3, "back_to_gpu_ms": to_device * 1e3})
    metas.put(None)


def receiver(metas: mp.Queue, done: mp.Queue, results: mp.Queue) -> None:
    member = GroupMember("cuda")
    while (item := metas.get()) is not None:
        meta, expected = item
        start = time.perf_counter()
        weights = member.receive(meta)
        elapsed = time.perf_counter() - start
        done.put(True)
        equal = all(torch.equal(weights.tensors[key].cpu(), value) for key, value in expected.items())
        results.put({"ipc_receive_ms": elapsed * 1e3, "equal": equal and weights.tensors.keys() == expected.keys(),
                     "bytes": sum(t.numel() * t.element_size() for t in weights.tensors.values())})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ipc_check needs a CUDA GPU")
    context = mp.get_context("spawn")
    metas, done, timings, results = (context.Queue() for _ in range(4))
    procs = [context.Process(target=sender, args=(args, metas, done, timings)),
             context.Process(target=receiver, args=(metas, done, results))]
    for proc in procs:
        proc.start()
    sent = [timings.get(timeout=600) for _ in range(args.repeats + 1)][1:]  # the first: warm-up
    taken = [results.get(timeout=600) for _ in range(args.repeats + 1)][1:]
    for proc in procs:
        proc.join(timeout=60)
    row = {key: statistics.median(r[key] for r in rows) for rows in (sent, taken) for key in rows[0]
           if key not in ("equal", "bytes")}
    row.update(bytes=taken[0]["bytes"], all_equal=all(r["equal"] for r in taken), repeats=args.repeats,
               rank=args.rank, dtype=args.dtype, device=torch.cuda.get_device_name(0), date=date.today().isoformat())
    print(f"CUDA IPC between two processes on {row['device']}: a Qwen2.5-0.5B-shaped LoRA export, rank {args.rank}, "
          f"{args.dtype}, {row['bytes'] / 2**20:.1f} MiB; medians of {args.repeats}")
    print("| step | ms |\n| --- | --- |")
    for key in ("stage_ms", "ipc_receive_ms", "host_copy_ms", "back_to_gpu_ms"):
        print(f"| {key} | {row[key]:.3f} |")
    print(f"every tensor equal to what was sent: {row['all_equal']}")
    out = Path(args.out) / ("ipc_check" + (f"-{args.tag}" if args.tag else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))
    print(f"wrote {out}")
    if not row["all_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
