"""Target-token logprobs through the unembedding, chunked over tokens: full-vocabulary logits never exist whole.

`target_logprobs(hidden, head, targets, chunk_tokens)` equals
`log_softmax(lm_head(hidden).float(), -1).gather(-1, targets)`, the lm_head's LoRA (peft's, when the active
adapter has one there) applied inside. The forward keeps nothing per chunk but the target logprob; the
backward recomputes each chunk's logits and turns them straight into the gradients of the hidden states and
of the LoRA A and B, so memory is O(chunk x vocab) whatever the batch and the frozen base weight gets no
gradient. Logits stay in the model's dtype (as the sampler's are) and the softmax runs in float32, row by row in
one Triton kernel per pass on CUDA (`softmax_kernels`; the gradient written over the recomputed logits).

Why not Liger-Kernel's fused linear cross-entropy: it computes the gradients inside its forward and its backward
multiplies them by `grad_output` as one scalar (element_mul_kernel loads a single value), so with reduction="none"
per-token upstream gradients from an RL loss (advantages, ratios, sequence-level terms) come out wrong; and it
takes one weight matrix, so a LoRA'd lm_head would need the merged weight and a full vocab x hidden weight
gradient to get A's and B's. Here the loss is applied between the two passes, whatever it is.
"""

from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer
from torch.autograd.function import FunctionCtx

from worker.torch_runtime.softmax_kernels import softmax_grad_, target_logprobs_lse


@dataclass(frozen=True)
class Head:
    weight: torch.Tensor  # [V, d], frozen
    bias: torch.Tensor | None
    lora_a: torch.Tensor | None  # [r, d]
    lora_b: torch.Tensor | None  # [V, r]
    scale: float


def head_of(module: torch.nn.Module, adapter: str) -> Head:
    """The unembedding as the active adapter sees it: a plain Linear or peft's LoRA Linear."""
    if not isinstance(module, LoraLayer):
        return Head(module.weight, module.bias, None, None, 0.0)
    base = module.get_base_layer()
    if module.merged:
        raise ValueError("the unembedding has a merged adapter; the trainer keeps adapters unmerged")
    if module.disable_adapters or adapter not in module.lora_A or adapter not in module.active_adapters:
        return Head(base.weight, base.bias, None, None, 0.0)
    if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
        raise NotImplementedError("LoRA variants (DoRA, ...) on the unembedding are not supported")
    return Head(base.weight, base.bias, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                float(module.scaling[adapter]))


def chunk_tokens(vocab: int, chunk_elements: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about chunk_elements values."""
    return max(16, chunk_elements // vocab)


def target_logprobs(hidden: torch.Tensor, head: Head, targets: torch.Tensor, chunk: int,
                    kernels: bool = True) -> torch.Tensor:
    """hidden [n, d], targets [n] -> float32 [n]; `kernels`: the softmax passes in Triton where they can be."""
    return _TargetLogprobs.apply(hidden, targets, head.weight, head.bias, head.lora_a, head.lora_b, head.scale,
                                 chunk, kernels)


def _cast(lora: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A LoRA kept in float32 over a bf16 base computes in bf16, as the decoder's LoRA layers do in the trainer
    (`lora_compute`)."""
    return None if lora is None else lora.to(dtype)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
            lora_b: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits in the dtype of h and weight (the LoRA already cast to it)."""
    logits = torch.nn.functional.linear(h, weight, bias)
    if lora_a is None:
        return logits, None
    down = h @ lora_a.t()  # [c, r]
    return logits.addmm_(down, lora_b.t(), alpha=scale), down


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scale: float,
                chunk: int, kernels: bool) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)  # kept for the backward: [n] floats instead of a second reduction per row
        ctx.lora_dtype = lora_a.dtype if lora_a is not None else None
        lora_a, lora_b = _cast(lora_a, hidden.dtype), _cast(lora_b, hidden.dtype)  # once, not once per chunk
        for s in range(0, hidden.shape[0], chunk):
            logits, _ = _logits(hidden[s: s + chunk], weight, bias, lora_a, lora_b, scale)
            out[s: s + chunk], lse[s: s + chunk] = target_logprobs_lse(logits, targets[s: s + chunk], kernels)
        ctx.save_for_backward(hidden, targets, weight, bias, lora_a, lora_b, lse)
        ctx.scale, ctx.chunk, ctx.kernels = scale, chunk, kernels
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, bias, lora_a, lora_b, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        want_h, want_a, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_a = torch.zeros(lora_a.shape, dtype=torch.float32, device=hidden.device) if want_a else None
        grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=hidden.device) if want_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s: s + chunk]
            logits, down = _logits(h, weight, bias, lora_a, lora_b, scale)
            # d logprob[t] / d logits = onehot(t) - softmax, times the upstream gradient of each token
            dlogits = softmax_grad_(logits, targets[s: s + chunk], lse[s: s + chunk], grad[s: s + chunk], ctx.kernels)
            up = dlogits @ lora_b if lora_b is not None else None  # [c, r]
            if want_h:
                gh = dlogits @ weight
                grad_h[s: s + chunk] = gh.addmm_(up, lora_a, alpha=scale) if up is not None else gh
            if want_b:
                grad_b.add_(dlogits.t() @ down, alpha=scale)
            if want_a:
                grad_a.add_(up.t() @ h, alpha=scale)
        grad_a = grad_a.to(ctx.lora_dtype) if want_a else None
        grad_b = grad_b.to(ctx.lora_dtype) if want_b else None
        return grad_h, None, None, None, grad_a, grad_b, None, None, None
