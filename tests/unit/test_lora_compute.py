"""The trainer's LoRA layers over a bf16 base (worker/torch_runtime/lora_compute.py), on the CPU: with the
adapter's A and B cast to bf16 once a pass (ComputeCopies) every output and every float32 master gradient is
bit for bit what casting inside each layer gives, over several micro-batches and checkpointed layers, in far fewer
casts; a failed call leaves no gradient behind either way."""

import tempfile
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from schemas import CreateModelRequest, Datum, ForwardBackwardRequest, LoraConfig
from worker.runtime.base import DomainError
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.packed_forward import TrainOptions
from worker.torch_runtime.trainer import TorchTrainer

MODEL = "lean-bf16:train:0"


@pytest.fixture(scope="module")
def trainer():
    trainer = TorchTrainer(BaseModels("cpu", "bfloat16"), Path(tempfile.mkdtemp(prefix="lora-compute-")))
    trainer.create_model(CreateModelRequest(model_id=MODEL, base_model="tinyq-micro", lora=LoraConfig(rank=4, seed=0)))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in params(trainer):
            p.normal_(0.0, 0.05)
    assert all(p.dtype == torch.float32 for p in params(trainer))  # peft's float32 masters over the bf16 base
    return trainer


def params(trainer):
    return trainer.models[MODEL].optimizer.param_groups[0]["params"]


def request(advantages: bool = True) -> ForwardBackwardRequest:
    g = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 14, 3, 20):
        tokens = torch.randint(0, 2048, (n + 1,), generator=g).tolist()
        inputs = {"target_tokens": [float(t) for t in tokens[1:]], "logprobs": [-3.0] * n}
        if advantages:
            inputs["advantages"] = torch.randn(n, generator=g).tolist()
        data.append(Datum(model_input=tokens[:-1], loss_fn_inputs=inputs))
    return ForwardBackwardRequest(model_id=MODEL, data=data, loss_fn="importance_sampling")


def run(trainer, copies: bool, budget: float):
    trainer.options = TrainOptions(micro_batch_tokens=24, activation_budget_bytes=budget, lora_copies=copies)
    for p in params(trainer):
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = trainer.forward(request(), True)
    casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    grads = [p.grad.clone() for p in params(trainer)]
    return out, grads, casts


@pytest.mark.parametrize("budget", [float("inf"), 0])
def test_copies_give_the_same_bits_in_fewer_casts(trainer, budget):
    out_plain, grads_plain, casts_plain = run(trainer, False, budget)
    out_copies, grads_copies, casts_copies = run(trainer, True, budget)
    assert out_copies == out_plain  # per-token outputs (arrays: same dtype and values) and metrics
    for a, b in zip(grads_copies, grads_plain, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    lean_layers = 7 * trainer.models[MODEL].base.model.config.num_hidden_layers  # attention + MLP
    passes = 3
    # casting in each layer is A and B in every pass's forward (and again in the backward): all but the copies' own
    assert casts_plain - casts_copies >= 2 * lean_layers * passes - 3 * passes, (casts_copies, casts_plain)


def test_a_failed_call_leaves_the_earlier_gradients(trainer):
    trainer.options = TrainOptions(micro_batch_tokens=24)
    for p in params(trainer):
        p.grad = None
    trainer.forward(request(), True)
    before = [p.grad.clone() for p in params(trainer)]
    bad = request()
    del bad.data[-1].loss_fn_inputs["advantages"]  # alone in the last of three passes
    with pytest.raises(DomainError, match="advantages"):
        trainer.forward(bad, True)
    for p, b in zip(params(trainer), before):
        assert torch.equal(p.grad, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
def test_the_written_out_backward_is_autograds(bias, x_grad):
    """`_LoraLinear` (the update added in place, its backward by hand) against autograd through the plain expression,
    in float64: outputs and the gradients of x, A and B, with and without a bias and a gradient for x."""
    from worker.torch_runtime.lora_compute import _LoraLinear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 6, generator=g, dtype=torch.float64), torch.randn(5, 6, generator=g, dtype=torch.float64)
    b0 = torch.randn(5, generator=g, dtype=torch.float64) if bias else None
    a, b = (torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64))
    upstream = torch.randn(13, 5, generator=g, dtype=torch.float64)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(t is not x or x_grad) for t in (x, a, b)]
        out = fn(leaves[0], leaves[1], leaves[2])
        out.backward(upstream)
        return out.detach(), [t.grad for t in leaves]

    ours, ours_grads = grads(lambda x_, a_, b_: _LoraLinear.apply(x_, w, b0, a_, b_, 0.75))
    plain, plain_grads = grads(lambda x_, a_, b_: torch.nn.functional.linear(x_, w, b0) + 0.75 * (x_ @ a_.t()) @ b_.t())
    torch.testing.assert_close(ours, plain)
    for mine, theirs in zip(ours_grads, plain_grads, strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            torch.testing.assert_close(mine, theirs)
