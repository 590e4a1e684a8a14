"""What the Ray runtime's tests share: the tiny float32 setup both runtimes are built from, the requests of a step,
and the comparisons against the in-process runtime."""

import os
import signal
import threading

import ray
import torch

from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import RuntimeConfig

BASE = "tinyq-micro"
TOLERANCE = 1e-5
# 20 tokens a pass: the 8 datums of a step make 4 micro-batches, 2 per rank (a run of several on each rank)
MICRO_BATCH_TOKENS = 20
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]


def config(root, **extra) -> RuntimeConfig:
    # One torch thread everywhere: CPU kernels split their sums over threads, so the in-process runtime and the
    # actors compute bitwise alike only at equal thread counts (Ray gives each actor 1).
    return RuntimeConfig(runtime=extra.pop("runtime", "torch"), engine=extra.pop("engine", "torch"), device="cpu",
                         dtype="float32", checkpoint_root=str(root), max_snapshots=3,
                         train_micro_batch_tokens=MICRO_BATCH_TOKENS, torch_threads=1, **extra)


def create(rt, model_id: str) -> None:
    rt.execute(CreateModelRequest(model_id=model_id, base_model=BASE, lora=LoraConfig(rank=4, seed=3,
                                                                                      train_unembed=True)))


def requests(model_id: str, version: int) -> list[SampleRequest]:
    return [SampleRequest(model_id=model_id, prompt_tokens=p, weights_version=version, num_samples=2,
                          prompt_logprobs=True,
                          sampling_params=SamplingParams(max_tokens=6, seed=100 + i, temperature=1.0))
            for i, p in enumerate(PROMPTS)]


def datum(prompt, completion, advantage) -> Datum:
    full = prompt + completion
    n = len(full) - 1
    return Datum(model_input=full[:-1], loss_fn_inputs={
        "target_tokens": [float(t) for t in full[1:]], "logprobs": [0.0] * n,
        "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(completion)})


def step(rt, model_id: str, outputs: list[SampleOutput], version: int):
    data = [datum(p, s.tokens, 1.0 if k == 0 else -0.5)
            for p, out in zip(PROMPTS, outputs) for k, s in enumerate(out.sequences)]
    fb = rt.execute(ForwardBackwardRequest(model_id=model_id, data=data, loss_fn="importance_sampling"))
    opt = rt.execute(OptimStepRequest(model_id=model_id, adam_params=AdamParams(learning_rate=0.05)))
    rt.execute(WeightSyncRequest(model_id=model_id, version=version + 1))
    return fb, opt


def adapter(rt, model_id: str) -> dict[str, torch.Tensor]:
    ranks = getattr(rt.trainer, "ranks", None)
    if ranks is None:
        return rt.trainer.export_weights(model_id).tensors
    return ray.get(ranks[0].export_weights.remote(model_id)).tensors


def close(a: list[float], b: list[float]) -> bool:
    """Equal to 1e-5, relative beyond magnitude 1. For samples only: the PyTorch engine's logprobs depend on which
    requests share its batch (the batch's shapes change the kernels' float32 sums; in one process too: the same
    requests served as two half batches move by ~4e-6), and a replica serves part of the batch the in-process
    engine does; the same on equal weights (version 0) as after steps, since the trainers' adapters are equal
    bit for bit."""
    return len(a) == len(b) and all(abs(x - y) <= TOLERANCE * max(1.0, abs(x)) for x, y in zip(a, b))


def same_adapter(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def steps_through_a_kill(local, distributed, steps: list[tuple[ForwardBackwardRequest, OptimStepRequest]],
                         pid: int) -> None:
    """Each (forward_backward, optim_step) on both runtimes, the process `pid` SIGKILLed as the first forward_backward
    starts: every answer (outputs, loss, the step's metrics) and the adapter after each step as in process."""
    model = steps[0][0].model_id
    for k, (fb, opt) in enumerate(steps):
        expected = local.execute(fb), local.execute(opt)
        outcome: dict = {}
        call = threading.Thread(target=lambda outcome=outcome, fb=fb: outcome.update(fb=distributed.execute(fb)))
        call.start()
        if k == 0:
            os.kill(pid, signal.SIGKILL)
        call.join(timeout=300)
        assert not call.is_alive() and "fb" in outcome
        assert (outcome["fb"], distributed.execute(opt)) == expected
        assert same_adapter(adapter(local, model), adapter(distributed, model))
