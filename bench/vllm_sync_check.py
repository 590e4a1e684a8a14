"""Does the vLLM engine serve exactly the weights of each sync, in eager mode and with CUDA graphs?

    python bench/vllm_sync_check.py [--device cuda] [--dtype bfloat16] [--steps 3]

CUDA graphs capture the weights' addresses, so an in-place reload (merged sync) that allocated new tensors
would go on serving the old weights, silently. For each sync mode and each of eager / CUDA graphs: train a
model a few strong steps, syncing after each, and compare vLLM's prompt logprobs of a fixed completion on
the synced snapshot with the trainer's forward over it, on the synced weights and on the previous ones.
Served right, the first gap is numerical noise and the second is the training step's effect.
Prints a table and writes bench/out/vllm_sync_check.json.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas import (  # noqa: E402
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import RuntimeConfig  # noqa: E402
from worker.runtime.registry import build_runtime  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]
TARGET = [40, 41, 42, 43, 44, 45, 46, 47]


def datum(completion: list[int]) -> Datum:
    full = PROMPT + completion
    return Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})


def trainer_logprobs(rt, model_id: str) -> list[float]:
    """The trainer's logprobs of TARGET after PROMPT, on the weights it holds now."""
    out = rt.execute(ForwardRequest(model_id=model_id, data=[datum(TARGET)]))
    return out.loss_fn_outputs[0]["logprobs"][len(PROMPT) - 1:]


def served_logprobs(rt, model_id: str, version: int) -> list[float]:
    """vLLM's prompt logprobs of TARGET after PROMPT, on snapshot `version`."""
    (out,) = rt.sample([SampleRequest(model_id=model_id, prompt_tokens=PROMPT + TARGET, weights_version=version,
                                      prompt_logprobs=True, sampling_params=SamplingParams(max_tokens=1, seed=0))])
    return out.prompt_logprobs[len(PROMPT):]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def check(args, sync: str, graphs: bool) -> list[dict]:
    config = RuntimeConfig(runtime="torch", engine="vllm", vllm_sync=sync, device=args.device, dtype=args.dtype,
                           vllm_enforce_eager=not graphs, vllm_gpu_memory_utilization=0.2,
                           checkpoint_root=tempfile.mkdtemp(prefix="tinkerq-sync-check-"))
    rt = build_runtime(config)
    model = "check:train:0"
    unembed = sync == "lora"  # merged mode refuses an lm_head adapter on a tied base (the engine says why)
    rt.execute(CreateModelRequest(model_id=model, base_model=args.model,
                                  lora=LoraConfig(rank=8, seed=0, train_unembed=unembed)))
    rows = []
    try:
        for version in range(1, args.steps + 1):
            previous = trainer_logprobs(rt, model)
            rt.execute(ForwardBackwardRequest(model_id=model, data=[datum(TARGET)], loss_fn="cross_entropy"))
            rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=args.lr)))
            rt.execute(WeightSyncRequest(model_id=model, version=version))
            served = served_logprobs(rt, model, version)
            rows.append({"sync": sync, "cuda_graphs": graphs, "version": version,
                         "gap_to_synced": gap(served, trainer_logprobs(rt, model)),
                         "gap_to_previous": gap(served, previous)})
    finally:
        rt.engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default="tinyq-micro")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--modes", default="merged,lora")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "vllm_sync_check.json"))
    args = parser.parse_args()
    graph_modes = (False, True) if args.device != "cpu" else (False,)
    rows = [row for sync in args.modes.split(",") for graphs in graph_modes for row in check(args, sync, graphs)]
    print(f"{'sync':8} {'graphs':7} {'version':>7} {'gap to synced':>14} {'gap to previous':>16}  served right")
    for r in rows:
        right = r["gap_to_synced"] < r["gap_to_previous"] / 10
        print(f"{r['sync']:8} {str(r['cuda_graphs']):7} {r['version']:7d} {r['gap_to_synced']:14.4f} "
              f"{r['gap_to_previous']:16.4f}  {'yes' if right else 'NO'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    sys.exit(0 if all(r["gap_to_synced"] < r["gap_to_previous"] / 10 for r in rows) else 1)


if __name__ == "__main__":
    main()
