"""LoRA sync at memory speed: the trainer's adapter tensors are copied straight into vLLM's stacked LoRA slots.

vLLM's own path writes a peft directory, parses it into a LoRAModel, folds the scaling into B and copies
module by module, at every sync. Here the layout is read once from the engine's LoRA manager
(which vLLM module and which slice of a packed qkv_proj / gate_up_proj each peft module lands in), and a
sync is one batched copy of every A and B into a free (or least recently used) slot, B scaled on its copy.

vLLM's bookkeeping is kept true, so it serves, evicts and re-activates these adapters as its own:
* the snapshot is registered under a fresh id (and a unique name: the prefix cache is keyed by it) and
  marked active in the slot it was written to;
* the registered LoRAModel builds vLLM's own weights on demand, so if vLLM later evicts it from its slot
  to make room, activating it again copies the same values back (older pinned snapshots stay servable);
* slots vLLM wrote itself hold unknown modules: they are reset in full before being reused here.

Only in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) with tensor parallelism 1 are handled; for any
other layout `LoraSlots.attach` returns None or `load` returns False and the engine uses the file path.
"""

import logging
import math
from typing import Any

import torch

from worker.torch_runtime.lora_io import LoraWeights

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."
# peft saves the frozen base of a trained embedding / lm_head beside its A and B; vLLM skips it too
BASE_EMBEDDINGS = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
Target = tuple[str, int]  # (vLLM module, slice index) a peft module's A and B go to


def worker_of(llm: Any) -> Any | None:
    """The engine's worker object, when it lives in this process (so tensors can be written directly)."""
    try:
        (worker,) = llm.collective_rpc(_self)
    except Exception as exc:  # noqa: BLE001 - multiprocess engines cannot return a callable's local object
        log.info("in-place sync unavailable (%s): using the file path", exc)
        return None
    return worker if hasattr(worker, "model_runner") else None


def _self(worker: Any) -> Any:
    return worker


def scaling(config: Any) -> float:
    """peft's scale of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def _slices(stacked: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Packed layers hold a tuple (one tensor per slice); lm_head holds one tensor."""
    return (stacked,) if isinstance(stacked, torch.Tensor) else tuple(stacked)


class LoraSlots:
    """Writes snapshots of adapters into one engine's LoRA slots and registers them with vLLM."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.targets = self._targets(manager)
        self._plans: dict[tuple[str, ...], dict[str, Target] | None] = {}
        # slot -> the (module, slice) pairs this class last wrote there; absent: unknown, reset before use
        self.written: dict[int, frozenset[Target]] = {i: frozenset() for i in range(manager.lora_slots)}
        self._destinations: dict[tuple[int, int, int], _Destination] = {}
        self._wrap_activation()

    @classmethod
    def attach(cls, llm: Any) -> "LoraSlots | None":
        worker = worker_of(llm)
        manager = getattr(getattr(getattr(worker, "model_runner", None), "lora_manager", None),
                          "_adapter_manager", None)
        needed = ("modules", "packed_modules", "lora_index_to_id", "_active_adapters", "_registered_adapters")
        if manager is None or not all(hasattr(manager, name) for name in needed):
            return None
        if getattr(manager.lora_config, "fully_sharded_loras", False):
            return None
        return cls(manager)

    # -- layout ---------------------------------------------------------------------------------

    @staticmethod
    def _targets(manager: Any) -> dict[str, Target]:
        """Each vLLM module name a peft module may carry, mapped to (module, slice); packed subs by index."""
        out: dict[str, Target] = {}
        for name, module in manager.modules.items():
            if getattr(module, "tp_size", 1) != 1 or not hasattr(module, "lora_a_stacked"):
                continue
            if type(module).__name__.startswith("VocabParallelEmbedding"):
                continue  # embedding LoRA keeps A transposed in a layout of its own: file path
            subs = manager.packed_modules.get(name)
            if subs is None:
                if len(_slices(module.lora_a_stacked)) == 1:
                    out[name] = (name, 0)
            elif len(subs) == len(_slices(module.lora_a_stacked)):
                out.update({sub: (name, i) for i, sub in enumerate(subs)})
        return out

    def _rename(self, module: str) -> str:
        mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)
        if mapper is None:
            return module
        # the renames only, as vLLM's own LoRA loader applies them: 0.32 names it get_rename_mapper, 0.26
        # get_unstacked_mapper
        for name in ("get_rename_mapper", "get_unstacked_mapper"):
            if hasattr(mapper, name):
                mapper = getattr(mapper, name)()
                break
        mapped = mapper._map_name(module)
        return module if mapped is None else mapped

    def plan(self, weights: LoraWeights) -> dict[str, Target] | None:
        """{A or B tensor key: (vLLM module, slice)}, or None if any tensor has no known in-place home."""
        keys = tuple(weights.tensors)
        if keys not in self._plans:
            self._plans[keys] = self._make_plan(weights)
        return self._plans[keys]

    def _make_plan(self, weights: LoraWeights) -> dict[str, Target] | None:
        plan: dict[str, Target] = {}
        rank = weights.config.r
        for key, tensor in weights.tensors.items():
            if key.endswith(BASE_EMBEDDINGS):
                continue
            if ".lora_A." not in key and ".lora_B." not in key:
                log.info("in-place LoRA: %s is not a LoRA A/B tensor: file path", key)
                return None
            peft_module = key.removeprefix(PEFT_PREFIX).split(".lora_")[0]
            target = self.targets.get(self._rename(peft_module))
            if target is None:
                log.info("in-place LoRA: no slot layout for %s: file path", peft_module)
                return None
            a, b = self._stacked(target)
            want = (rank, a.shape[-1]) if ".lora_A." in key else (b.shape[-2], rank)
            if rank > a.shape[-2] or tuple(tensor.shape) != want:
                log.info("in-place LoRA: %s has shape %s, the slot takes %s: file path", key, tuple(tensor.shape),
                         want)
                return None
            plan[key] = target
        return plan

    def _stacked(self, target: Target) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot-stacked A and B of one slice: [slots, 1, rank, in] and [slots, 1, out, rank]."""
        module = self.manager.modules[target[0]]
        return _slices(module.lora_a_stacked)[target[1]], _slices(module.lora_b_stacked)[target[1]]

    # -- writing --------------------------------------------------------------------------------

    def load(self, lora_id: int, weights: LoraWeights) -> bool:
        """Write the adapter into a slot and register it as `lora_id`; False: not understood (no change)."""
        plan = self.plan(weights)
        if plan is None:
            return False
        manager = self.manager
        slot = self._claim_slot()
        self._write(slot, plan, weights)
        if len(manager._registered_adapters) >= manager.capacity:
            manager.remove_oldest_adapter()
        manager._registered_adapters[lora_id] = _SnapshotModel(lora_id, self, plan, weights)
        manager._active_adapters[lora_id] = None
        manager.lora_index_to_id[slot] = lora_id
        # Older vLLMs (0.26) rebuild the punica slot metadata only when the token mapping changes, not when
        # slots move under it: make the next step rebuild it.
        manager._last_mapping = None
        return True

    def _claim_slot(self) -> int:
        manager = self.manager
        if None not in manager.lora_index_to_id:
            manager._active_adapters.remove_oldest()  # vLLM's LRU: frees the least recently used slot
        return manager.lora_index_to_id.index(None)

    def _write(self, slot: int, plan: dict[str, Target], weights: LoraWeights) -> None:
        before = self.written.get(slot)
        if before is None:  # vLLM wrote this slot: unknown modules hold values, clear them all
            for module in self.manager.modules.values():
                module.reset_lora(slot)
            before = frozenset()
        dest = self._destination(slot, plan, weights.config.r)
        stale = list(dest.stale)
        for target in before - dest.targets:  # a module the previous adapter had and this one lacks
            a, b = self._stacked(target)
            stale += [a[slot], b[slot]]
        with torch.no_grad():
            if stale:
                torch._foreach_zero_(stale)
            torch._foreach_copy_(dest.a + dest.b, [weights.tensors[key] for key in dest.keys])
            scale = scaling(weights.config)
            if scale != 1:
                # vLLM folds the scale into its own copy of B at load (LoRALayerWeights.optimize): same here,
                # on the slot's copy, in the slot's dtype; the trainer's tensors are never scaled.
                torch._foreach_mul_(dest.b, scale)
        self.written[slot] = dest.targets

    def _destination(self, slot: int, plan: dict[str, Target], rank: int) -> "_Destination":
        """Where each tensor of `plan` goes in `slot`: built once per slot and plan (indexing a stacked tensor costs
        microseconds in Python, hundreds of times per sync); the views stay valid, vLLM never reallocates them."""
        cache_key = (slot, id(plan), rank)
        dest = self._destinations.get(cache_key)
        if dest is None:
            dest = self._destinations[cache_key] = _Destination.build(self, slot, plan, rank)
        return dest

    def _wrap_activation(self) -> None:
        """vLLM's own activations (file-path adapters, re-activating an evicted snapshot) rewrite a slot in
        full: forget what this class knew of it."""
        manager = self.manager
        original = manager.activate_adapter

        def activate_adapter(lora_id: int, *args: Any, **kwargs: Any) -> bool:
            wrote = original(lora_id, *args, **kwargs)
            if wrote and lora_id in manager.lora_index_to_id:
                self.written.pop(manager.lora_index_to_id.index(lora_id), None)
                manager._last_mapping = None
            return wrote

        manager.activate_adapter = activate_adapter


class _Destination:
    """One slot's views for one plan: A's and B's destinations (the keys of their sources in the same order), the
    rows and columns past the adapter's rank (zeroed: a higher-rank adapter may have left values there), and the
    (module, slice) pairs it covers."""

    def __init__(self, keys: list[str], a: list[torch.Tensor], b: list[torch.Tensor], stale: list[torch.Tensor],
                 targets: frozenset[Target]) -> None:
        self.keys, self.a, self.b, self.stale, self.targets = keys, a, b, stale, targets

    @classmethod
    def build(cls, slots: LoraSlots, slot: int, plan: dict[str, Target], rank: int) -> "_Destination":
        a_keys, b_keys, a_dst, b_dst, stale = [], [], [], [], []
        for key, target in plan.items():
            a, b = slots._stacked(target)
            if ".lora_A." in key:
                a_keys.append(key)
                a_dst.append(a[slot, 0, :rank])
                if a.shape[-2] > rank:
                    stale.append(a[slot, 0, rank:])
            else:
                b_keys.append(key)
                b_dst.append(b[slot, 0, :, :rank])
                if b.shape[-1] > rank:
                    stale.append(b[slot, 0, :, rank:])
        return cls(a_keys + b_keys, a_dst, b_dst, stale, frozenset(plan.values()))


class _SnapshotModel:
    """vLLM's LoRAModel interface for an adapter written in place: its layer weights are built only if vLLM
    evicts it from its slot and activates it again (from the snapshot's tensors, B scaled on a copy)."""

    is_3d_lora_weight = False
    extra_vocab_size = 0  # read by older vLLMs' activate_adapter

    def __init__(self, lora_id: int, slots: LoraSlots, plan: dict[str, Target], weights: LoraWeights) -> None:
        self.id = lora_id
        self.rank = weights.config.r
        self.modules_to_save: dict = {}
        self._slots, self._plan, self._weights = slots, plan, weights
        self._loras: dict[str, Any] | None = None

    @property
    def loras(self) -> dict[str, Any]:
        if self._loras is None:
            self._loras = self._build()
        return self._loras

    def get_lora(self, module_name: str) -> Any | None:
        return self.loras.get(module_name)

    def get_module_to_save(self, module_name: str) -> None:
        return None

    def check_lora_name(self, lora_name: str) -> bool:
        return lora_name in self.loras

    def _build(self) -> dict[str, Any]:
        from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

        config, tensors = self._weights.config, self._weights.tensors
        scale = scaling(config)
        grouped: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        for key, (module, index) in self._plan.items():
            if ".lora_A." not in key:
                continue
            a_stacked, _ = self._slots._stacked((module, index))
            a = tensors[key].to(a_stacked.device, a_stacked.dtype)
            b = (tensors[key.replace(".lora_A.", ".lora_B.")] * scale).to(a_stacked.device, a_stacked.dtype)
            count = len(_slices(self._slots.manager.modules[module].lora_a_stacked))
            grouped.setdefault(module, [None] * count)[index] = (a, b)
        out: dict[str, Any] = {}
        for module, pairs in grouped.items():
            if module in self._slots.manager.packed_modules:
                out[module] = PackedLoRALayerWeights(
                    module, self.rank, [config.lora_alpha if p else None for p in pairs],
                    [p[0] if p else None for p in pairs], [p[1] if p else None for p in pairs],
                    scaling=[1 if p else None for p in pairs])
            else:
                out[module] = LoRALayerWeights(module, self.rank, config.lora_alpha, *pairs[0], scaling=1)
        return out
