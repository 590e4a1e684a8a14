"""Moving LoRA weights between the trainer, the sampler and disk (peft and HF formats)."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from worker.torch_runtime.base_models import LoadedBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class LoraWeights:
    """An adapter's tensors (cloned, so later training steps do not change them) and its config."""

    config: LoraConfig
    tensors: dict[str, torch.Tensor]

    def __reduce__(self) -> tuple:
        # Pickled (Ray's object store carries every sync to the engine replicas) as each storage once plus where
        # each tensor lies in it: pickle writes a tensor's whole storage per tensor, and AdapterExport's tensors are
        # views of one buffer, so a sync of n tensors moved n times the adapter's bytes.
        return _unpacked, (self.config, *_packed(self.tensors))


# (key, buffer index, storage offset, shape, stride) of each tensor
Layout = list[tuple[str, int, int, tuple[int, ...], tuple[int, ...]]]


def _packed(tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], Layout]:
    buffers: list[torch.Tensor] = []
    index: dict[tuple, int] = {}
    layout: Layout = []
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        ident = (storage.data_ptr(), tensor.dtype, tensor.device)
        if ident not in index:
            index[ident] = len(buffers)
            buffers.append(torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage))
        layout.append((key, index[ident], tensor.storage_offset(), tuple(tensor.shape), tensor.stride()))
    return buffers, layout


def _unpacked(config: LoraConfig, buffers: list[torch.Tensor], layout: Layout) -> "LoraWeights":
    return LoraWeights(config, {key: buffers[i].as_strided(shape, stride, offset)
                                for key, i, offset, shape, stride in layout})


def export_adapter(base: LoadedBase, adapter: str) -> LoraWeights:
    state = adapter_state(base, adapter)
    return LoraWeights(base.model.peft_config[adapter], {k: v.detach().clone() for k, v in state.items()})


def adapter_state(base: LoadedBase, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's own tensors, by peft's names. Not the base's unembedding matrix, which peft adds whenever lm_head
    is adapted (its save_embedding_layers="auto"): vocab x hidden, frozen, 272 MB in bf16 for Qwen2.5-0.5B and 1.09 GB
    for 7B, that every export, sync, sampler snapshot and durable checkpoint would carry for nothing."""
    return get_peft_model_state_dict(base.model, adapter_name=adapter, save_embedding_layers=False)


class AdapterExport:
    """export_adapter without peft's state-dict round trip on every sync.

    peft's state dict walks the whole model's state dict and renames every key (tens of ms for 0.5B), and a clone
    per tensor is one kernel each. Here the state dict's keys are matched to the adapter's own parameters once;
    each export then copies all of them with one `torch.cat` per dtype and device into a fresh buffer, and hands
    out views of it under peft's names: the same tensors export_adapter gives, still a copy (later training steps
    do not change an exported snapshot), in a few kernels.
    """

    def __init__(self, base: LoadedBase, adapter: str) -> None:
        self.config = base.model.peft_config[adapter]
        state = adapter_state(base, adapter)
        params = {(p.data_ptr(), tuple(p.shape), p.dtype): p for p in base.model.parameters()}
        self.sources: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            param = params.get((value.data_ptr(), tuple(value.shape), value.dtype))
            if param is None or not param.is_contiguous():
                raise ValueError(f"peft's {key} is not one of the adapter's parameters as it is")
            self.sources[key] = param
        groups: dict[tuple, list[str]] = {}
        for key, param in self.sources.items():
            groups.setdefault((param.dtype, param.device), []).append(key)
        # per dtype and device: the keys, their parameters, sizes and shapes (fixed for the adapter's life)
        self.groups = [(keys, [self.sources[k] for k in keys], [self.sources[k].numel() for k in keys],
                        [self.sources[k].shape for k in keys]) for keys in groups.values()]

    def export(self) -> LoraWeights:
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for keys, params, sizes, shapes in self.groups:
                parts = torch.cat([p.view(-1) for p in params]).split(sizes)
                tensors.update({key: part.view(shape) for key, part, shape in zip(keys, parts, shapes, strict=True)})
        return LoraWeights(self.config, tensors if len(self.groups) == 1 else {k: tensors[k] for k in self.sources})


def import_adapter(base: LoadedBase, adapter: str, weights: LoraWeights) -> None:
    if adapter not in base.adapters:
        base.add_adapter(adapter, weights.config)
    set_peft_model_state_dict(base.model, weights.tensors, adapter_name=adapter)


def save_adapter(weights: LoraWeights, out: Path, base_path: Path) -> None:
    """peft's on-disk layout: adapter_config.json + adapter_model.safetensors."""
    config = weights.config.to_dict()
    config["base_model_name_or_path"] = str(base_path)
    config["target_modules"] = sorted(config["target_modules"])
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file({k: v.contiguous().cpu() for k, v in weights.tensors.items()}, str(out / "adapter_model.safetensors"))


def load_adapter(directory: Path) -> LoraWeights:
    config = json.loads((directory / "adapter_config.json").read_text())
    lora = LoraConfig(
        r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"],
        lora_dropout=0.0, bias="none",
    )
    return LoraWeights(lora, load_file(str(directory / "adapter_model.safetensors")))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: one sharded over ranks (FSDP's DTensor) is gathered, which every rank of its group
    must do at once, in the same order."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def merged_state(base: LoadedBase, adapter: str) -> dict[str, torch.Tensor]:
    """The base's weights with this adapter merged in, HF-named, in host memory. Over a sharded base every rank of its
    group calls this at once (each tensor is gathered whole in turn); rank 0 keeps the result."""
    inner = base.model.base_model.model
    adapted = {f"{name}.base_layer.weight": module for name, module in inner.named_modules()
               if isinstance(module, LoraLayer) and adapter in module.lora_A}
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in inner.state_dict().items():
            if "lora_" in key:
                continue
            value = _whole(value)
            if key in adapted:
                value = value + adapted[key].get_delta_weight(adapter)
            merged[key.replace(".base_layer", "")] = value.detach().contiguous().cpu()
    return merged


def save_merged(base: LoadedBase, adapter: str, out: Path) -> None:
    """A full HF-format model (base + this adapter merged): config, safetensors, tokenizer."""
    merged = merged_state(base, adapter)
    lm_head_adapted = adapter in getattr(base.model.base_model.model.lm_head, "lora_A", {})
    config = json.loads((base.path / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        # Tied and untouched: HF stores the embedding once. A trained unembedding is no longer the
        # embedding, so the merged model unties (a tied config would load it as the embedding again).
        if lm_head_adapted:
            config["tie_word_embeddings"] = False
        else:
            merged.pop("lm_head.weight", None)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (base.path / name).exists():
            shutil.copy(base.path / name, out / name)
