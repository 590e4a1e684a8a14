"""The Triton kernels behind `softmax_kernels` (imported only where Triton is installed). One program per row."""

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_kernel(logits_ptr, stride, targets_ptr, out_ptr, lse_ptr, V, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton kernel: its arguments' annotations are Triton's (constexpr)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):  # online logsumexp: a running max and the sum of exp below it
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    tl.store(out_ptr + row, tl.load(base + target).to(tl.float32) - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_kernel(logits_ptr, stride, targets_ptr, lse_ptr, g_ptr, V, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton kernel: its arguments' annotations are Triton's (constexpr)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        d = -g * tl.exp(x - lse)
        d = tl.where(cols == target, d + g, d)
        tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=cols < V)


def target_logprobs_lse(logits: torch.Tensor, targets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(out)
    _lse_kernel[(rows,)](logits, logits.stride(0), targets.contiguous(), out, lse, vocab, BLOCK=block, num_warps=8)
    return out, lse


def softmax_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                  block: int) -> torch.Tensor:
    rows, vocab = logits.shape
    _grad_kernel[(rows,)](logits, logits.stride(0), targets.contiguous(), lse.contiguous(), g, vocab, BLOCK=block,
                          num_warps=8)
    return logits
