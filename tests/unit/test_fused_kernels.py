"""Liger's kernels go into the trainer's forward only on CUDA, only for the model families whose layers they
replace, and only for the duration of a trainer call (worker/torch_runtime/fused_kernels.py). Their numbers are
checked on the GPU by bench/gpu_trainer.py (against the plain peft model, datum by datum); here, that the CPU
path stays the plain, exact one and the patching leaves nothing behind."""

import torch
from transformers.models.qwen2 import modeling_qwen2

from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.fused_kernels import _patches, available, fused_kernels
from worker.torch_runtime.packed_forward import TrainOptions


def qwen2():
    return BaseModels("cpu", "float32").get("tinyq-micro").model


def test_the_cpu_path_never_fuses():
    assert not available(torch.device("cpu"))
    assert TrainOptions.for_device(torch.device("cpu")).fused_kernels is False


def test_a_qwen2_model_gets_its_norm_and_rotary_replaced_for_the_call_only():
    model = qwen2()
    originals = (modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.apply_rotary_pos_emb)
    targets = {(owner, name) for owner, name, _ in _patches(model)}
    assert targets == {(modeling_qwen2.Qwen2RMSNorm, "forward"), (modeling_qwen2, "apply_rotary_pos_emb")}
    with fused_kernels(model, enabled=True):
        assert modeling_qwen2.Qwen2RMSNorm.forward is not originals[0]
        assert modeling_qwen2.apply_rotary_pos_emb is not originals[1]
    assert (modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.apply_rotary_pos_emb) == originals
    with fused_kernels(model, enabled=False):
        assert (modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.apply_rotary_pos_emb) == originals


def test_another_family_is_left_alone():
    model = qwen2()
    model.config.model_type = "gpt2"
    assert _patches(model) == []


def test_the_replacement_norm_computes_hfs_rms_norm():
    """The RMSNorm the fused path puts in (torch's F.rms_norm; its CUDA kernel is timed by bench/gpu_trainer.py)
    against Qwen2RMSNorm's own forward, in float32 on the CPU: the output and the input's gradient."""
    from worker.torch_runtime.fused_kernels import _rms_norm_forward

    norm = modeling_qwen2.Qwen2RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    norm.weight.requires_grad_(False)  # frozen, as the trainer's base
    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    upstream = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(1))
    results = []
    for forward in (modeling_qwen2.Qwen2RMSNorm.forward, _rms_norm_forward):
        leaf = x.clone().requires_grad_()
        out = forward(norm, leaf)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad))
    (hf_out, hf_grad), (ours_out, ours_grad) = results
    torch.testing.assert_close(ours_out, hf_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grad, hf_grad, rtol=0, atol=1e-5)
