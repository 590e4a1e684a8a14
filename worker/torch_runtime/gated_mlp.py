"""The SiLU-gated MLP of Llama-style layers inside the trainer's forward: down_proj(SiLU(gate) x up).

Two things change from HF's code, for the duration of a trainer call only (the sampler keeps HF's):
  * where fused kernels are on, SiLU(gate) x up is Liger's one kernel (`fused_kernels.swiglu`), else torch's two
    ops, HF's own computation;
  * in a layer kept whole (not checkpointed), the product handed to down_proj is not kept for the backward:
    its LoRA needs it for A's gradient, and the product is an intermediate-size tensor per token (a quarter of
    what such a layer keeps with Liger's kernels), remade from gate and up, which the SwiGLU's own backward
    keeps anyway. One elementwise pass more in the backward buys that memory, and with it more layers kept
    whole under the same activation budget.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partialmethod

import torch

from worker.torch_runtime.activation_checkpointing import recomputed_when_saved
from worker.torch_runtime.fused_kernels import family_class, patched, swiglu as fused_swiglu

REMAKE = "_tinkerq_remake_product"  # set on the MLPs of the layers kept whole, for the duration


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _forward(self: torch.nn.Module, x: torch.Tensor,
             swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    product = swiglu(gate, up)
    remake = getattr(self, REMAKE, False) and torch.is_grad_enabled()
    with recomputed_when_saved(product, lambda: swiglu(gate, up)) if remake else nullcontext():
        return self.down_proj(product)


@contextmanager
def gated_mlp(model: torch.nn.Module, fused: bool) -> Iterator[None]:
    """The model's MLP class computes as above for the duration, where it is SiLU-gated and of a known family."""
    mlp = family_class(model, "MLP")
    gated = mlp is not None and getattr(model.config, "hidden_act", None) in ("silu", "swish")
    forward = partialmethod(_forward, swiglu=fused_swiglu if fused else plain_swiglu)
    with patched([(mlp, "forward", forward)] if gated else []):
        yield


@contextmanager
def products_remade(layers: list[torch.nn.Module], enabled: bool = True) -> Iterator[None]:
    """The given (whole) layers' MLPs remake their SwiGLU product in the backward, for the duration."""
    mlps = [m for m in (getattr(layer, "mlp", None) for layer in layers) if m is not None] if enabled else []
    for m in mlps:
        setattr(m, REMAKE, True)
    try:
        yield
    finally:
        for m in mlps:
            setattr(m, REMAKE, False)
