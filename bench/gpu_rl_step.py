"""An RL step end to end through the queue, timed by phase, against raw vLLM on the same prompts (issue 14, item 5).

    python bench/gpu_rl_step.py [--device cuda] [--model randq-0.5b] [--prompts 256] [--max-tokens 256] [--steps 5]
    python bench/gpu_rl_step.py --device cpu       # smoke: tinyq-micro, float32, 16 prompts x 16 tokens, 3 steps

Two parts, one after the other, so that each has the GPU to itself:

1. **Baseline, in a child process** that exits before the worker starts (a vLLM engine does not give its memory back
   reliably inside a process, and the worker sizes its own share from what is free): the torch runtime built in
   process from the worker's own settings, a model created, trained one step and synced (its adapter live in vLLM),
   then vLLM's own `LLM.generate` on the same prompts, with the vLLM SamplingParams our engine builds for them
   (`worker/vllm_runtime/translate.sampling_params`: same seeds, temperature, logprobs, ignore_eos) and the same
   adapter; and our engine's `Runtime.sample` in process for reference. Median of --raw-rounds after a warm-up.
   --no-baseline skips it (a large shape's two engine starts may not fit one device call); the report then has no
   ratio to raw.
2. **The queue**: Redis (REDIS_URL, or one embedded), a `tinkerq worker` process with those settings, a Producer
   here. Each step: sample (`submit_many` of P requests, each pinned by the producer to the latest version, until
   every result is in), build the datums (importance_sampling: the samples' tokens, their logprobs, advantage =
   reward - batch mean, reward = the fraction of even token ids; or cross_entropy weighted by the advantages),
   forward_backward (one request), optim_step, transient weight sync; each phase timed from its submit to its
   result. Every sample of a step must carry the version the previous step's sync made. Median of --steps steps
   after --warmup steps.

Reports the phases' medians, the sync's share of the step (goal < 1%) and the queue's sampling tokens/s against raw
vLLM (goal >= 0.9); writes bench/results/gpu_rl_step[-TAG].json and .png (phase times per step). With --sleep the
worker runs vLLM in sleep mode (TINKERQ_VLLM_SLEEP_DURING_TRAINING): its forward_backward phase then includes vLLM
falling asleep and its sync phase vLLM waking up. With --resample each step samples its batch a second time at once
(untimed in the step). On CUDA each step records the GPU's clocks, temperature and power before and after sampling.
With --runtimes torch,ray part 2 runs twice, through the in-process worker and then through the Ray runtime's worker
on one bundle (an engine replica and a trainer rank as Ray actors sharing the GPU; issue 15 item 5: its step <= 1.1 x
the in-process one), and the report adds their ratio by phase (Ray travels in the carry of `RAY=1
bench/h200_vllm_carry.sh`).
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
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
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import QueueConfig  # noqa: E402
from worker.runtime import cuda_allocator  # noqa: E402

MODEL = "bench-rl:train:0"
PHASES = ("sample", "build", "forward_backward", "optim_step", "sync")
# 3 warm-up steps on a GPU: the worker's vLLM steps sped up over its first batches (H200, 2026-12-06: 2,968 -> 2,650
# -> 2,524 -> 2,232 ms for the same 256 x 256), so one warm-up step measured a worker still warming (bench/RESULTS.md)
DEFAULTS = {"cuda": dict(model="randq-0.5b", dtype="bfloat16", prompts=256, max_tokens=256, prompt_len=32, steps=5,
                         warmup=3, raw_rounds=3, rank=32),
            "cpu": dict(model="tinyq-micro", dtype="float32", prompts=16, max_tokens=16, prompt_len=16, steps=3,
                        warmup=1, raw_rounds=3, rank=8)}
# what the worker's log says about its memory and sleep mode, kept in the JSON
# (also printed after the table)
MEMORY_LINES = r"vLLM memory share|engine's weights|keeps its own copy|after vLLM's start|dry pass|CUDA allocator"
LOG_LINES = re.compile(MEMORY_LINES + r"|fall asleep|wake up tags|Sleep mode freed|KV cache|engine run:")


def prompts(args) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 1000 + 3 for j in range(args.prompt_len)] for i in range(args.prompts)]


def sample_requests(args, model_id: str = MODEL) -> list[SampleRequest]:
    # stop=[]: every sequence is max_tokens long (ignore_eos), in every path
    return [SampleRequest(model_id=model_id, prompt_tokens=p, num_samples=args.num_samples,
                          sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, stop=[]))
            for i, p in enumerate(prompts(args))]


def create_request(args) -> CreateModelRequest:
    return CreateModelRequest(model_id=MODEL, base_model=args.model,
                              lora=LoraConfig(rank=args.rank, seed=0, train_unembed=args.train_unembed))


def settings(args, runtime: str = "torch") -> dict[str, str]:
    """The runtime's settings, for RuntimeConfig in the baseline and as TINKERQ_* for the worker. `runtime` "ray":
    the Ray runtime on one bundle per tensor-parallel GPU (an engine replica over them, a trainer rank on the first,
    as actors sharing it)."""
    out = {"runtime": "torch", "engine": "vllm", "vllm_sync": args.vllm_sync, "device": args.device,
           "dtype": args.dtype, "vllm_gpu_memory_utilization": args.gpu_memory_utilization,
           "vllm_max_lora_rank": str(args.rank), "vllm_sleep_during_training": str(args.sleep).lower(),
           "vllm_memory_margin_gib": str(args.memory_margin_gib),
           "train_micro_batch_tokens": str(args.micro_batch_tokens),
           "vllm_tensor_parallel_size": str(args.tensor_parallel), "vllm_share_base": str(args.share_base).lower()}
    if args.eager is not None:
        out["vllm_enforce_eager"] = str(args.eager).lower()
    if runtime == "ray":  # as in process: one trainer (rank) on GPU 0, one engine over GPUs 0..k-1
        out.update(runtime="ray", ray_gpus=str(args.tensor_parallel), ray_trainer_ranks="1")
    return out


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def build_datums(args, requests: list[SampleRequest], outputs: list) -> list[Datum]:
    """One datum per sampled sequence: prompt + completion, the sampler's logprobs on the completion, advantage =
    reward - the batch's mean reward on the completion (0 on the prompt: no gradient there)."""
    rows = [(r.prompt_tokens, s) for r, o in zip(requests, outputs) for s in o.sequences]
    rewards = [reward(s.tokens) for _, s in rows]
    mean = statistics.fmean(rewards)
    data = []
    for (prompt, seq), r in zip(rows, rewards):
        full = prompt + seq.tokens
        pad = [0.0] * (len(prompt) - 1)
        advantages = pad + [r - mean] * len(seq.tokens)
        inputs = {"target_tokens": [float(t) for t in full[1:]]}
        if args.loss == "importance_sampling":
            inputs.update(logprobs=pad + list(seq.logprobs), advantages=advantages)
        else:
            inputs.update(weights=advantages)
        data.append(Datum(model_input=full[:-1], loss_fn_inputs=inputs))
    return data


GPU_STATE = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")


def gpu_state(device: str) -> dict | None:
    """The GPU's clocks (MHz), temperature (C) and power (W) now, from nvidia-smi (None off CUDA or without it): read
    right before and right after each sample phase, outside its timing, to tell a GPU slowed by the training pass
    before it from a slower process."""
    if not device.startswith("cuda"):
        return None
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_STATE)}", "--format=csv,noheader,nounits",
                               f"--id={os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]}"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(GPU_STATE, (float(v) if v.strip().replace(".", "", 1).isdigit() else v.strip()
                                for v in line.split(","))))


def tokens_of(outputs) -> int:
    return sum(len(s.tokens) for o in outputs for s in o.sequences)


# -- 1. the baseline, in a child process ---------------------------------------------------------------------------

def baseline(args) -> dict:
    """Raw vLLM LLM.generate and our engine in process, on the runtime the worker builds from the same settings."""
    import torch
    from vllm import SamplingParams as VllmParams

    from tinkerq.config import RuntimeConfig
    from worker.runtime.registry import build_runtime
    from worker.vllm_runtime import translate

    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-rl-baseline-"))
    rt = build_runtime(RuntimeConfig(checkpoint_root=str(tmp), **settings(args)))
    rt.execute(create_request(args))
    requests = sample_requests(args)
    # one training step and a sync, so that the adapter is live in vLLM (an untrained one is served as the base)
    outputs = rt.sample([r.model_copy(update={"weights_version": 0}) for r in requests])
    rt.execute(ForwardBackwardRequest(model_id=MODEL, data=build_datums(args, requests, outputs), loss_fn=args.loss))
    rt.execute(OptimStepRequest(model_id=MODEL, adam_params=AdamParams(learning_rate=args.lr)))
    rt.execute(WeightSyncRequest(model_id=MODEL, version=1))
    engine = rt.engine
    llm, lora = engine.llms[args.model], engine.snapshots[MODEL][1]
    assert lora is not None or args.vllm_sync == "merged", "the trained adapter is not live"
    vllm_prompts, vllm_params = [], []
    for r in requests:
        for k in range(r.num_samples):
            vllm_prompts.append({"prompt_token_ids": r.prompt_tokens})
            vllm_params.append(VllmParams(**translate.sampling_params(r, k)))
    pinned = [r.model_copy(update={"weights_version": 1}) for r in requests]

    def raw() -> float:
        start = time.perf_counter()
        outs = llm.generate(vllm_prompts, vllm_params, lora_request=lora, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

    def ours() -> float:
        start = time.perf_counter()
        outs = rt.sample(pinned)
        seconds = time.perf_counter() - start
        assert all(o.type == "sample" for o in outs), outs[:1]
        return tokens_of(outs) / seconds

    raw(), ours()  # warm-up (LoRA kernels' JIT, first batch shapes)
    rounds = {"vllm_raw": [], "engine_in_process": []}
    for _ in range(args.raw_rounds):  # interleaved, so drift hits both alike
        rounds["vllm_raw"].append(raw())
        rounds["engine_in_process"].append(ours())
    memory = {base: {"utilization": p.utilization, "total": p.total, "free": p.free, "trainer_peak": p.trainer_peak,
                     "margin": p.margin, "budget_tokens": p.budget_tokens, "line": p.describe()}
              for base, p in engine.memory_plans.items()}
    info = {"tokens_per_s": {k: statistics.median(v) for k, v in rounds.items()}, "rounds": rounds,
            "memory_plans": memory, "torch": torch.__version__}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except AttributeError:
        pass
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_peak_allocated"] = torch.cuda.max_memory_allocated()
    engine.close()
    return info


def run_baseline(args, tmp: Path) -> dict:
    out, log = tmp / "baseline.json", tmp / "baseline.log"
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--baseline-json", str(out)]
    with open(log, "w") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(args, tmp))
    if done.returncode != 0:
        raise RuntimeError(f"the baseline process failed ({done.returncode}):\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def child_env(args, tmp: Path, runtime: str = "torch", schedule: str = "lanes") -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            **{f"TINKERQ_{k.upper()}": v for k, v in settings(args, runtime).items()},
            "TINKERQ_NUM_SHARDS": "1", "TINKERQ_CHECKPOINT_ROOT": str(tmp / "ckpt"),
            "TINKERQ_MAX_BATCH_REQUESTS": str(max(256, args.prompts)),
            "TINKERQ_LANES": "1" if schedule == "lanes" else "0"}


# -- 2. the queue --------------------------------------------------------------------------------------------------

class Queue:
    """A `tinkerq worker` process and a Producer, and waits that fail fast with the worker's log if it dies."""

    def __init__(self, args, url: str, tmp: Path, runtime: str = "torch", schedule: str = "lanes") -> None:
        self.log = tmp / f"worker-{runtime}-{schedule}.log"
        self.worker = subprocess.Popen([sys.executable, "-m", "commands.cli", "worker", "--redis-url", url,
                                        "--log-level", "INFO"], env=child_env(args, tmp, runtime, schedule), cwd=ROOT,
                                       stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        self.producer = Producer(Redis.from_url(url), QueueConfig(num_shards=1))

    def wait(self, ticket, kind: str, timeout_s: float = 1800):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.producer.wait(ticket.request_id, 1)
            if result is not None:
                if result.type != kind:
                    raise RuntimeError(f"expected a {kind} result, got {result}")
                return result
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited ({self.worker.returncode}):\n{self.log.read_text()[-4000:]}")
        raise TimeoutError(f"no result for {ticket.request_id} in {timeout_s} s")

    def log_lines(self) -> list[str]:
        return [line.strip() for line in self.log.read_text(errors="replace").splitlines() if LOG_LINES.search(line)]

    def close(self) -> None:
        self.producer.close()
        self.worker.terminate()
        try:
            self.worker.wait(60)
        except subprocess.TimeoutExpired:
            self.worker.kill()


def created(args, queue: Queue) -> None:
    started = time.perf_counter()
    queue.wait(queue.producer.submit(create_request(args)), "create_model")
    print(f"worker ready (model created, engine started) in {time.perf_counter() - started:.1f} s", flush=True)


def train_and_sync(args, queue: Queue, data: list[Datum], version: int) -> tuple:
    """forward_backward, optim_step and a transient sync, each submitted once the one before answered: the
    forward_backward's result, the sync's, and the times each ended (perf_counter)."""
    fb = queue.wait(queue.producer.submit(ForwardBackwardRequest(model_id=MODEL, data=data, loss_fn=args.loss)),
                    "forward_backward")
    t3 = time.perf_counter()
    queue.wait(queue.producer.submit(OptimStepRequest(model_id=MODEL, adam_params=AdamParams(learning_rate=args.lr))),
               "optim_step")
    t4 = time.perf_counter()
    sync = queue.wait(queue.producer.submit(WeightSyncRequest(model_id=MODEL)), "weight_sync")
    t5 = time.perf_counter()
    assert sync.applied and not sync.persisted and sync.version == version + 1, sync
    return fb, sync, (t3, t4, t5)


def step_figures(outputs: list, data: list[Datum], fb, version: int, sample_s: float) -> dict:
    """What a row records beside its phase times."""
    tokens = tokens_of(outputs)
    return {"sampled_tokens": tokens, "sample_tokens_per_s": tokens / max(sample_s, 1e-9),
            "train_tokens": sum(len(d.model_input) for d in data), "loss": fb.metrics.get("loss:sum"),
            "mean_reward": statistics.fmean(reward(s.tokens) for o in outputs for s in o.sequences),
            "version": version}


def phase_ms(marks: list[tuple[float, float]]) -> dict[str, float]:
    return dict(zip(PHASES, ((b - a) * 1e3 for a, b in marks)))


def rl_steps(args, queue: Queue) -> list[dict]:
    """Warm-up and timed steps through the queue; one row per step."""
    created(args, queue)
    requests = sample_requests(args)
    version = 0  # what the producer pins samples to: the latest sync (0: none yet)
    rows = []
    for step in range(args.warmup + args.steps):
        row: dict = {"step": step, "warmup": step < args.warmup, "gpu_before_sample": gpu_state(args.device)}
        t0 = time.perf_counter()
        outputs = [queue.wait(t, "sample") for t in queue.producer.submit_many(requests)]
        t1 = time.perf_counter()
        row["gpu_after_sample"] = gpu_state(args.device)
        row["versions_served"] = sorted({o.weights_version for o in outputs})
        row["right_version"] = row["versions_served"] == [version]
        if args.resample:  # the same batch again, right after one: no training between (not part of the step)
            again_from = time.perf_counter()
            again = [queue.wait(t, "sample") for t in queue.producer.submit_many(requests)]
            row["resample_tokens_per_s"] = tokens_of(again) / (time.perf_counter() - again_from)
        aside_s = time.perf_counter() - t1  # the GPU reading and the resample: no phase's time
        data = build_datums(args, requests, outputs)
        t2 = time.perf_counter()
        fb, sync, (t3, t4, t5) = train_and_sync(args, queue, data, version)
        version = sync.version
        t1b = t1 + aside_s  # the build starts after them
        row.update({"ms": phase_ms([(t0, t1), (t1b, t2), (t2, t3), (t3, t4), (t4, t5)]),
                    "total_ms": (t5 - t0 - aside_s) * 1e3, **step_figures(outputs, data, fb, version, t1 - t0)})
        row["sync_share"] = row["ms"]["sync"] / row["total_ms"]
        rows.append(row)
        ms = row["ms"]
        print(f"step {step}{' (warm-up)' if row['warmup'] else ''}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
              + f" ms; total {row['total_ms']:.0f} ms; {row['sample_tokens_per_s']:.0f} tok/s"
              + (f" (again at once: {row['resample_tokens_per_s']:.0f})" if args.resample else "")
              + (f"; SM clock {row['gpu_before_sample']['clocks.sm']} MHz before sampling, "
                 f"{row['gpu_after_sample']['clocks.sm']} after" if row["gpu_before_sample"] and row["gpu_after_sample"]
                 else "")
              + f"; served v{row['versions_served']}", flush=True)
    return rows


def rl_steps_off_policy(args, queue: Queue) -> list[dict]:
    """One step off-policy, as tinker-cookbook's async mode runs: batch k+1 is submitted (pinned by the producer to
    the latest sync, the weights before step k's) right before step k's forward_backward, so a worker with lanes
    samples it while it trains; a serial worker samples it first. A row's phases overlap: its total is the step's
    wall time, from waiting for its batch to its sync's result."""
    created(args, queue)
    requests = sample_requests(args)
    version, pending, pinned = 0, queue.producer.submit_many(requests), 0
    rows = []
    for step in range(args.warmup + args.steps):
        row: dict = {"step": step, "warmup": step < args.warmup}
        t0 = time.perf_counter()
        outputs = [queue.wait(t, "sample") for t in pending]
        t1 = time.perf_counter()
        row["versions_served"] = sorted({o.weights_version for o in outputs})
        row["right_version"] = row["versions_served"] == [pinned]
        pending, pinned = queue.producer.submit_many(requests), version  # the next batch, sampled meanwhile
        data = build_datums(args, requests, outputs)
        t2 = time.perf_counter()
        fb, sync, (t3, t4, t5) = train_and_sync(args, queue, data, version)
        version = sync.version
        row.update({"ms": phase_ms([(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]), "total_ms": (t5 - t0) * 1e3,
                    **step_figures(outputs, data, fb, version, t1 - t0)})
        row["sync_share"] = row["ms"]["sync"] / row["total_ms"]
        rows.append(row)
        print(f"step {step}{' (warm-up)' if row['warmup'] else ''} (off-policy): "
              + ", ".join(f"{k} {v:.1f}" for k, v in row["ms"].items())
              + f" ms; total {row['total_ms']:.0f} ms; served v{row['versions_served']}", flush=True)
    return rows


def sampling_alone(args, queue: Queue) -> float:
    """Tokens/s of the batch sampled through the queue with nothing else queued (after the steps: warm)."""
    requests = sample_requests(args)
    rates = []
    for _ in range(max(1, args.raw_rounds)):
        t0 = time.perf_counter()
        outputs = [queue.wait(t, "sample") for t in queue.producer.submit_many(requests)]
        rates.append(tokens_of(outputs) / (time.perf_counter() - t0))
    return statistics.median(rates)


# -- report --------------------------------------------------------------------------------------------------------

def summarize(rows: list[dict], base: dict | None) -> dict:
    """The phases' medians; against raw vLLM where the baseline ran (--no-baseline: those fields are None)."""
    timed = [r for r in rows if not r["warmup"]]
    phases = {p: statistics.median(r["ms"][p] for r in timed) for p in PHASES}
    total = statistics.median(r["total_ms"] for r in timed)
    queue_rate = statistics.median(r["sample_tokens_per_s"] for r in timed)
    raw = base["tokens_per_s"]["vllm_raw"] if base else None
    resample = (statistics.median(r["resample_tokens_per_s"] for r in timed)
                if "resample_tokens_per_s" in timed[0] else None)
    return {"phase_ms": phases, "total_ms": total,
            "sync_share": statistics.median(r["sync_share"] for r in timed),
            "sample_tokens_per_s": queue_rate, "raw_tokens_per_s": raw,
            "engine_in_process_tokens_per_s": base["tokens_per_s"]["engine_in_process"] if base else None,
            "sampling_ratio_to_raw": queue_rate / raw if raw else None,
            "resample_ratio_to_raw": resample / raw if raw and resample else None,
            "all_served_right_version": all(r["right_version"] for r in rows)}


def print_table(args, summary: dict, runtime: str = "torch") -> None:
    total = summary["total_ms"]
    print(f"\nRL step through the queue ({runtime} runtime): {args.model}, {args.prompts} prompts x "
          f"{args.num_samples} x {args.max_tokens} tokens, {args.loss}, LoRA rank {args.rank}, {args.vllm_sync} sync"
          f"{', sleep mode' if args.sleep else ''} "
          f"(median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'phase':<18}{'ms':>10}{'share':>9}")
    for phase, ms in summary["phase_ms"].items():
        print(f"{phase:<18}{ms:>10.1f}{ms / total:>9.2%}")
    print(f"{'step (total)':<18}{total:>10.1f}{1:>9.0%}")
    goal = lambda ok: "met" if ok else "NOT met"
    print(f"\nsync share of the step (median of per-step shares): {summary['sync_share']:.3%}  "
          f"(goal < 1%: {goal(summary['sync_share'] < 0.01)})")
    if summary["raw_tokens_per_s"] is None:
        print(f"sampling: queue {summary['sample_tokens_per_s']:.0f} tok/s (--no-baseline: no raw vLLM to compare)")
    else:
        print(f"sampling: queue {summary['sample_tokens_per_s']:.0f} tok/s, raw vLLM LLM.generate "
              f"{summary['raw_tokens_per_s']:.0f} tok/s (child process, before the worker), our engine in process "
              f"{summary['engine_in_process_tokens_per_s']:.0f} tok/s; queue / raw = "
              f"{summary['sampling_ratio_to_raw']:.3f} (goal >= 0.9: {goal(summary['sampling_ratio_to_raw'] >= 0.9)})")
    if summary["resample_ratio_to_raw"] is not None:
        print("the same batch sampled again at once (no training between): "
              f"{summary['resample_ratio_to_raw']:.3f} of raw")
    print(f"every sample served on the version of the sync before it: {summary['all_served_right_version']}")


def plot(rows: list[dict], summary: dict, title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r['step']}{'w' if r['warmup'] else ''}" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r["ms"][phase] / 1e3 for r in rows]
        left.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    if summary["raw_tokens_per_s"]:
        raw_s = rows[0]["sampled_tokens"] / summary["raw_tokens_per_s"]
        left.axhline(raw_s, color="k", linestyle=":", linewidth=1, label="raw vLLM sampling time")
    left.set(xlabel="step (w: warm-up)", ylabel="seconds", title="phases per step")
    left.legend(fontsize=7)
    phases = summary["phase_ms"]
    right.barh(list(phases), list(phases.values()))
    right.set_xscale("log")
    ratio = summary["sampling_ratio_to_raw"]
    right.set(xlabel="ms (median, log scale)", title=f"sync {summary['sync_share']:.2%} of the step"
              + (f"; sampling {ratio:.2f}x raw" if ratio else ""))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model")
    parser.add_argument("--dtype")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--raw-rounds", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "cross_entropy"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--train-unembed", action="store_true", help="LoRA on lm_head too")
    parser.add_argument("--vllm-sync", default="lora", choices=["lora", "merged"])
    parser.add_argument("--gpu-memory-utilization", default="auto", help="auto (sized from the trainer) or a share")
    parser.add_argument("--memory-margin-gib", type=float, default=2.0)
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="TINKERQ_TRAIN_MICRO_BATCH_TOKENS")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM eager (--eager) or CUDA graphs (--no-eager); "
                             "default: the worker's (graphs on a GPU)")
    parser.add_argument("--sleep", action="store_true", help="vLLM sleep mode during forward passes")
    parser.add_argument("--share-base", action=argparse.BooleanOptionalAction, default=True,
                        help="TINKERQ_VLLM_SHARE_BASE: the trainer reads the base from the engine's weights")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="vLLM's tensor parallelism (TINKERQ_VLLM_TENSOR_PARALLEL_SIZE): GPUs 0..k-1 per engine, "
                             "in process and on Ray")
    parser.add_argument("--resample", action="store_true",
                        help="sample the batch a second time right after the first, untimed in the step: tells a "
                             "slowdown that follows training from one of the worker process itself")
    parser.add_argument("--runtimes", type=lambda v: v.split(","), default=["torch"],
                        help="the workers to run the steps through, one after the other: torch (in process), ray "
                             "(the Ray runtime on one GPU bundle), or torch,ray to compare them")
    parser.add_argument("--schedules", type=lambda v: v.split(","), default=["lanes"],
                        help="the worker's schedules, one run each: lanes (sampling while training), serial "
                             "(TINKERQ_LANES=0), or serial,lanes to compare them")
    parser.add_argument("--off-policy", action="store_true",
                        help="sample batch k+1 while training on batch k (tinker-cookbook's async mode, one step "
                             "off-policy), and measure sampling alone through the queue after the steps")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="part 1 (raw vLLM in a child process); --no-baseline: only the queue, e.g. where a "
                             "large shape's two engine starts would not fit a device call")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", help="JSON path (default bench/results/gpu_rl_step[-TAG].json)")
    parser.add_argument("--baseline-json", help=argparse.SUPPRESS)  # the child process of part 1
    args = parser.parse_args()
    if not args.runtimes or set(args.runtimes) - {"torch", "ray"}:
        parser.error(f"--runtimes: torch, ray or torch,ray; not {','.join(args.runtimes)}")
    for key, value in DEFAULTS["cpu" if args.device == "cpu" else "cuda"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.baseline_json:
        Path(args.baseline_json).write_text(json.dumps(baseline(args)))
        return

    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-rl-step-"))
    print(f"{args.prompts} prompts x {args.num_samples} x {args.max_tokens} tokens on {args.model} ({args.device}, "
          f"{args.dtype}); logs in {tmp}", flush=True)
    base = announce_baseline(args, tmp) if args.baseline else None
    runs = {}
    with ExitStack() as stack:
        url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        for runtime, schedule in [(r, s) for r in args.runtimes for s in args.schedules]:  # each alone on the GPU
            Redis.from_url(url).flushdb()
            key = runtime if len(args.schedules) == 1 else f"{runtime}-{schedule}"
            print(f"-- through the queue, the {runtime} runtime's worker, {schedule} schedule", flush=True)
            queue = Queue(args, url, tmp, runtime, schedule)
            try:
                rows = rl_steps_off_policy(args, queue) if args.off_policy else rl_steps(args, queue)
                alone = sampling_alone(args, queue) if args.off_policy else None
            except (RuntimeError, TimeoutError) as exc:
                if not runs:
                    raise
                print(f"the {key} run failed; the report keeps the runs before it:\n{exc}", flush=True)
                continue
            finally:
                queue.close()
            runs[key] = {"summary": summarize(rows, base), "steps": rows, "worker_log": queue.log_lines(),
                         "worker_settings": settings(args, runtime), "schedule": schedule,
                         "sampling_alone_tokens_per_s": alone,
                         "sampling_alone_ratio_to_raw": alone / base["tokens_per_s"]["vllm_raw"] if alone and base
                         else None}
    for runtime, run in runs.items():
        print_table(args, run["summary"], runtime)
        for line in run["worker_log"]:
            if re.search(MEMORY_LINES, line):
                print(f"worker: {line}")
    comparison = ray_comparison(runs)
    lanes_vs_serial = schedule_comparison(runs)
    name = "gpu_rl_step" + (f"-{args.tag}" if args.tag else "")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    first = next(iter(runs.values()))
    alloc_name, alloc, operators = cuda_allocator.chosen(os.environ)  # what the worker and the baseline ran with
    report = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python "
                         f"{platform.python_version()}",
              "workload": {**{k: v for k, v in vars(args).items() if k not in ("baseline_json", "out")},
                           "cuda_alloc_conf": f"{alloc_name}={alloc}{'' if operators else ' (the worker default)'}"},
              "baseline_where": "raw vLLM LLM.generate and our engine, in a child process run to completion before "
                                "the worker starts, on the runtime built from the worker's settings",
              "baseline": base, **first, "runtimes": runs, "ray_comparison": comparison,
              "lanes_vs_serial": lanes_vs_serial}
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    title = (f"{args.model} {args.device}: {args.prompts}x{args.num_samples}x{args.max_tokens} tokens, {args.loss}, "
             f"rank {args.rank}, {args.vllm_sync}{', sleep mode' if args.sleep else ''}"
             f"{', eager' if args.eager else ''}{f', {alloc}' if operators else ''}")
    for i, (runtime, run) in enumerate(runs.items()):
        suffix = "" if i == 0 else f"-{runtime}"
        plot(run["steps"], run["summary"], f"{title} ({runtime} runtime)",
             out.with_name(out.stem + suffix + ".png"))
    sys.exit(0 if all(run["summary"]["all_served_right_version"] for run in runs.values()) else 1)


def announce_baseline(args, tmp: Path) -> dict:
    started = time.perf_counter()
    base = run_baseline(args, tmp)
    print(f"baseline (child process, {time.perf_counter() - started:.0f} s): raw vLLM "
          f"{base['tokens_per_s']['vllm_raw']:.0f} tok/s, our engine in process "
          f"{base['tokens_per_s']['engine_in_process']:.0f} tok/s", flush=True)
    for plan in base["memory_plans"].values():
        print(f"baseline {plan['line']}")
    return base


def schedule_comparison(runs: dict) -> dict | None:
    """The lanes' step against the serial schedule's, on each runtime where both ran (issue 40: <= 0.75 with
    --off-policy), and sampling alone through the queue against raw vLLM (>= 0.95)."""
    out = {}
    for runtime in {key.rsplit("-", 1)[0] for key in runs if key.endswith(("-lanes", "-serial"))}:
        lanes, serial = runs.get(f"{runtime}-lanes"), runs.get(f"{runtime}-serial")
        if not (lanes and serial):
            continue
        ratio = lanes["summary"]["total_ms"] / serial["summary"]["total_ms"]
        out[runtime] = {"step_ratio": ratio, "lanes_ms": lanes["summary"]["total_ms"],
                        "serial_ms": serial["summary"]["total_ms"]}
        print(f"\n{runtime}: lanes / serial, median step: {lanes['summary']['total_ms']:.0f} / "
              f"{serial['summary']['total_ms']:.0f} ms = {ratio:.3f} (goal <= 0.75: "
              f"{'met' if ratio <= 0.75 else 'NOT met'})")
    for key, run in runs.items():
        if run.get("sampling_alone_ratio_to_raw"):
            print(f"{key}: sampling alone through the queue {run['sampling_alone_tokens_per_s']:.0f} tok/s = "
                  f"{run['sampling_alone_ratio_to_raw']:.3f} x raw vLLM (goal >= 0.95)")
    return out or None


def ray_comparison(runs: dict) -> dict | None:
    """The Ray worker's step against the in-process worker's (issue 15 item 5: ratio <= 1.1), where both ran."""
    if not {"torch", "ray"} <= set(runs):
        return None
    torch_run, ray_run = runs["torch"]["summary"], runs["ray"]["summary"]
    ratio = ray_run["total_ms"] / torch_run["total_ms"]
    phases = {p: ray_run["phase_ms"][p] / torch_run["phase_ms"][p] for p in PHASES if torch_run["phase_ms"][p] > 0}
    print(f"\nRay worker / in-process worker, median step: {ray_run['total_ms']:.0f} / {torch_run['total_ms']:.0f} ms "
          f"= {ratio:.3f} (goal <= 1.1: {'met' if ratio <= 1.1 else 'NOT met'}); by phase: "
          + ", ".join(f"{p} {r:.2f}" for p, r in phases.items()))
    return {"step_ratio": ratio, "phase_ratios": phases}


if __name__ == "__main__":
    main()
