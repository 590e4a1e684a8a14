"""Fixes to vLLM, applied in-process before the first engine is built. Each names the upstream gap.

They patch module attributes only, so they are no-ops on a vLLM that no longer has the gap.
"""

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger(__name__)
_applied = False


def apply(on_cpu: bool) -> None:
    global _applied
    if _applied:
        return
    for patch in [_lora_on_qwen2_lm_head, _prompt_logits_lora] + ([_cpu_lora_negative_index] if on_cpu else []):
        try:
            patch()
        except (ImportError, AttributeError) as exc:  # another vLLM release moved the code: say so, go on
            log.warning("vLLM patch %s not applied: %s", patch.__name__, exc)
    _applied = True


def _lora_on_qwen2_lm_head() -> None:
    """Tinker trains the unembedding by default (train_unembed). vLLM's Llama declares lm_head as a LoRA
    module but its Qwen2 does not, so an adapter with lm_head is refused; the LoRA layer itself works."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    if "lm_head" not in getattr(Qwen2ForCausalLM, "embedding_modules", {}):
        Qwen2ForCausalLM.embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}


def _cpu_lora_negative_index() -> None:
    """CPU LoRA ops gather `weights[index]`, and "no adapter" (-1) wraps to the last slot, so a base row
    batched with an adapter in that slot silently got its weights (vLLM PRs #48421, #49656)."""
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    def fix(op: Callable) -> Callable:
        def wrapped(inputs: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, index: torch.Tensor,
                    *args: Any, **kwargs: Any) -> Any:
            negative = index < 0
            if not bool(negative.any()):
                return op(inputs, weights, out, index, *args, **kwargs)
            if inputs.shape[0] == negative.shape[0]:
                inputs = inputs.masked_fill(negative.view(-1, *([1] * (inputs.dim() - 1))), 0)
            return op(inputs, weights, out, index.clamp_min(0), *args, **kwargs)

        wrapped.__wrapped__ = op
        return wrapped

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        patched = fix(getattr(ops, name))
        setattr(ops, name, patched)
        setattr(punica_cpu, name, patched)


def _prompt_logits_lora() -> None:
    """Prompt logprobs compute logits for every prompt row of a request, but the lm_head LoRA maps rows
    with one index per *request*, so the shapes disagree (CPU: einsum error). When the call's requests
    share one adapter slot (the engine arranges that for prompt-logprob requests) apply it to every row."""
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    classes: list[type] = [PunicaWrapperCPU]
    try:
        from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

        classes.append(PunicaWrapperGPU)
    except Exception:  # noqa: BLE001 - the GPU wrapper needs triton; absent on CPU-only installs
        pass
    for cls in classes:
        original = cls.add_lora_logits

        def add_lora_logits(self: PunicaWrapperBase, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                            lora_b: torch.Tensor, scale: float, *args: Any, _original: Callable[..., Any] = original,
                            **kwargs: Any) -> Any:
            index = self.sampler_indices
            rows = x.view(-1, x.shape[-1])
            if rows.shape[0] == index.shape[0]:
                return _original(self, y, x, lora_a, lora_b, scale, *args, **kwargs)
            slots = index.unique()
            if slots.numel() != 1:
                raise RuntimeError("prompt logprobs with an lm_head adapter need one adapter per engine call")
            slot = int(slots[0])
            if slot >= 0:
                a, b = lora_a[slot, 0].to(torch.float32), lora_b[slot, 0].to(torch.float32)
                delta = (rows.to(torch.float32) @ a.T * scale) @ b.T
                out = y.view(-1, y.shape[-1])
                width = min(out.shape[-1], delta.shape[-1])
                out[:, :width].add_(delta[:, :width].to(out.dtype))

        cls.add_lora_logits = add_lora_logits


_plain_linear = False


@contextlib.contextmanager
def cpu_plain_linear(enabled: bool) -> Iterator[None]:
    """CPU vLLM repacks each linear weight after loading (oneDNN / sgl-kernel copies in `layer.cpu_linear`)
    and drops `layer.weight`, so a weight written in place would never be read. Engines built (and reloads
    run) inside this keep plain weights and compute with F.linear: what merged in-place sync writes is what
    the next step reads. Numerics are torch's own linear; speed is not the CPU build's concern here."""
    global _plain_linear
    if not enabled:
        yield
        return
    _patch_cpu_gemm_dispatch()
    previous, _plain_linear = _plain_linear, True
    try:
        yield
    finally:
        _plain_linear = previous


def _patch_cpu_gemm_dispatch() -> None:
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_tinkerq_plain", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if _plain_linear and weight is not None and not weight.is_meta and weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear  # linear.py and the LM head call it with layer.weight
            return
        original(layer, remove_weight)

    dispatch._tinkerq_plain = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
