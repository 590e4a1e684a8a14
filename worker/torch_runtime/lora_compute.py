"""How peft's LoRA Linear layers compute inside the trainer's forward: in the base's dtype, the update fused.

peft computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`, and over a bf16 base it keeps the adapter in
float32 and casts x up first: per adapted layer a float32 copy of the input (kept for the backward), a float32
output, a multiply and an add over the whole output, each of them again in the backward. Inside `lean_lora()`
a layer with one plain LoRA adapter active computes `addmm(base(x), x @ A^T, B^T, alpha=scaling)` instead, with
A and B cast to x's dtype (they stay float32 masters for AdamW): one matmul epilogue instead of four passes.
Anything else (mixed-adapter batches, DoRA and other variants, dropout, a LoRA bias) takes peft's own path.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

_peft_forward = LoraLinear.forward


def _lean_forward(self: LoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    active = [a for a in self.active_adapters if a in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1:
        return _peft_forward(self, x, *args, **kwargs)
    name = active[0]
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    if (name in self.lora_variant or not isinstance(self.lora_dropout[name], torch.nn.Identity)
            or lora_a.bias is not None or lora_b.bias is not None):
        return _peft_forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    down = torch.nn.functional.linear(x, lora_a.weight.to(x.dtype))
    fused = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]),
                        lora_b.weight.to(x.dtype).t(), alpha=self.scaling[name])
    return fused.view(result.shape)


@contextmanager
def lean_lora() -> Iterator[None]:
    """For the duration of one trainer call (the worker runs one job at a time; the sampler is not inside)."""
    LoraLinear.forward = _lean_forward
    try:
        yield
    finally:
        LoraLinear.forward = _peft_forward
