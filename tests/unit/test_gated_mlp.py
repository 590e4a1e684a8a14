"""The trainer's SiLU-gated MLP (worker/torch_runtime/gated_mlp.py) on the CPU, in float32: in a layer kept whole
the SwiGLU product handed to down_proj is not kept for the backward but remade from gate and up, and every
gradient stays what HF's own MLP gives; HF's code is back after the call. Whole trainer calls with it on are
held to the straightforward computation in test_packed_forward."""

import gc
import weakref

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

from schemas import LoraConfig
from worker.torch_runtime import gated_mlp
from worker.torch_runtime.activation_checkpointing import recomputed_when_saved
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.trainer import peft_config

PLAIN = gated_mlp.plain_swiglu


@pytest.fixture(scope="module")
def model():
    base = BaseModels("cpu", "float32").get("tinyq-micro")
    torch.manual_seed(0)
    base.add_adapter("a", peft_config(LoraConfig(rank=4)))
    with torch.no_grad():
        for n, p in base.model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.05)
                p.requires_grad_(True)
    return base.model


def run(model, remake: bool, monkeypatch) -> tuple[dict, list]:
    """One forward and backward with the trainer's MLP; the adapter's gradients, and a weak reference to each
    SwiGLU product of the forward, taken just before the backward: [alive?]."""
    products = []
    monkeypatch.setattr(gated_mlp, "plain_swiglu", lambda g, u: products.append(PLAIN(g, u)) or products[-1])
    causal = model.get_base_model()
    layers = list(causal.get_decoder().layers)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with gated_mlp.gated_mlp(causal, fused=False), gated_mlp.products_remade(layers, remake):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).sum()
        forward_products = [weakref.ref(p) for p in products[: len(layers)]]
        products.clear()
        gc.collect()
        alive = [r() is not None for r in forward_products]
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, alive


def test_whole_layers_keep_no_product_and_their_gradients_are_hfs(model, monkeypatch):
    kept, alive_kept = run(model, remake=False, monkeypatch=monkeypatch)
    remade, alive_remade = run(model, remake=True, monkeypatch=monkeypatch)
    assert all(alive_kept), "without the remake, down_proj's LoRA keeps each product for the backward"
    assert not any(alive_remade), "a whole layer kept its SwiGLU product for the backward"
    assert kept.keys() == remade.keys() and any("down_proj.lora_A" in n for n in kept)
    for name in kept:
        assert torch.equal(kept[name], remade[name]), name


def test_hfs_mlp_is_back_after_the_call(model):
    original = modeling_qwen2.Qwen2MLP.forward
    with gated_mlp.gated_mlp(model.get_base_model(), fused=False):
        assert modeling_qwen2.Qwen2MLP.forward is not original
    assert modeling_qwen2.Qwen2MLP.forward is original


def test_another_activation_keeps_hfs_mlp(model):
    original = modeling_qwen2.Qwen2MLP.forward
    model.config.hidden_act = "gelu"
    try:
        with gated_mlp.gated_mlp(model.get_base_model(), fused=False):
            assert modeling_qwen2.Qwen2MLP.forward is original
    finally:
        model.config.hidden_act = "silu"


def test_a_saved_view_is_remade_as_the_same_view_once_per_backward():
    x = torch.randn(2, 3, 4)
    w = torch.randn(5, 4, requires_grad=True)
    calls = []
    with recomputed_when_saved(x, lambda: calls.append(1) or x.clone()):
        y = torch.nn.functional.linear(x, w) + torch.nn.functional.linear(x[:, 1:], w).sum()
    y.sum().backward()
    expected = torch.autograd.grad((torch.nn.functional.linear(x, w) + torch.nn.functional.linear(
        x[:, 1:], w).sum()).sum(), w)[0]
    assert torch.allclose(w.grad, expected)
    assert len(calls) == 1
