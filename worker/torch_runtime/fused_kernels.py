"""Fused kernels for the decoder's elementwise work, inside the trainer's forward on CUDA: Liger-Kernel's Triton
kernels for SwiGLU and rotary, torch's own fused RMSNorm.

HF's Llama-style layers (Qwen2, Qwen3, Llama, Mistral) compute RMSNorm as five torch ops in float32 (cast, square,
mean, rsqrt, multiply, cast back), SiLU(gate) x up as two, and rotary as four per tensor: each a pass over a
[tokens, width] tensor in the forward, again in the backward, and again in a checkpointed layer's recompute.
Each becomes one kernel, forward and backward, computing what HF computes (the inverse RMS in float32, as HF
takes it) up to bf16 rounding. The model's classes are patched for the
duration of one trainer call, as `lean_lora` patches peft's, so the sampler keeps HF's code (the MLP's patch is
`gated_mlp`'s, which takes Liger's SwiGLU from here). Where the model is not of such a family, or liger_kernel /
Triton are not installed, nothing changes: the CPU path stays the exact, plain one.
"""

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

FAMILIES = {"qwen2", "qwen3", "llama", "mistral"}


def available(device: torch.device) -> bool:
    return (device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None
            and importlib.util.find_spec("triton") is not None)


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # torch's own fused kernel, not Liger's: with the weight frozen (as LoRA keeps it), its forward + backward takes
    # a fraction of Liger's GPU time, though both skip the frozen weight's gradient; both stay within 2 bf16 ulps of
    # HF's float32 formula (bench/gpu_trainer.py, norm_bench)
    return torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up in one kernel (and one in the backward, which keeps only gate and up)."""
    from liger_kernel.transformers.functional import liger_swiglu

    return liger_swiglu(gate, up)


def _apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    from liger_kernel.transformers.functional import liger_rope

    return liger_rope(q, k, cos, sin, None, unsqueeze_dim)


@contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextmanager
def patched(owners: list[tuple[object, str, object]]) -> Iterator[None]:
    """Each (owner, attribute, replacement) set for the duration, and put back after."""
    with ExitStack() as stack:
        for owner, name, value in owners:
            stack.enter_context(_patched(owner, name, value))
        yield


def family_class(model: torch.nn.Module, suffix: str) -> type | None:
    """The model's own `<Family><suffix>` class (Qwen2RMSNorm, Qwen2MLP...) where it is of a family above."""
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return None
    module = sys.modules[type(model).__module__]  # transformers.models.<family>.modeling_<family>
    return getattr(module, type(model).__name__.removesuffix("ForCausalLM") + suffix, None)


def _patches(model: torch.nn.Module) -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for the model's family; none for another family."""
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return []
    module = sys.modules[type(model).__module__]
    patches: list[tuple[object, str, object]] = []
    norm = family_class(model, "RMSNorm")
    if norm is not None:
        patches.append((norm, "forward", _rms_norm_forward))
    if hasattr(module, "apply_rotary_pos_emb"):
        patches.append((module, "apply_rotary_pos_emb", _apply_rotary_pos_emb))
    return patches


@contextmanager
def fused_kernels(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Liger's kernels in the model's RMSNorm and rotary for the duration (a no-op unless `enabled`)."""
    with patched(_patches(model) if enabled else []):
        yield
