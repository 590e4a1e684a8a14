"""Sampling throughput through the queue against the engine called directly, in one run; and the
cost of a transient against a named (persisted) weight sync.

    python bench/sampling_throughput.py [--engine vllm|torch] [--vllm-sync lora|merged] [--compare-torch]
        [--model tinyq-micro] [--requests 64] [--num-samples 4] [--max-tokens 32] [--device cpu] [--dtype float32]

The same sample requests (fixed length: stop=[] so every sequence is max_tokens long), on a LoRA model
trained one step (so the adapter is live), go
(a) with --engine vllm, straight into vLLM's own `LLM.generate` (the floor: no translation, no queue),
(b) straight to an in-process runtime in one `sample()` call (our engine wrapper),
(c) through Producer.submit_many -> Redis -> a `tinkerq worker` process -> waiters,
(d) through the queue submitted one request at a time, and with --compare-torch
(e) to an in-process runtime on the PyTorch engine. Prints a table, writes JSON.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from redis import Redis
from tqdm import tqdm

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
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import QueueConfig, RuntimeConfig  # noqa: E402
from worker.runtime.registry import build_runtime  # noqa: E402

MODEL = "bench:train:0"


def workload(args) -> list[SampleRequest]:
    return [SampleRequest(model_id=MODEL, prompt_tokens=[(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)],
                          num_samples=args.num_samples,
                          sampling_params=SamplingParams(max_tokens=args.max_tokens, seed=i, stop=[]))
            for i in range(args.requests)]


def tokens_of(outputs) -> int:
    return sum(len(s.tokens) for o in outputs for s in o.sequences)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def setup_ops(args, model_id: str = MODEL, base: str | None = None, rank: int | None = None) -> list:
    """Create the model (args' base and rank unless given) and train it one step, so that what is sampled goes
    through a live adapter."""
    full = [(11 * j) % 1000 + 3 for j in range(args.prompt_len + 8)]
    datum = Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})
    lora = LoraConfig(rank=rank or args.lora_rank, seed=0, train_unembed=False)
    return [CreateModelRequest(model_id=model_id, base_model=base or args.model, lora=lora),
            ForwardBackwardRequest(model_id=model_id, data=[datum]),
            OptimStepRequest(model_id=model_id, adam_params=AdamParams(learning_rate=1e-3))]


def runtime_settings(args, engine: str) -> dict[str, str]:
    # vLLM pads every adapter to max_lora_rank: keep it at the rank in use
    return {"runtime": "torch", "engine": engine, "vllm_sync": args.vllm_sync, "device": args.device,
            "dtype": args.dtype, "vllm_gpu_memory_utilization": str(args.gpu_memory_utilization),
            "vllm_max_lora_rank": str(args.lora_rank), "vllm_enforce_eager": str(not args.cuda_graphs).lower()}


class Direct:
    """A runtime built in this process (the in-process one, or with `overrides` of its settings another, e.g. the
    Ray runtime's consumer side), called with every request in one sample() call."""

    def __init__(self, args, tmp: Path, engine: str, **overrides: str | int) -> None:
        settings = {"checkpoint_root": str(tmp / f"direct-{engine}"), **runtime_settings(args, engine), **overrides}
        self.rt = build_runtime(RuntimeConfig(**settings))
        self.versions: dict[str, int] = {}  # each model's latest synced version
        self.add_model(setup_ops(args))

    @property
    def version(self) -> int:
        return self.versions[MODEL]

    def add_model(self, ops: list) -> None:
        """Run a model's setup ops, then sync it once (its adapter live in the engine)."""
        for op in ops:
            self.rt.execute(op)
        self.versions[ops[0].model_id] = 0
        self.sync_ms(None, ops[0].model_id)

    def sample(self, requests: list[SampleRequest]) -> float:
        pinned = [r.model_copy(update={"weights_version": self.versions[r.model_id]}) for r in requests]
        outputs, seconds = timed(lambda: self.rt.sample(pinned))
        assert all(o.type == "sample" for o in outputs), outputs[:1]
        return tokens_of(outputs) / seconds

    def sync_ms(self, name: str | None, model_id: str = MODEL) -> float:
        self.versions[model_id] += 1
        request = WeightSyncRequest(model_id=model_id, version=self.versions[model_id], name=name)
        output, seconds = timed(lambda: self.rt.execute(request))
        assert output.applied and output.persisted == (name is not None)
        return seconds * 1000


class Queued:
    """The same requests through Redis and a `tinkerq worker --runtime torch` process."""

    def __init__(self, args, url: str, tmp: Path) -> None:
        settings = {f"TINKERQ_{k.upper()}": v for k, v in runtime_settings(args, args.engine).items()}
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **settings, "PYTHONPATH": path, "TINKERQ_NUM_SHARDS": "1",
               "TINKERQ_CHECKPOINT_ROOT": str(tmp / "queue")}
        self.worker = subprocess.Popen([sys.executable, "-m", "commands.cli", "worker", "--redis-url", url,
                                        "--log-level", "WARNING"], env=env, cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=self._log_file(tmp))
        self.producer = Producer(Redis.from_url(url), QueueConfig(num_shards=1))
        for op in setup_ops(args):
            result = self._wait(self.producer.submit(op).request_id)
            assert result is not None and result.type != "error", result
        self.sync_ms(None)

    def _log_file(self, tmp: Path):
        tmp.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "worker.log"
        return open(self.log, "w")

    def _wait(self, request_id: str):
        """A result, or the worker's own error output if it died first."""
        for _ in range(900):
            result = self.producer.wait(request_id, 1)
            if result is not None:
                return result
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited ({self.worker.returncode}): {self.log.read_text()[-3000:]}")
        raise TimeoutError(request_id)

    def _wait_all(self, tickets) -> list:
        outputs = [self.producer.wait(t.request_id, 600) for t in tickets]
        assert all(o is not None and o.type == "sample" for o in outputs), outputs[:1]
        return outputs

    def sample(self, requests: list[SampleRequest], one_by_one: bool = False) -> float:
        def run():
            tickets = [self.producer.submit(r) for r in requests] if one_by_one else \
                self.producer.submit_many(requests)
            return self._wait_all(tickets)

        outputs, seconds = timed(run)
        return tokens_of(outputs) / seconds

    def sync_ms(self, name: str | None) -> float:
        ticket = self.producer.submit(WeightSyncRequest(model_id=MODEL, name=name))
        output, seconds = timed(lambda: self.producer.wait(ticket.request_id, 600))
        assert output.type == "weight_sync" and output.persisted == (name is not None)
        return seconds * 1000

    def close(self) -> None:
        self.producer.close()
        self.worker.terminate()
        self.worker.wait(30)


class RawVllm:
    """vLLM's own LLM.generate on the same prompts, adapter and sampling settings: the floor."""

    def __init__(self, direct: Direct, args) -> None:
        self.direct, self.args = direct, args

    def sample(self, requests: list[SampleRequest]) -> float:
        from vllm import SamplingParams as VllmParams

        engine = self.direct.rt.engine
        llm = engine.llms[engine.base_of[MODEL]]
        lora = engine.snapshots[MODEL][self.direct.version]
        prompts, params = [], []
        for r in requests:
            for k in range(r.num_samples):
                prompts.append({"prompt_token_ids": r.prompt_tokens})
                params.append(VllmParams(max_tokens=r.sampling_params.max_tokens, seed=r.sampling_params.seed + k,
                                         ignore_eos=True, logprobs=0, detokenize=False))
        outputs, seconds = timed(lambda: llm.generate(prompts, params, lora_request=lora, use_tqdm=False))
        return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def measure(args, requests, url: str, tmp: Path) -> dict:
    direct, queued = Direct(args, tmp, args.engine), Queued(args, url, tmp)
    paths = {"direct": direct.sample, "queue": queued.sample,
             "queue_one_by_one": lambda reqs: queued.sample(reqs, one_by_one=True)}
    if hasattr(direct.rt.engine, "llms"):
        paths = {"vllm_raw": RawVllm(direct, args).sample, **paths}
    if args.compare_torch:
        paths["torch_engine"] = Direct(args, tmp, "torch").sample
    try:
        for sample in paths.values():
            sample(requests[:4])  # warm-up
        rows: dict[str, list[float]] = {name: [] for name in paths}
        # rounds interleave the paths, so drift on a shared machine hits all of them alike
        for _ in tqdm(range(args.repeats), desc="rounds"):
            for name, sample in paths.items():
                rows[name].append(sample(requests))
        kinds = (("transient", None),) + ((("named", "snap"),) if args.named_syncs else ())
        syncs = {where: {kind: statistics.median(path.sync_ms(name) for _ in range(args.repeats))
                         for kind, name in kinds}
                 for where, path in (("direct", direct), ("queue", queued))}
    finally:
        queued.close()
    baseline = rows.get("vllm_raw", rows["direct"])
    ratios = {name: statistics.median(x / b for x, b in zip(values, baseline)) for name, values in rows.items()}
    return {"tokens_per_s": {k: statistics.median(v) for k, v in rows.items()}, "rounds": rows,
            "ratio_to": "vllm_raw" if "vllm_raw" in rows else "direct", "ratios": ratios, "sync_ms": syncs,
            "bytes": weight_bytes(direct), **floors(args, direct)}


def weight_bytes(direct: Direct, model_id: str = MODEL) -> dict[str, int]:
    """The bytes a sync of `model_id` exports (its adapter) and its base model's, from an in-process runtime."""
    trainer = direct.rt.trainer
    lora = sum(t.numel() * t.element_size() for t in trainer.export_weights(model_id).tensors.values())
    base = trainer.models[model_id].base.model.get_base_model()
    full = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n)
    return {"lora": lora, "model": full}


def floors(args, direct: Direct) -> dict:
    """On a GPU: the bytes a sync must move over the HBM bandwidth measured now (read + write counted)."""
    if not args.device.startswith("cuda"):
        return {}
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device=args.device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        torch.cuda.synchronize()
        _, seconds = timed(lambda: (dst.copy_(src), torch.cuda.synchronize()))
        times.append(seconds)
    bandwidth = 2 * src.numel() / statistics.median(times[3:])
    sizes = weight_bytes(direct)
    return {"hbm_bytes_per_s": bandwidth,
            "floor_ms": {kind: 1000 * n / bandwidth for kind, n in sizes.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "torch"])
    parser.add_argument("--vllm-sync", default="lora", choices=["lora", "merged"])
    parser.add_argument("--compare-torch", action="store_true", help="add the PyTorch engine, in process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="vLLM with CUDA graphs (TINKERQ_VLLM_ENFORCE_EAGER=0)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--no-named-syncs", dest="named_syncs", action="store_false",
                        help="skip persisted syncs (they write a merged checkpoint: minutes for a 0.5B+ model)")
    parser.add_argument("--model", default="tinyq-micro")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "sampling_throughput.json"))
    args = parser.parse_args()
    requests = workload(args)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinkerq-bench-{os.getpid()}"
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        Redis.from_url(url).flushdb()
        print(f"{len(requests)} requests x {args.num_samples} samples x {args.max_tokens} tokens on {args.model}")
        result = measure(args, requests, url, tmp)
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        **result,
    }
    rates, ratios = result["tokens_per_s"], result["ratios"]
    labels = {"vllm_raw": "vLLM LLM.generate, direct", "direct": f"{args.engine} engine, one sample() call",
              "queue": "queue, submit_many", "queue_one_by_one": "queue, submitted one by one",
              "torch_engine": "PyTorch engine, one sample() call"}
    print(f"\n{'path':<36}{'tokens/s':>10}{'ratio':>8}   (medians of {args.repeats} interleaved rounds; "
          f"ratio to {result['ratio_to']})")
    for name, rate in rates.items():
        print(f"{labels[name]:<36}{rate:>10.0f}{ratios[name]:>8.2f}")
    sync = result["sync_ms"]
    print(f"\n{'weight sync (median ms)':<36}{'transient':>10}{'named':>8}")
    for where, label in (("direct", "engine-side, in process"), ("queue", "through the queue")):
        print(f"{label:<36}{sync[where]['transient']:>10.1f}{sync[where].get('named', float('nan')):>8.1f}")
    if "floor_ms" in result:
        print(f"floor (bytes / HBM {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in result["floor_ms"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
