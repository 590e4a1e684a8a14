"""A small RL loop through the queue, in the style of Tinker's basic RL recipe.

Task: make a tiny random model speak in words. Reward = fraction of a completion's tokens that are
alphabetic words (about a fifth of the vocabulary at the start). Each step: sample G completions
for each of P prompts from the current weights, advantage = reward - group mean, forward_backward
with importance_sampling, optim_step, transient weight sync; the next samples see the new weights.
"""

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm
from transformers import AutoTokenizer

from commands.demo import wait_ok
from producer import Producer
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
from tinkerq.local_models import corpus, resolve

PROMPTS, GROUP, MAX_TOKENS = 8, 8, 12
LEARNING_RATE = 1e-2


@dataclass
class History:
    rewards: list[float] = field(default_factory=list)
    sync_ms: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def build_datums(prompt: list[int], output: SampleOutput, rewards: list[float]) -> list[Datum]:
    mean = statistics.fmean(rewards)
    data = []
    for seq, reward in zip(output.sequences, rewards):
        full = prompt + seq.tokens
        pad = [0.0] * (len(prompt) - 1)  # prompt positions: no advantage, so no gradient
        data.append(Datum(model_input=full[:-1], loss_fn_inputs={
            "target_tokens": [float(t) for t in full[1:]],
            "logprobs": pad + seq.logprobs,
            "advantages": pad + [reward - mean] * len(seq.tokens),
        }))
    return data


def rl_loop(producer: Producer, base_model: str, steps: int, workdir: Path, seed: int = 0) -> History:
    tokenizer = AutoTokenizer.from_pretrained(resolve(base_model))
    is_word = [tokenizer.decode([i]).strip().isalpha() for i in range(len(tokenizer))]
    model = f"demo-{int(time.time())}:train:0"
    wait_ok(producer, producer.submit(CreateModelRequest(
        model_id=model, base_model=base_model, lora=LoraConfig(rank=16, seed=seed))).request_id)
    rng, lines = random.Random(seed), corpus(seed + 1, 500)
    history = History()
    bar = tqdm(range(steps), desc="RL steps", unit="step")
    for step in bar:
        started = time.monotonic()
        prompts = [tokenizer(rng.choice(lines))["input_ids"][:8] for _ in range(PROMPTS)]
        tickets = [producer.submit(SampleRequest(model_id=model, prompt_tokens=p, num_samples=GROUP,
                                                 sampling_params=SamplingParams(max_tokens=MAX_TOKENS)))
                   for p in prompts]
        data, rewards = [], []
        for prompt, ticket in zip(prompts, tickets):
            output = wait_ok(producer, ticket.request_id)
            group = [sum(is_word[t] for t in s.tokens) / len(s.tokens) for s in output.sequences]
            rewards += group
            data += build_datums(prompt, output, group)
        fb = producer.submit(ForwardBackwardRequest(model_id=model, seq_id=2 * step + 1, data=data,
                                                    loss_fn="importance_sampling"))
        optim = producer.submit(OptimStepRequest(model_id=model, seq_id=2 * step + 2,
                                                 adam_params=AdamParams(learning_rate=LEARNING_RATE)))
        sync = producer.submit(WeightSyncRequest(model_id=model))
        wait_ok(producer, fb.request_id)
        wait_ok(producer, optim.request_id)
        optim_done = time.monotonic()
        wait_ok(producer, sync.request_id)
        history.sync_ms.append((time.monotonic() - optim_done) * 1000)
        history.rewards.append(statistics.fmean(rewards))
        history.step_s.append(time.monotonic() - started)
        bar.set_postfix(reward=f"{history.rewards[-1]:.3f}", sync_ms=f"{history.sync_ms[-1]:.1f}")
        tqdm.write(f"step {step:3d}  mean reward {history.rewards[-1]:.3f}  "
                   f"sync {history.sync_ms[-1]:6.1f} ms  step {history.step_s[-1]:.2f} s")
    report(history, workdir)
    return history


def report(history: History, workdir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(history.rewards, marker="o")
    left.set(title="mean reward per step", xlabel="step", ylabel="fraction of word tokens", ylim=(0, 1.05))
    right.plot(history.sync_ms, marker=".", color="tab:orange")
    right.set(title="transient weight sync latency", xlabel="step", ylabel="ms")
    fig.tight_layout()
    path = workdir / "reward_curve.png"
    fig.savefig(path, dpi=100)
    head, tail = history.rewards[:3], history.rewards[-3:]
    print(f"mean reward: first 3 steps {statistics.fmean(head):.3f} -> last 3 steps {statistics.fmean(tail):.3f}")
    print(f"median transient sync latency: {statistics.median(history.sync_ms):.1f} ms")
    print(f"reward curve: {path}")
