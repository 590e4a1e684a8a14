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
    # Tinker's default CISPO clip is one-sided (tutorial 202: {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0})
    r = [min(max(math.exp(p - q), 0.0), 4.0) for p, q in zip(P.tolist(), Q.tolist())]
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


def grad_of(name, inputs, config, p=P):
    p = p.clone().requires_grad_(True)
    elementwise_loss(name, p, inputs, config).sum().backward()
    return p.grad.tolist()


def test_dro_is_the_advantage_term_minus_a_quadratic_pull_to_the_sampler():
    beta = 0.3
    expected = -sum(p * a - 0.5 * beta * (p - q) ** 2 for p, q, a in zip(P.tolist(), Q.tolist(), A.tolist()))
    assert total("dro", beta=beta) == pytest.approx(expected)
    grads = grad_of("dro", {"logprobs": Q, "advantages": A}, {"beta": beta})
    assert grads == pytest.approx([-(a - beta * (p - q)) for p, q, a in zip(P.tolist(), Q.tolist(), A.tolist())])
    with pytest.raises(KeyError, match="beta"):
        total("dro")


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    mask = torch.tensor([0.0, 1.0, 1.0])
    inputs = {"logprobs": Q, "advantages": A, "sequence_ratio_mask": mask}
    in_ratio = [(p - q) for p, q, m in zip(P.tolist(), Q.tolist(), mask.tolist()) if m]
    s = math.exp(sum(in_ratio) / len(in_ratio))  # exp(mean log-ratio over the masked tokens) = e^-0.25

    def expected(lo, hi):
        clipped = min(max(s, lo), hi)
        return -sum(min(s * a, clipped * a) for a in A.tolist())

    wide = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    assert float(elementwise_loss("gspo", P, inputs, wide).sum()) == pytest.approx(expected(0.1, 10.0))
    assert float(elementwise_loss("gspo", P, inputs, {}).sum()) == pytest.approx(expected(1 - 3e-4, 1 + 4e-4))
    # unclipped: d/dp_t = -s * A_t (the sequence's ratio, times the token's own score); clipped at a loss: 0
    assert grad_of("gspo", inputs, wide) == pytest.approx([-s * a for a in A.tolist()])
    defaults = grad_of("gspo", inputs, {})
    # s < 1 - 3e-4: where A < 0 the pessimistic min takes the (constant) clipped term, where A > 0 the ratio
    assert defaults == pytest.approx([0.0, 0.0, -s * 2.0])
    with pytest.raises(KeyError, match="sequence_ratio_mask"):
        elementwise_loss("gspo", P, {"logprobs": Q, "advantages": A}, {})


def test_stable_reinforce_weights_sampled_tokens_by_the_truncated_ratio_to_the_recorded_sampler():
    from worker.torch_runtime.losses import STABLE_LOGPROBS, STABLE_MASK

    recorded = torch.tensor([0.0, -3.0, -0.2])  # the sampler's own logprobs, recorded at sampling time
    mask = torch.tensor([0.0, 1.0, 1.0])  # position 0 is a prompt token
    inputs = {"advantages": A, STABLE_MASK: mask, STABLE_LOGPROBS: recorded}
    kl, cap = 0.5, 2.0

    def expected_terms():
        for p, q, a, m in zip(P.tolist(), recorded.tolist(), A.tolist(), mask.tolist()):
            w = min(math.exp(p - q), cap)
            yield m, w, p, q, a

    value = -sum(m * (w * a * p - 0.5 * kl * (p - q) ** 2) for m, w, p, q, a in expected_terms())
    assert float(elementwise_loss("stable_reinforce", P, inputs, {"kl_coeff": kl}).sum()) == pytest.approx(value)
    grads = grad_of("stable_reinforce", inputs, {"kl_coeff": kl})
    assert grads == pytest.approx([-m * (w * a - kl * (p - q)) for m, w, p, q, a in expected_terms()])
    assert math.exp(P[1] - recorded[1]) > cap  # the truncation is exercised
    with pytest.raises(KeyError, match="provenance"):
        elementwise_loss("stable_reinforce", P, {"advantages": A}, {})
