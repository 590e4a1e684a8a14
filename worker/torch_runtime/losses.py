"""Tinker's loss functions, sum-reduced, over per-token tensors of one datum.

p = target_logprobs (the model being trained), q = `logprobs` input (the sampler's), A = advantages,
r = exp(p - q), sg = stop-gradient. Formulas as Tinker documents them (tinker-docs: losses/*):
  cross_entropy:        -(p * weights).sum()
  importance_sampling:  -(r * A).sum()
  ppo:                  -(min(r * A, clip(r, lo, hi) * A)).sum()                 lo, hi = 0.8, 1.2
  cispo:                -(sg(clip(r, lo, hi)) * p * A).sum()                     lo, hi = 0.0, 4.0 (one-sided)
  dro:                  -(p * A - beta/2 * (p - q)^2).sum()                      beta: required
  gspo (GSPO-token):    s = exp(mean over sequence_ratio_mask of sg(p) - q); s_t = sg(s) * exp(p_t - sg(p_t));
                        -(min(s_t * A, clip(s_t, lo, hi) * A)).sum()              lo, hi = 1 - 3e-4, 1 + 4e-4
  stable_reinforce:     on the tokens the datum's provenance names as sampled (mask m), with the sampler's own
                        logprobs recorded at sampling time (q*): w = sg(min(exp(p - q*), c));
                        -(m * (w * A * p - kl_coeff/2 * (p - q*)^2)).sum()         c = 2.0, kl_coeff = 0.01
Tinker documents stable_reinforce's interface (record_stability_info, sequence ids, provenance spans, kl_coeff)
but not its objective; the one above is this server's: truncated-importance-weighted REINFORCE on the
sampler's recorded logprobs plus a quadratic pull towards them. The API resolves the spans into the two
inputs it reads (STABLE_MASK, STABLE_LOGPROBS), so the datum stays self-contained in the queue.
"""

from collections.abc import Callable

import torch

from schemas.requests import STABLE_LOGPROBS, STABLE_MASK

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]


class LossConfigError(KeyError):
    """A required input or config value is missing or out of range; the message names it."""


def _require(inputs: Inputs, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise LossConfigError(f"loss_fn_inputs is missing {', '.join(missing)}")
    return [inputs[n] for n in names]


def _clip_range(config: dict[str, float], low: float, high: float) -> tuple[float, float]:
    return config.get("clip_low_threshold", low), config.get("clip_high_threshold", high)


def cross_entropy(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    weights = inputs.get("weights", torch.ones_like(p))
    return -(p * weights)


def importance_sampling(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    return -(torch.exp(p - q) * advantages)


def ppo(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    low, high = _clip_range(config, 0.8, 1.2)
    ratio = torch.exp(p - q)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def cispo(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    low, high = _clip_range(config, 0.0, 4.0)
    ratio = torch.clamp(torch.exp(p - q), low, high).detach()
    return -(ratio * p * advantages)


def dro(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages = _require(inputs, "logprobs", "advantages")
    if "beta" not in config:
        raise LossConfigError("dro needs loss_fn_config['beta'] (Tinker's docs give 0.05 as an example)")
    return -(p * advantages - 0.5 * config["beta"] * (p - q) ** 2)


def gspo(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    q, advantages, mask = _require(inputs, "logprobs", "advantages", "sequence_ratio_mask")
    low, high = _clip_range(config, 1 - 3e-4, 1 + 4e-4)
    in_ratio = mask != 0
    log_ratio = (p.detach() - q)[in_ratio].mean() if bool(in_ratio.any()) else p.new_zeros(())
    ratio = torch.exp(log_ratio + p - p.detach())  # the sequence's value, each token's own gradient
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def stable_reinforce(p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    (advantages,) = _require(inputs, "advantages")
    if STABLE_MASK not in inputs:
        raise LossConfigError("stable_reinforce needs provenance spans naming the sampled sequence behind every "
                              "position (Datum.with_provenance), from a sampler with record_stability_info")
    mask, q = inputs[STABLE_MASK], inputs[STABLE_LOGPROBS]
    cap, kl_coeff = config.get("clip_high_threshold", 2.0), config.get("kl_coeff", 0.01)
    weight = torch.clamp(torch.exp(p - q), max=cap).detach()
    return -(mask * (weight * advantages * p - 0.5 * kl_coeff * (p - q) ** 2))


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}


# the losses whose value at a token depends on that token's inputs alone (gspo's takes a mean over its sequence)
PER_TOKEN = frozenset(LOSSES) - {"gspo"}


def elementwise_loss(name: str, p: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """Per-token loss of one datum; the request's loss is the sum over tokens and datums."""
    return LOSSES[name](p, inputs, config)
