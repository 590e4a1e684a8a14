"""Causal attention over packed sequences (one row, boundaries in `cu_seq_lens_q`), as a transformers attention.

On CUDA in bfloat16/float16 it is PyTorch's own flash-attention varlen kernel (`aten._flash_attention_forward`,
differentiable, GQA native), which skips the cross-sequence blocks entirely; anywhere else (the CPU, float32,
sliding-window layers) it is SDPA once per sequence: exact and simple. transformers calls it for every layer
while `packed(config)` is in force; the sampler keeps the model's own implementation.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig

NAME = "tinkerq_packed"
log = logging.getLogger(__name__)
_flash_failed = False


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, n, D], key/value [1, Hkv, n, D] -> ([1, n, H, D], None)."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    if _flash_usable(query, sliding_window):
        try:
            return _flash(query, key, value, cu, max_len, scaling), None
        except RuntimeError as exc:  # an unsupported head size or GPU: fall back for good, once
            _flash_off(exc)
    return _per_sequence(query, key, value, cu, scaling, sliding_window), None


def _flash_usable(query: torch.Tensor, sliding_window: int | None) -> bool:
    return (not _flash_failed and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and sliding_window is None)


def _flash_off(exc: Exception) -> None:
    global _flash_failed
    _flash_failed = True
    log.warning("flash varlen attention unavailable (%s); using SDPA per sequence", exc)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int,
           scaling: float | None) -> torch.Tensor:
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [n, heads, D]
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                  scale=scaling)[0]
    return out[None]


def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scaling: float | None,
                  sliding_window: int | None) -> torch.Tensor:
    bounds = cu.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        mask = None
        if sliding_window is not None:  # as transformers' sliding mask: key j seen from query i iff i - w < j <= i
            i = torch.arange(e - s, device=query.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True))
    return torch.cat(outs, dim=2).transpose(1, 2)


AttentionInterface.register(NAME, packed_attention)


@contextmanager
def packed(config: PretrainedConfig) -> Iterator[None]:
    """Route the model's attention here (and skip its mask building: no mask is needed) for a packed call."""
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
