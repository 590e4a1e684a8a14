"""forward_backward on a GPU: `TorchTrainer.forward(backward=True)` against a plain HF + peft step, same run.

    python bench/gpu_trainer.py [--models randq-0.5b,randq-1.5b,qwen3-8b-shape] [--repeats 4] [--variants ...]

Random bf16 weights, built on the GPU from a config (no download): `randq-0.5b` / `randq-1.5b` in the shapes
`tinkerq.local_models` gives them (Qwen2.5-0.5B / -1.5B), `qwen3-8b-shape` in Qwen3-8B's. LoRA rank 32 on
attention, MLP and unembedding (B randomised, so every adapter tensor has a gradient), `cross_entropy`.
  * ours: `TorchTrainer.forward(request, backward=True)`, outputs to Python lists included;
  * plain: the same peft model and adapter, a padded batch, `model(input_ids, attention_mask).logits.float()`,
    `F.cross_entropy(..., reduction="sum")`, `backward()`.
Median of --repeats calls after one warm-up; peak = torch.cuda.max_memory_allocated over those calls (weights
included). MFU = (forward + backward through activations, each costing the forward's FLOPs: every linear
layer and lm_head, 2 FLOPs per weight per token, plus causal attention) / time / 790 TFLOP/s (a bf16 8192^3
matmul on the H200). Exactness (bf16): ours and the plain padded step against each datum alone through the
plain step (straightforward), logprobs and adapter gradients. Prints a table, writes JSON and a PNG.
"""

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from schemas import CreateModelRequest, Datum, ForwardBackwardRequest, LoraConfig  # noqa: E402
from tinkerq.local_models import LOCAL_MODELS  # noqa: E402
from worker.torch_runtime.activation_checkpointing import layer_bytes_per_token, layers_to_checkpoint  # noqa: E402
from worker.torch_runtime.base_models import BaseModels, LoadedBase  # noqa: E402
from worker.torch_runtime.packed_forward import TrainOptions, layer_bytes_key  # noqa: E402
from worker.torch_runtime.trainer import TorchTrainer  # noqa: E402

PEAK_FLOPS = 790e12
DEVICE = torch.device("cuda")  # --device cpu: a dry run of the bench itself on a tiny model
SHAPES = {  # name -> datum lengths
    "16x512": [512] * 16, "64x256": [256] * 64, "8x2048": [2048] * 8,
    "ragged16k": None,  # uneven lengths 64..2048 summing to 16,384 (filled in by ragged())
    "8k": [2048] * 4, "16k": [2048] * 8, "32k": [2048] * 16,
}
MODEL_SHAPES = {"tinyq-micro": ["16x512"], "randq-0.5b": ["16x512", "64x256", "8x2048", "ragged16k"],
                "randq-1.5b": ["16x512", "64x256", "8x2048", "ragged16k"],
                "qwen3-8b-shape": ["8k", "16k", "32k"]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def ragged(total: int = 16384, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(64, 2049, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < 1:
        lengths.pop()
    return lengths


def config_of(name: str):
    from transformers import Qwen2Config, Qwen3Config

    if name == "qwen3-8b-shape":  # Qwen3-8B's config.json, less the weights
        return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    s = LOCAL_MODELS[name]
    return Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate,
                       max_position_embeddings=s.context, tie_word_embeddings=s.tie_embeddings)


def random_base(name: str, device: torch.device) -> LoadedBase:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config_of(name))
    finally:
        torch.set_default_dtype(previous)
    return LoadedBase(name, Path("/nonexistent"), None, model.eval(), device)


def flops(config, lengths: list[int]) -> float:
    """Forward + backward through activations, each the forward's FLOPs."""
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size
    linear = 2 * sum(lengths) * (layers * per_layer + config.vocab_size * d)
    attention = layers * sum(2 * q * s * (s + 1) for s in lengths)  # QK^T and PV over the causal half
    return 2 * (linear + attention)


def request_of(model_id: str, lengths: list[int], vocab: int, seed: int, loss_fn="cross_entropy", extra=None):
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
        inputs = {"target_tokens": [float(t) for t in tokens[1:]]}
        if extra:
            inputs.update(extra(n, g))
        data.append(Datum(model_input=tokens[:-1], loss_fn_inputs=inputs))
    return ForwardBackwardRequest(model_id=model_id, data=data, loss_fn=loss_fn)


def padded(request: ForwardBackwardRequest, device):
    lengths = [len(d.model_input) for d in request.data]
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    targets = torch.full_like(tokens, -100)
    for i, d in enumerate(request.data):
        tokens[i, : lengths[i]] = torch.tensor(d.model_input)
        targets[i, : lengths[i]] = torch.tensor(d.loss_fn_inputs["target_tokens"]).long()
    mask = (targets != -100).long()
    return tokens.to(device), targets.to(device), mask.to(device)


def plain_step(model, tokens, targets, mask) -> None:
    logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits.float()
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction="sum", ignore_index=-100)
    loss.backward()


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, zero) -> tuple[float, float, float]:
    """Median seconds of `repeats` calls after a warm-up, the peak GiB over them, and the warm-up's seconds (a
    compiled variant compiles there)."""
    zero()
    t0 = time.perf_counter()
    fn()
    sync()
    warmup = time.perf_counter() - t0
    times = []
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        zero()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0
    return statistics.median(times), peak, warmup


def measure(fn, repeats, zero) -> dict:
    try:
        seconds, peak, warmup = timed(fn, repeats, zero)
        return {"seconds": seconds, "peak_gib": peak, "warmup_seconds": warmup}
    except torch.OutOfMemoryError as exc:
        return {"oom": str(exc).split("\n")[0][:160]}
    except Exception as exc:  # noqa: BLE001 - a variant that fails (a compiler error) is a row, not the end of the run
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    finally:
        zero()
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


# -- exactness --------------------------------------------------------------------------------------------------

def straightforward(model, request) -> list[torch.Tensor]:
    """Each datum alone: logits in float32, log_softmax, gather; the request's loss; one backward."""
    from worker.torch_runtime import losses

    total, logprobs = 0.0, []
    for d in request.data:
        tokens = torch.as_tensor(d.model_input, device=DEVICE)[None]
        logits = model(input_ids=tokens, use_cache=False).logits.float()[0]
        p = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.loss_fn_inputs["target_tokens"],
                                                                  device=DEVICE).long()[:, None])[:, 0]
        inputs = {k: torch.tensor(v, device=DEVICE) for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        total = total + losses.elementwise_loss(request.loss_fn, p, inputs, request.loss_fn_config).sum()
        logprobs.append(p.detach().cpu())
    total.backward()
    return logprobs


def grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in params.items() if p.grad is not None}


def compare(lp, g, ref_lp, ref_g) -> dict:
    lp_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(lp, ref_lp))
    rel = max(float((g[n] - ref_g[n]).norm() / ref_g[n].norm().clamp_min(1e-30)) for n in ref_g)
    missing = sorted(set(ref_g) - set(g))
    return {"max_abs_logprob_diff": lp_diff, "max_rel_grad_diff": rel, "missing_grads": missing}


def exactness(trainer, model_id, params, zero) -> dict:
    trained = trainer.models[model_id]
    model, vocab = trained.base.model, trained.base.vocab_size
    lengths = [200, 333, 512, 97, 1]
    out = {}
    for loss_fn in ("cross_entropy", "importance_sampling"):
        def extra(n, g):
            return {"logprobs": (-5 + torch.randn(n, generator=g)).tolist(),
                    "advantages": torch.randn(n, generator=g).tolist()}

        request = request_of(model_id, lengths, vocab, seed=7, loss_fn=loss_fn, extra=extra)
        zero()
        ref_lp = straightforward(model, request)
        ref_g = grads(params)
        zero()
        result = trainer.forward(request, True)
        ours_lp = [torch.tensor(o["logprobs"]) for o in result.loss_fn_outputs]
        ours = compare(ours_lp, grads(params), ref_lp, ref_g)
        zero()
        entry = {"ours_vs_straightforward": ours}
        if loss_fn == "cross_entropy":  # the noise floor: the plain padded step against the same reference
            tokens, targets, mask = padded(request, DEVICE)
            logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
            loss = -(lp * mask).sum()
            loss.backward()
            plain_lp = [lp[i, :n].detach().cpu() for i, n in enumerate(lengths)]
            entry["plain_padded_vs_straightforward"] = compare(plain_lp, grads(params), ref_lp, ref_g)
            zero()
        out[loss_fn] = entry
        log(f"  exactness {loss_fn}: {json.dumps(entry)}")
    return out


# -- one model --------------------------------------------------------------------------------------------------

def run_model(name: str, args) -> dict:
    log(f"{name}: building random bf16 weights on the GPU")
    bases = BaseModels(str(DEVICE), "bfloat16")
    bases._loaded[name] = random_base(name, DEVICE)  # the bench builds, not from disk
    trainer = TorchTrainer(bases, Path(tempfile.mkdtemp(prefix="gpu-trainer-")))
    model_id = f"bench-{name}:train:0"
    lora = LoraConfig(rank=args.rank, seed=0)
    trainer.create_model(CreateModelRequest(model_id=model_id, base_model=name, lora=lora))
    trained = trainer.models[model_id]
    model, config = trained.base.model, trained.base.model.config
    params = {n: p for n, p in model.named_parameters() if f".{trained.adapter}." in n}
    with torch.no_grad():
        for n, p in params.items():
            if "lora_B" in n:
                p.normal_(0.0, 1e-3)

    def zero():
        for p in params.values():
            p.grad = None

    base_options = TrainOptions.for_device(DEVICE)
    rows, profiled = [], None
    exact = exactness(trainer, model_id, params, zero) if not args.no_exactness else None
    for shape in args.shapes.get(name, MODEL_SHAPES[name]):
        lengths = SHAPES[shape] or ragged()
        request = request_of(model_id, lengths, config.vocab_size, seed=1)
        work = flops(config, lengths)
        row = {"model": name, "shape": shape, "datums": len(lengths), "tokens": sum(lengths), "flops": work}
        variants = {"ours": base_options, **({} if sum(lengths) < 16384 else args.variants)}
        for label, options in variants.items():
            trainer.options = options
            result = measure(lambda request=request: trainer.forward(request, True), args.repeats, zero)
            result["checkpointed_layers"] = checkpointed_layers(trained, options, sum(lengths))
            row[label] = result
            log(f"{name} {shape} {label}: {fmt(result, row)}, {result['checkpointed_layers']} layers checkpointed")
        trainer.options = base_options
        if not args.no_plain:
            tokens, targets, mask = padded(request, DEVICE)
            row["plain"] = measure(lambda tokens=tokens, targets=targets, mask=mask:
                                   plain_step(model, tokens, targets, mask), args.repeats, zero)
            log(f"{name} {shape} plain: {fmt(row['plain'], row)}")
            del tokens, targets, mask
        if args.profile and shape == args.profile:
            profiled = {"shape": shape, **profile(trainer, request, zero,
                                                  Path(args.out) / f"{args.tag}-{name}-trace.json.gz")}
        rows.append(row)
    estimate = layer_bytes_per_token(config, torch.bfloat16)
    measured = {str(k[1:]): v for k, v in trained.base.layer_bytes.items()}
    log(f"{name}: a layer keeps {measured} bytes per token, measured by (fused, remake_swiglu, lora_function); "
        f"estimated from the shapes {estimate}")
    result = {"model": name, "params": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
              "lora_params": sum(p.numel() for p in params.values()), "exactness": exact, "rows": rows,
              "profile": profiled,
              "layer_bytes_per_token": {"measured": measured, "estimated": estimate}}
    # Dropped (not del: the closures above read them) so that the collection below frees the GPU memory.
    trainer = bases = trained = model = params = None
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return result


def checkpointed_layers(trained, options: TrainOptions, tokens: int) -> int | None:
    """How many layers the trainer checkpointed in its (first) micro-batch of this many tokens."""
    if math.isinf(options.activation_budget_bytes):
        return 0
    per_token = trained.base.layer_bytes.get(layer_bytes_key(trained.adapter, options))
    layers = trained.base.model.config.num_hidden_layers
    n = min(tokens, options.micro_batch_tokens)
    return None if per_token is None else layers_to_checkpoint(layers, n, per_token, options.activation_budget_bytes)


def cuda_ms(fn, repeats: int) -> float:
    """Mean milliseconds of fn(i) for i in range(repeats), timed with CUDA events after one warm-up call."""
    fn(0)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    begin.record()
    for i in range(repeats):
        fn(i)
    end.record()
    sync()
    return begin.elapsed_time(end) / repeats


def softmax_kernels_bench(vocab: int = 151936, rows: int = 883, repeats: int = 20) -> dict:
    """The unembedding's two softmax passes over one chunk of bf16 logits (the trainer's default chunk on a
    151,936-token vocabulary): torch's float32 path against the Triton kernels, times and agreement. The
    backward overwrites its logits: each call gets a copy made before the timing."""
    from worker.torch_runtime import softmax_kernels as sk

    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, device=DEVICE, generator=g)).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device=DEVICE, generator=g)
    upstream = torch.randn(rows, device=DEVICE, generator=g)
    runs = {}
    for name, kernels in (("torch", False), ("triton", True)):
        logprobs, lse = sk.target_logprobs_lse(logits, targets, kernels)
        copies = [logits.clone() for _ in range(repeats + 1)]
        runs[name] = {
            "forward_ms": cuda_ms(lambda i, kernels=kernels: sk.target_logprobs_lse(logits, targets, kernels), repeats),
            "backward_ms": cuda_ms(lambda i, copies=copies, lse=lse, kernels=kernels:
                                   sk.softmax_grad_(copies[i], targets, lse, upstream, kernels), repeats),
            "logprobs": logprobs, "grad": sk.softmax_grad_(logits.clone(), targets, lse, upstream, kernels)}
    torch_run, triton_run = runs["torch"], runs["triton"]
    summary = {"rows": rows, "vocab": vocab, "bytes_per_logit": {"torch (counted)": 28, "triton": 6},
               **{f"{name}_{k}": v for name, r in runs.items() for k, v in r.items() if k.endswith("_ms")},
               "max_abs_logprob_diff": float((torch_run["logprobs"] - triton_run["logprobs"]).abs().max()),
               "max_abs_grad_diff": float((torch_run["grad"].float() - triton_run["grad"].float()).abs().max())}
    log("softmax passes, " + json.dumps(summary))
    return summary


def norm_bench(width: int = 1536, rows: int = 16384, repeats: int = 20) -> dict:
    """RMSNorm forward + backward over [rows, width] bf16: Liger's Triton kernels against torch's own
    `F.rms_norm` (the trainer's, fused_kernels.py): GPU ms per call (CUDA events, many calls queued), host us per call
    (a tiny tensor, where launching is all there is), kernels per call, and the largest difference from HF's
    float32 formula."""
    from liger_kernel.transformers.functional import liger_rms_norm
    from torch.profiler import ProfilerActivity, profile as torch_profile

    g = torch.Generator(device=DEVICE).manual_seed(0)
    weight = (1 + 0.1 * torch.randn(width, device=DEVICE, generator=g)).bfloat16()
    norms = {"liger": lambda x: liger_rms_norm(x, weight, 1e-6, casting_mode="llama", in_place=False),
             "torch": lambda x: F.rms_norm(x, (width,), weight, 1e-6)}

    def step(norm, x, upstream):
        norm(x).backward(upstream)

    def hf(x):  # Qwen2RMSNorm's own computation
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    out = {}
    for name, norm in norms.items():
        x = torch.randn(rows, width, device=DEVICE, generator=g).bfloat16().requires_grad_()
        upstream = torch.randn(rows, width, device=DEVICE, generator=g).bfloat16()
        tiny = torch.randn(8, width, device=DEVICE).bfloat16().requires_grad_()
        tiny_up = torch.randn(8, width, device=DEVICE).bfloat16()
        gpu_ms = cuda_ms(lambda i, norm=norm, x=x, upstream=upstream: step(norm, x, upstream), repeats)
        step(norm, tiny, tiny_up)  # a new shape: Triton specialises (compiles) on its first call
        sync()
        t0 = time.perf_counter()
        for _ in range(200):
            step(norm, tiny, tiny_up)
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        sync()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(norm, x, upstream)
            sync()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        diff = float((norm(x.detach()).float() - hf(x.detach()).float()).abs().max())
        out[name] = {"gpu_ms": gpu_ms, "host_us": host_us, "kernels": kernels, "max_abs_diff_vs_hf": diff}
    log("rms_norm fwd+bwd, " + json.dumps(out))
    return out


def profile(trainer, request, zero, trace: Path | None = None) -> dict:
    """One call of ours under torch.profiler: the top kernels, where the GPU sat idle waiting for the CPU
    (`trace_gaps`), and any host synchronisation inside the call (CUDA's sync debug mode). `trace`: where to write
    the Chrome trace (gzipped) for a closer look."""
    import gzip
    import shutil
    import warnings

    import trace_gaps
    from torch.profiler import ProfilerActivity, profile as torch_profile

    zero()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        trainer.forward(request, True)
        sync()
    zero()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
    with tempfile.TemporaryDirectory(prefix="trace-") as scratch:
        raw = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(raw))
        gaps = trace_gaps.summary(trace_gaps.load(raw), depth=4)
        if trace is not None:
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(trace_gaps.report(gaps), flush=True)
    if DEVICE.type != "cuda":
        return {"gaps": gaps}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.forward(request, True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    zero()
    syncs = sorted({f"{w.filename}:{w.lineno} {str(w.message)[:80]}" for w in caught
                    if "synchroniz" in str(w.message)})
    log(f"host synchronisations inside one call: {len(syncs)} distinct sites" + "".join(f"\n  {s}" for s in syncs))
    return {"gaps": gaps, "sync_sites": syncs}


def fmt(result: dict, row: dict) -> str:
    if "oom" in result:
        return "OOM"
    if "error" in result:
        return result["error"]
    rate = row["tokens"] / result["seconds"]
    return (f"{rate:,.0f} tok/s, MFU {100 * row['flops'] / result['seconds'] / PEAK_FLOPS:.1f}%, "
            f"peak {result['peak_gib']:.1f} GiB, warm-up {result['warmup_seconds']:.1f} s")


def mfu(row: dict, result: dict) -> str:
    return f"{100 * row['flops'] / result['seconds'] / PEAK_FLOPS:.1f}%"


def table(models: list[dict]) -> str:
    lines = ["| model | batch | ours tok/s | MFU | peak GiB | plain tok/s | MFU | peak GiB | speed x | memory x |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in models:
        for r in m["rows"]:
            cells = [m["model"], f"{r['shape']} ({r['datums']} datums, {r['tokens']} tok)"]
            for key in ("ours", "plain"):
                res = r.get(key)
                if res is None or "oom" in res:
                    cells += ["OOM" if res else "-", "", ""]
                else:
                    cells += [f"{r['tokens'] / res['seconds']:,.0f}", mfu(r, res), f"{res['peak_gib']:.1f}"]
            ours, plain = r.get("ours", {}), r.get("plain", {})
            if "seconds" in ours and "seconds" in plain and plain["peak_gib"] > 0:
                cells += [f"{plain['seconds'] / ours['seconds']:.2f}", f"{ours['peak_gib'] / plain['peak_gib']:.2f}"]
            else:
                cells += ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
            for label, res in r.items():
                if isinstance(res, dict) and label not in ("ours", "plain") and "seconds" not in res:
                    lines.append(f"| | {label} | {res.get('error') or 'OOM'} | | | | | | | |")
                elif isinstance(res, dict) and label not in ("ours", "plain"):
                    lines.append(f"| | {label} | {r['tokens'] / res['seconds']:,.0f} | {mfu(r, res)} | "
                                 f"{res['peak_gib']:.1f} | | | | | |")
    return "\n".join(lines)


def plot(models: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m["model"], r) for m in models for r in m["rows"]]
    labels = [f"{name}\n{r['shape']}" for name, r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows)) * 2, 5))
    x = range(len(rows))
    for ax, metric, title in ((axes[0], "rate", "tokens/s"), (axes[1], "peak_gib", "peak GiB")):
        for k, (key, color) in enumerate((("ours", "tab:green"), ("plain", "tab:gray"))):
            values = []
            for _, r in rows:
                res = r.get(key, {})
                values.append(0 if "seconds" not in res else
                              (r["tokens"] / res["seconds"] if metric == "rate" else res["peak_gib"]))
            ax.bar([i + (k - 0.5) * 0.4 for i in x], values, 0.4, label=f"{key} (0 = OOM / not run)", color=color)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("forward_backward, bf16, LoRA r32 attn+MLP+unembed: TorchTrainer vs plain HF + peft")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_variants(text: str) -> dict[str, TrainOptions]:
    """'name:field=value;field=value,name2:...' over TrainOptions.for_device('cuda')."""
    out = {}
    base = TrainOptions.for_device(DEVICE)
    for item in filter(None, text.split(",")):
        label, _, fields = item.partition(":")
        changes = {}
        for field in filter(None, fields.split(";")):
            key, _, value = field.partition("=")
            changes[key] = (value == "True" if value in ("True", "False")
                            else float(value) if "." in value or value in ("inf",) or "e" in value else int(value))
        out[label] = replace(base, **changes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="randq-0.5b,randq-1.5b,qwen3-8b-shape")
    parser.add_argument("--shapes", default="", help="model=shape+shape;model=... (default: each model's own)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--variants", default="", help="extra TrainOptions at >= 16k tokens, e.g. "
                        "'budget0:activation_budget_bytes=0,mb8k:micro_batch_tokens=8192'")
    parser.add_argument("--profile", default="", help="a shape to profile ours on (torch.profiler table)")
    parser.add_argument("--no-plain", action="store_true")
    parser.add_argument("--no-exactness", action="store_true")
    parser.add_argument("--tag", default="gpu_trainer")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    args.shapes = {k: v.split("+") for k, v in (s.split("=") for s in filter(None, args.shapes.split(";")))}
    args.variants = parse_variants(args.variants)
    machine = torch.cuda.get_device_name() if DEVICE.type == "cuda" else platform.processor() or "cpu"
    print(f"{machine}, torch {torch.__version__}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = []
    kernels = softmax_kernels_bench() if DEVICE.type == "cuda" else None
    try:
        norms = norm_bench() if DEVICE.type == "cuda" else None
    except Exception as exc:  # noqa: BLE001 - a side measurement: the run goes on without it
        norms = {"error": f"{type(exc).__name__}: {exc}"}
    for name in args.models.split(","):
        models.append(run_model(name, args))
        text = table(models)
        report = {"machine": f"{platform.node()} {machine}", "torch": torch.__version__,
                  "peak_flops": PEAK_FLOPS, "options": {k: str(v) for k, v in vars(args).items()},
                  "defaults": str(TrainOptions.for_device(DEVICE)), "softmax_kernels": kernels, "rms_norm": norms,
                  "models": models,
                  "table": text}
        (out / f"{args.tag}.json").write_text(json.dumps(report, indent=2, default=str))  # after each model
    print("\n" + text, flush=True)
    plot(models, out / f"{args.tag}.png")
    log(f"wrote {out / (args.tag + '.json')} and .png")


if __name__ == "__main__":
    main()
