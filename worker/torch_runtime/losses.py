"""Tinker's loss functions, sum-reduced, over per-token tensors of one datum.

p = target_logprobs (the model being trained), q = `logprobs` input (the sampler's), A = advantages.
  cross_entropy:        -(p * weights).sum()
  importance_sampling:  -(exp(p - q) * A).sum()
  ppo:                  -(min(r * A, clip(r, lo, hi) * A)).sum(),   r = exp(p - q)
  cispo:                -(sg(clip(r, lo, hi)) * p * A).sum()
"""

from collections.abc import Callable

import torch

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]

DEFAULT_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def _require(inputs: Inputs, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise KeyError(f"loss_fn_inputs is missing {', '.join(missing)}")
    return [inputs[n] for n in names]


def _clip_range(config: dict[str, float]) -> tuple[float, float]:
    merged = {**DEFAULT_CLIP, **config}
    return merged["clip_low_threshold"], merged["clip_high_threshold"]


def cross_entropy(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    weights = inputs.get("weights", torch.ones_like(p))
    return -(p * weights)


def importance_sampling(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    return -(torch.exp(p - q) * advantages)


def ppo(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    low, high = _clip_range(config)
    ratio = torch.exp(p - q)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def cispo(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    low, high = _clip_range(config)
    ratio = torch.clamp(torch.exp(p - q), low, high).detach()
    return -(ratio * p * advantages)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}


def elementwise_loss(name: str, p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """Per-token loss of one datum; the request's loss is the sum over tokens and datums."""
    return LOSSES[name](p, inputs, config)
