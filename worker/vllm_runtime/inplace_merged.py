"""Merged sync at memory speed: base + scale * B @ A written straight into the engine's own parameters.

vLLM's reload path re-materialises every layer from HF-named tensors, at every sync.
Here the HF -> vLLM map is built once (q/k/v rows of qkv_proj, gate/up rows of gate_up_proj, the rest by
name), and a sync writes only the modules the adapter targets, one fused kernel each
(`addmm(base, B, A, alpha=scale)` into the parameter's rows; modules of one shape batched: every layer's q_proj in
one `baddbmm`), plus a restore from the base of any module an
earlier adapter on this base changed and this one does not. One synchronisation at the end; the engine then
salts later requests' prefix-cache keys with the new weights' epoch (see engine._reload), so no KV of the old
weights is read again.

Parameters keep their storage, so CUDA graphs captured over them read the new values; vLLM 0.26's CUDA linear
layers read `layer.weight` directly (UnquantizedLinearMethod.apply), so nothing else holds a copy. On CPU the engine is
built with patches.cpu_plain_linear, since vLLM's CPU kernels would otherwise read packed private copies.
Anything not understood (tensor parallelism, a shape mismatch, a missing name) makes `attach` or `write`
return None / False, and the engine falls back to reload_weights.
"""

import logging
from typing import Any

import torch

from worker.torch_runtime.lora_io import LoraWeights
from worker.vllm_runtime.inplace import PEFT_PREFIX, scaling, worker_of

log = logging.getLogger(__name__)


class MergedWriter:
    def __init__(self, params: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
        self.params = params  # HF name -> the engine's view of it (rows of a fused parameter where packed)
        self.base = base
        self.dirty: set[str] = set()  # HF names whose engine copy differs from the base
        self._stacks: dict[tuple[str, ...], torch.Tensor] = {}  # a group's base weights, stacked (_stacked_base)

    @classmethod
    def attach(cls, llm: Any, base: dict[str, torch.Tensor]) -> "MergedWriter | None":
        worker = worker_of(llm)
        if worker is None:
            return None
        try:
            model = worker.model_runner.get_model()
            params = hf_views(model, base)
        except (AttributeError, KeyError, ValueError) as exc:
            log.info("in-place merged sync unavailable (%s): using reload_weights", exc)
            return None
        return cls(params, base)

    def write(self, weights: LoraWeights) -> bool:
        """Write base + delta for every module the adapter targets; False (nothing written) if one is unknown."""
        pairs = self._pairs(weights)
        if pairs is None:
            return False
        scale = scaling(weights.config)
        with torch.no_grad():
            for name in self.dirty - pairs.keys():  # an earlier adapter's module this one leaves alone
                self.params[name].copy_(self.base[name])
            for names in self._groups(pairs):
                self._write_group(names, pairs, scale)
        self.dirty = set(pairs)
        if any(p.is_cuda for p in self.params.values()):
            torch.cuda.synchronize()  # the next engine step must not start on half-written weights
        return True

    def _pairs(self, weights: LoraWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """{HF weight name: (B, A)} of the adapter, or None if a module has no engine parameter here."""
        pairs = {}
        for key, a in weights.tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0] + ".weight"
            if name not in self.params:
                log.info("in-place merged sync: no engine parameter for %s: using reload_weights", name)
                return None
            pairs[name] = (weights.tensors[key.replace(".lora_A.", ".lora_B.")], a)
        return pairs

    def _groups(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[list[str]]:
        """The targeted modules by shape (every layer's q_proj, every layer's gate_proj, ...): a group is written by
        a few batched kernels instead of a few kernels per module, hundreds per sync."""
        groups: dict[tuple, list[str]] = {}
        for name, (b, _a) in pairs.items():
            dst = self.params[name]
            groups.setdefault((tuple(dst.shape), dst.dtype, dst.device, tuple(b.shape), b.dtype), []).append(name)
        return list(groups.values())

    def _write_group(self, names: list[str], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     scale: float) -> None:
        first = self.params[names[0]]
        # A trainer's float32 adapter over a bfloat16 engine is cast first (a few MB), which is what serving it
        # through vLLM's LoRA slots does too; the matmul accumulates in float32 and rounds base + scale * B @ A once.
        b = torch.stack([pairs[n][0] for n in names]).to(first.device, first.dtype)
        a = torch.stack([pairs[n][1] for n in names]).to(first.device, first.dtype)
        if len(names) == 1:
            torch.addmm(self.base[names[0]], b[0], a[0], alpha=scale, out=first)
            return
        merged = torch.baddbmm(self._stacked_base(names), b, a, alpha=scale)
        torch._foreach_copy_([self.params[n] for n in names], list(merged.unbind(0)))

    def _stacked_base(self, names: list[str]) -> torch.Tensor:
        """The group's base weights as one [modules, out, in] block, built at its first write; the base dict's
        entries become views of it (the same values, no second copy in memory)."""
        key = tuple(names)
        if key not in self._stacks:
            for other in [k for k in self._stacks if not set(k).isdisjoint(key)]:
                del self._stacks[other]  # another adapter's grouping: its block lives on in the views it left
            self._stacks[key] = torch.stack([self.base[n] for n in names])
            self.base.update(zip(names, self._stacks[key].unbind(0), strict=True))
        return self._stacks[key]

    def forget(self) -> None:
        """After a full reload every parameter may differ from what this writer knows: restore all next time."""
        self.dirty = set(self.params)


def hf_views(model: torch.nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weight name -> the engine parameter rows it occupies, checked against the base's shapes."""
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    sub_of = {sub: (fused, i) for fused, subs in packed.items() for i, sub in enumerate(subs)}
    views: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        module_name, _, attr = name.rpartition(".")
        prefix, _, leaf = module_name.rpartition(".")
        module = _unwrapped(modules.get(module_name))
        rows = None
        if module is None and leaf in sub_of:
            fused, index = sub_of[leaf]
            module = _unwrapped(modules.get(f"{prefix}.{fused}" if prefix else fused))
            sizes = getattr(module, "output_sizes", None)
            if module is None or sizes is None or len(sizes) <= index:
                raise ValueError(f"no fused layout for {name}")
            start = sum(sizes[:index])
            rows = (start, start + sizes[index])
        if module is None:
            if name == "lm_head.weight":
                continue  # tied to the embedding in this engine: written through model.embed_tokens.weight
            raise KeyError(f"no engine module for {name}")
        if getattr(module, "tp_size", 1) != 1:
            raise ValueError(f"{name} is sharded over tensor parallelism")
        param = getattr(module, attr)
        if param is None or param.is_meta:
            raise ValueError(f"{name}: the engine holds no plain weight (packed CPU kernel?)")
        view = param.data[rows[0]:rows[1]] if rows else param.data
        view = view[:tensor.shape[0]]  # vocab rows may be padded past the checkpoint's
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: engine {tuple(view.shape)} vs checkpoint {tuple(tensor.shape)}")
        views[name] = view
    return views


def _unwrapped(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The layer itself where vLLM's LoRA support (enable_lora) wrapped it."""
    return getattr(module, "base_layer", module)
