"""How peft's LoRA Linear layers compute inside the trainer's forward: in the base's dtype, the update fused.

peft computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`, and over a bf16 base it keeps the adapter in
float32 and casts x up first: per adapted layer a float32 copy of the input (kept for the backward), a float32
output, a multiply and an add over the whole output, each of them again in the backward. Inside `lean_lora()`
a layer with one plain LoRA adapter active computes `addmm(base(x), x @ A^T, B^T, alpha=scaling)` instead, with
A and B cast to x's dtype (they stay float32 masters for AdamW): one matmul epilogue instead of four passes.
Over a frozen plain Linear base that is one autograd function with its backward written out (`_LoraLinear`): the
update is added into the base's output in place, and in the backward x's gradient through the update into x's
gradient through the base, so neither pass copies or adds a whole [tokens, features] tensor for the adapter
(peft's path makes one such copy per adapted module in the forward, and one such add in the backward).
Anything else (mixed-adapter batches, DoRA and other variants, dropout, a LoRA bias) takes peft's own path.

Casting A and B inside each layer is two kernels in the forward and two in the backward per adapted module (seven
a layer), each with its autograd node: on a small model most of what the CPU issues. `ComputeCopies` casts all of an
adapter's lean layers' A and B at once, into one buffer of the compute dtype that autograd treats as a leaf, and
after the backward adds its gradient, cast back once, into the float32 masters' `.grad`: the same numbers (the
gradient of a cast is the cast gradient), two kernels for the whole adapter.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch.autograd.function import FunctionCtx

_peft_forward = LoraLinear.forward
_written_out = True  # lean_lora(written_out=...) for the duration of a call
COPIES = "_tinkerq_compute_copies"  # on a lean layer, for the duration: (adapter, A, B) in the compute dtype


def _lean_adapter(self: LoraLinear) -> str | None:
    """The one plain LoRA adapter the layer runs, where the lean path can compute it."""
    active = [a for a in self.active_adapters if a in self.lora_A]
    if self.disable_adapters or self.merged or len(active) != 1:
        return None
    name = active[0]
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    if (name in self.lora_variant or not isinstance(self.lora_dropout[name], torch.nn.Identity)
            or lora_a.bias is not None or lora_b.bias is not None):
        return None
    return name


def _lean_forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = None if args or kwargs else _lean_adapter(self)
    if name is None:
        return _peft_forward(self, x, *args, **kwargs)
    copies = getattr(self, COPIES, None)
    if copies is not None and copies[0] == name and copies[1].dtype == x.dtype:
        a, b = copies[1], copies[2]
    else:
        a, b = self.lora_A[name].weight.to(x.dtype), self.lora_B[name].weight.to(x.dtype)
    base = self.base_layer
    if not (_written_out and _frozen_linear(base)):  # a quantised, special or trained base: autograd's own
        result = base(x)
        down = torch.nn.functional.linear(x, a)
        fused = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), b.t(),
                            alpha=self.scaling[name])
        return fused.view(result.shape)
    flat = _LoraLinear.apply(x.reshape(-1, x.shape[-1]), base.weight, base.bias, a, b, self.scaling[name])
    return flat.view(*x.shape[:-1], flat.shape[-1])


def _frozen_linear(base: torch.nn.Module) -> bool:
    return (type(base) is torch.nn.Linear and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad))


class _LoraLinear(torch.autograd.Function):
    """x W^T + bias + s (x A^T) B^T over 2-d x, the base frozen, with the backward written out: the update is
    added inside the base's output (`addmm_`, no copy of it) and, in the backward, x's gradient from the update
    inside the base's (no separate add of two [tokens, in] tensors); one autograd node instead of eight."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.nn.functional.linear(x, weight, bias)  # a fresh tensor: safe to add into in place
        down = x @ a.t()  # [n, r]
        out.addmm_(down, b.t(), alpha=scale)
        ctx.save_for_backward(x, weight, a, b, down)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, a, b, down = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        up = (grad @ b).mul_(ctx.scale) if want_x or want_a else None  # [n, r]: s dL/d(down)
        grad_x = (grad @ weight).addmm_(up, a) if want_x else None
        grad_a = up.t() @ x if want_a else None
        grad_b = (grad.t() @ down).mul_(ctx.scale) if want_b else None
        return grad_x, None, None, grad_a, grad_b, None


def copied_layers(model: torch.nn.Module, adapter: str, dtype: torch.dtype,
                  skip: torch.nn.Module | None) -> list[LoraLinear]:
    """The LoRA layers whose A and B `ComputeCopies` casts: those the lean path computes for `adapter` (the active
    one) with masters not already in `dtype`. `skip`: a LoRA layer whose forward the pass does not call (the
    unembedding, computed in chunks)."""
    return [m for m in model.modules() if isinstance(m, LoraLinear) and m is not skip
            and _lean_adapter(m) == adapter and m.lora_A[adapter].weight.dtype != dtype]


class ComputeCopies:
    """One trainer pass's copies of an adapter's lean LoRA weights in `dtype` (see the module's text). Use as a
    context around the pass's forward and backward; `flush()` after each backward."""

    def __init__(self, layers: list[LoraLinear], adapter: str, dtype: torch.dtype) -> None:
        """`layers`: `copied_layers(...)` of the model (a walk over every module: the trainer keeps it)."""
        self.layers, self.adapter = layers, adapter
        self.masters = [w for m in self.layers for w in (m.lora_A[adapter].weight, m.lora_B[adapter].weight)]
        self.flat: torch.Tensor | None = None
        if self.masters:
            self.flat = torch.cat([w.detach().reshape(-1) for w in self.masters]).to(dtype)
            self.flat.requires_grad_(torch.is_grad_enabled() and any(w.requires_grad for w in self.masters))

    def __enter__(self) -> "ComputeCopies":
        if self.flat is not None:
            views = [v.view(w.shape) for v, w in zip(self.flat.split([w.numel() for w in self.masters]),
                                                     self.masters)]
            for i, layer in enumerate(self.layers):
                setattr(layer, COPIES, (self.adapter, views[2 * i], views[2 * i + 1]))
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            setattr(layer, COPIES, None)

    def flush(self) -> None:
        """The copies' gradient, cast back, added into the masters' `.grad` (set where it was None)."""
        grad = None if self.flat is None else self.flat.grad
        if grad is None:
            return
        self.flat.grad = None
        parts = [g.view(w.shape) for g, w in zip(grad.float().split([w.numel() for w in self.masters]),
                                                 self.masters)]
        held, added = [], []
        for w, g in zip(self.masters, parts):
            if w.grad is None:
                w.grad = g
            else:
                held.append(w.grad)
                added.append(g)
        if held:
            torch._foreach_add_(held, added)  # one launch for every master that had a gradient


@contextmanager
def lean_lora(written_out: bool = True) -> Iterator[None]:
    """For the duration of one trainer call (the worker runs one job at a time; the sampler is not inside).
    `written_out`: `_LoraLinear` where the base allows it (else autograd through addmm, as before it)."""
    global _written_out
    LoraLinear.forward, _written_out = _lean_forward, written_out
    try:
        yield
    finally:
        LoraLinear.forward, _written_out = _peft_forward, True
