"""Full weights for the in-place reload path: base weights plus a LoRA adapter's delta, in HF names."""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from worker.torch_runtime.lora_io import LoraWeights

PEFT_PREFIX = "base_model.model."


def load_base(path: Path) -> dict[str, torch.Tensor]:
    """The base checkpoint's tensors, with lm_head.weight present even when tied: a reload that lacks it
    keeps the LM head's old packed copy (vLLM logs 'Failed to load weights' and serves stale logits)."""
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def ties_embeddings(path: Path) -> bool:
    return bool(json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False))


def lora_deltas(weights: LoraWeights) -> dict[str, torch.Tensor]:
    """{'<module>.weight': scale * B @ A} for every module the adapter targets."""
    config = weights.config
    scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    deltas = {}
    for key, a in weights.tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        b = weights.tensors[key.replace(".lora_A.", ".lora_B.")]
        deltas[f"{module}.weight"] = (b.float() @ a.float()) * scale
    return deltas


def merged(base: dict[str, torch.Tensor], weights: LoraWeights) -> dict[str, torch.Tensor]:
    out = dict(base)
    for name, delta in lora_deltas(weights).items():
        out[name] = (base[name].float() + delta.to(base[name].device)).to(base[name].dtype)
    return out
