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
