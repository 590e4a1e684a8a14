"""Tinker's loss functions against hand-computed values on a tiny batch."""

import math

import pytest
import torch

from worker.torch_runtime.losses import elementwise_loss

P = torch.tensor([-1.0, -2.0, -0.5])  # current model's target logprobs
Q = torch.tensor([-1.0, -1.0, -1.0])  # sampler's logprobs
A = torch.tensor([0.0, -1.0, 2.0])  # advantages (0 masks the prompt position)


def total(name, **config):
    inputs = {"logprobs": Q, "advantages": A, "weights": torch.tensor([1.0, 0.0, 2.0])}
    return float(elementwise_loss(name, P, inputs, config).sum())


def test_cross_entropy():
    assert total("cross_entropy") == pytest.approx(-(-1.0 * 1 + -2.0 * 0 + -0.5 * 2))


def test_importance_sampling():
    expected = -(math.exp(-1 + 1) * 0 + math.exp(-2 + 1) * -1 + math.exp(-0.5 + 1) * 2)
    assert total("importance_sampling") == pytest.approx(expected)


def test_ppo_clips_with_default_and_configured_thresholds():
    r = [math.exp(p - q) for p, q in zip(P.tolist(), Q.tolist())]  # 1, e^-1, e^0.5

    def ppo(lo, hi):
        return -sum(min(ri * a, min(max(ri, lo), hi) * a) for ri, a in zip(r, A.tolist()))

    assert total("ppo") == pytest.approx(ppo(0.8, 1.2))
    assert total("ppo", clip_low_threshold=0.3, clip_high_threshold=2.0) == pytest.approx(ppo(0.3, 2.0))
    assert ppo(0.8, 1.2) != pytest.approx(ppo(0.3, 2.0))


def test_cispo_stops_the_gradient_through_the_clipped_ratio():
    r = [min(max(math.exp(p - q), 0.8), 1.2) for p, q in zip(P.tolist(), Q.tolist())]
    expected = -sum(ri * p * a for ri, p, a in zip(r, P.tolist(), A.tolist()))
    assert total("cispo") == pytest.approx(expected)
    p = P.clone().requires_grad_(True)
    elementwise_loss("cispo", p, {"logprobs": Q, "advantages": A}, {}).sum().backward()
    assert p.grad.tolist() == pytest.approx([-ri * a for ri, a in zip(r, A.tolist())])


def test_importance_sampling_gradient_is_the_policy_gradient():
    p = P.clone().requires_grad_(True)
    elementwise_loss("importance_sampling", p, {"logprobs": Q, "advantages": A}, {}).sum().backward()
    expected = [-math.exp(pi - qi) * a for pi, qi, a in zip(P.tolist(), Q.tolist(), A.tolist())]
    assert p.grad.tolist() == pytest.approx(expected)


def test_missing_inputs_name_themselves():
    with pytest.raises(KeyError, match="advantages"):
        elementwise_loss("ppo", P, {"logprobs": Q}, {})
