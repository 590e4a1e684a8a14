"""A multi-tenant LoRA trainer: one adapter and one AdamW per Tinker model, on shared base weights."""

import gc
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig

from schemas import (
    AdamParams,
    CreateModelOutput,
    CreateModelRequest,
    CustomLoss,
    Datum,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    LoraConfig as LoraSpec,
    OptimStepOutput,
    OptimStepRequest,
)
from worker.runtime import paths
from worker.runtime.base import DomainError, Trainer
from worker.torch_runtime import custom_loss
from worker.torch_runtime.base_models import BaseModels, LoadedBase, adapter_name
from worker.torch_runtime.checkpoints import extract_archive, write_archive
from worker.torch_runtime.host_copy import tree_to_host
from worker.torch_runtime.lora_io import (
    AdapterExport,
    LoraWeights,
    export_adapter,
    import_adapter,
    load_adapter,
    save_adapter,
    save_merged,
)
from worker.torch_runtime.packed_forward import TrainOptions, forward_request
from worker.torch_runtime.train_stream import training_stream

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
STATE_FILE = "tinkerq_state.json"
log = logging.getLogger(__name__)
PROBE = "tinkerq/memory-probe"  # the throwaway model peak_training_bytes trains: no valid model id has a '/'


@dataclass
class TrainedModel:
    model_id: str
    base: LoadedBase
    adapter: str
    spec: LoraSpec
    optimizer: torch.optim.AdamW
    exporter: AdapterExport | None = None  # built at the first export: the adapter's parameters never change

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.base.model.named_parameters() if f".{self.adapter}." in n]


def adamw_kwargs(adam: AdamParams) -> dict:
    """Tinker's Adam parameters as torch.optim.AdamW's (decoupled weight decay)."""
    return {"lr": adam.learning_rate, "betas": (adam.beta1, adam.beta2), "eps": adam.eps,
            "weight_decay": adam.weight_decay}


def peft_config(spec: LoraSpec) -> LoraConfig:
    targets = (ATTN if spec.train_attn else []) + (MLP if spec.train_mlp else []) + \
        (["lm_head"] if spec.train_unembed else [])
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha or 32, target_modules=targets, lora_dropout=0.0,
                      bias="none")


class TorchTrainer(Trainer):
    def __init__(self, bases: BaseModels, checkpoint_root: Path, options: TrainOptions | None = None) -> None:
        self.bases = bases
        self.root = checkpoint_root.resolve()
        self.options = options  # None: the defaults of each base's device
        self.models: dict[str, TrainedModel] = {}
        self._custom_losses: dict[str, custom_loss.CompiledLoss] = {}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    def base_model(self, model_id: str) -> str:
        return self.models[model_id].base.name

    def warm(self, base_model: str) -> None:
        self.bases.get(base_model)  # DomainError for a base this deployment does not serve

    def remove_model(self, model_id: str) -> None:
        trained = self.models.pop(model_id, None)
        if trained is not None:
            trained.base.delete_adapter(trained.adapter)

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput:
        if request.lora is None:
            raise DomainError(400, "unsupported", "the torch runtime trains LoRA adapters; give a lora config")
        base = self.bases.get(request.base_model)
        self._add(request.model_id, base, request.lora)
        return CreateModelOutput(model_id=request.model_id, base_model=base.name, lora_rank=request.lora.rank)

    def _add(self, model_id: str, base: LoadedBase, spec: LoraSpec) -> TrainedModel:
        name = adapter_name(model_id)
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        base.add_adapter(name, peft_config(spec))
        params = [p for n, p in base.model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, **adamw_kwargs(AdamParams()),
                                      fused=base.device.type == "cuda")  # one kernel for all tensors
        self.models[model_id] = TrainedModel(model_id, base, name, spec, optimizer)
        return self.models[model_id]

    # -- forward / backward ---------------------------------------------------------------------

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        trained = self.models[request.model_id]
        trained.base.model.set_adapter(trained.adapter)
        loss = custom_loss.BatchLoss(self._compiled(request.custom_loss)) if request.custom_loss else None
        try:
            with training_stream(trained.base.device):
                outputs, total = forward_request(trained.base, trained.adapter, request, backward,
                                                 self.options or TrainOptions.for_device(trained.base.device),
                                                 trained.optimizer.param_groups[0]["params"], loss)
        except custom_loss.CustomLossError as exc:
            raise DomainError(400, "invalid_custom_loss", str(exc)) from exc
        metrics = loss.metrics(len(request.data)) if loss is not None else {}
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": total, **metrics})

    def check_custom_loss(self, loss: CustomLoss) -> None:
        self._compiled(loss)

    def _compiled(self, loss: CustomLoss) -> custom_loss.CompiledLoss:
        """A custom loss rebuilt from its graph (once per loss id); DomainError 400 if it is refused."""
        if loss.loss_id not in self._custom_losses:
            logprobs = loss.inputs[0]
            if logprobs.name != "logprobs" or any(i.rank != 1 for i in loss.inputs):
                raise DomainError(400, "invalid_custom_loss", "this server's custom losses read per-token inputs "
                                  "only: logprobs first, every input of rank 1 ([T])")
            try:
                compiled = custom_loss.compile_loss(loss.graph, [i.model_dump() for i in loss.inputs])
            except custom_loss.CustomLossError as exc:
                raise DomainError(400, "invalid_custom_loss", str(exc)) from exc
            if len(self._custom_losses) >= 256:
                self._custom_losses.clear()
            self._custom_losses[loss.loss_id] = compiled
        return self._custom_losses[loss.loss_id]

    # -- what training needs (worker/vllm_runtime/memory_share.py) -------------------------------

    def peak_training_bytes(self, base_model: str, rank: int) -> tuple[int, int]:
        """The device memory `dry_run` takes above what it holds now, and the tokens of the pass it ran. CUDA only.
        What torch's allocator reserved, not only what it handed out: the blocks a pass splits and cannot reuse stay
        the trainer's (gigabytes on a large shape), so a trainer beside an engine sized from the allocated peak alone
        runs out of memory. With expandable segments, the worker's default (worker/runtime/cuda_allocator.py), the
        two stay close."""
        device = self.bases.get(base_model).device
        if device.type != "cuda":
            raise ValueError(f"peak_training_bytes measures CUDA memory, not {device}")
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            tokens = self.dry_run(base_model, rank)
            torch.cuda.synchronize(device)
            handed_out = torch.cuda.max_memory_allocated(device) - allocated
            held = torch.cuda.max_memory_reserved(device) - reserved
            # both, so that a log says how much of the need is the allocator's split blocks rather than tensors
            log.info("the trainer's dry pass of %d tokens on %s: peak %.2f GiB allocated, %.2f GiB reserved", tokens,
                     base_model, handed_out / 2**30, held / 2**30)
            peak = max(handed_out, held)
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        return peak, tokens

    def dry_run(self, base_model: str, rank: int) -> int:
        """A forward_backward of a full pass (`micro_batch_tokens` tokens, in datums of up to 2048), an optim_step,
        and the pass again with the optimizer's state resident (a model's steady state), on a throwaway adapter of
        `rank` on every target the trainer trains (attention, MLP, unembedding); returns the tokens. Loads the base
        if it was not; leaves no adapter, gradient or optimizer state behind, and the RNG as it was."""
        base = self.bases.get(base_model)
        options = self.options or TrainOptions.for_device(base.device)
        tokens = options.micro_batch_tokens
        length = max(2, min(2048, tokens, getattr(base.model.config, "max_position_embeddings", None) or 2048))
        vocab = base.vocab_size
        data = []
        for start in range(0, tokens, length):
            ids = [(7 * (start + j) + 3) % vocab for j in range(min(length, tokens - start))]
            data.append(Datum(model_input=ids, loss_fn_inputs={"target_tokens": [float(t) for t in ids[1:] + ids[:1]]}))
        request = ForwardBackwardRequest(model_id="probe", data=data, loss_fn="cross_entropy")
        devices = [base.device] if base.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                probe = self._add(PROBE, base, LoraSpec(rank=rank, seed=0))
                base.model.set_adapter(probe.adapter)
                params = probe.optimizer.param_groups[0]["params"]
                forward_request(base, probe.adapter, request, True, options, params)
                probe.optimizer.step()
                forward_request(base, probe.adapter, request, True, options, params)
        finally:
            self.remove_model(PROBE)
        return tokens

    # -- optimizer ------------------------------------------------------------------------------

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        trained = self.models[request.model_id]
        adam = request.adam_params
        for group in trained.optimizer.param_groups:
            group.update(adamw_kwargs(adam))
        params = [p for p in trained.params if p.grad is not None]
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        with training_stream(trained.base.device):
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
            trained.optimizer.step()
            trained.optimizer.zero_grad(set_to_none=True)
        return OptimStepOutput(metrics={"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate})

    # -- weights in and out ---------------------------------------------------------------------

    def export_weights(self, model_id: str) -> LoraWeights:
        trained = self.models[model_id]
        if trained.exporter is None:
            try:
                trained.exporter = AdapterExport(trained.base, trained.adapter)
            except ValueError:  # a peft layout this does not understand: its own state dict each time
                return export_adapter(trained.base, trained.adapter)
        return trained.exporter.export()

    def save_sampler_weights(self, model_id: str, name: str) -> str:
        trained = self.models[model_id]
        with tempfile.TemporaryDirectory() as tmp:
            # The archive root is a plain HF model (merged); the peft adapter sits in adapter/, since
            # transformers would otherwise apply an adapter found beside merged weights a second time.
            save_merged(trained.base, trained.adapter, Path(tmp))
            (Path(tmp) / "adapter").mkdir()
            save_adapter(self.export_weights(model_id), Path(tmp) / "adapter", trained.base.path)
            target = paths.checkpoint_file(self.root, model_id, "sampler_weights", name, ".tar.gz")
            return str(write_archive(Path(tmp), target))

    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str:
        trained = self.models[model_id]
        with tempfile.TemporaryDirectory() as tmp:
            save_adapter(self.export_weights(model_id), Path(tmp), trained.base.path)
            state = {"model_id": model_id, "base_model": trained.base.name, "lora": trained.spec.model_dump()}
            (Path(tmp) / STATE_FILE).write_text(json.dumps(state))
            if include_optimizer:
                torch.save(trained.optimizer.state_dict(), Path(tmp) / "optimizer.pt")
            return str(write_archive(Path(tmp), paths.checkpoint_file(self.root, model_id, "weights", name, ".tar.gz")))

    # -- durable checkpoints (worker/durability/checkpointer.py) ---------------------------------------------

    def save_durable(self, model_id: str, name: str, snapshots: dict[int, LoraWeights]) -> str:
        """Adapter, AdamW state, pending gradients, LoRA config and each live snapshot's adapter, as one archive
        (written under a temp name and renamed)."""
        return self.durable_writer(model_id, snapshots)(name)

    def durable_writer(self, model_id: str, snapshots: dict[int, LoraWeights]) -> Callable[[str], str]:
        """save_durable in two: everything it writes copied to host memory now (worker/torch_runtime/host_copy.py;
        pinned, and not waited for, on a GPU), and the write of that copy, for a side thread."""
        trained = self.models[model_id]
        live = {"adapter": self.export_weights(model_id).tensors, "optimizer": trained.optimizer.state_dict(),
                "grads": {i: p.grad for i, p in enumerate(trained.params) if p.grad is not None},
                **{f"snapshot-{version}": weights.tensors for version, weights in snapshots.items()}}
        # a host buffer per part: torch.save writes whole storages, so the optimizer's file must hold only its own
        copies = {part: tree_to_host(tree) for part, tree in live.items()}
        copied = {part: tree for part, (tree, _) in copies.items()}
        ready = [host for _, host in copies.values()]
        config = trained.base.model.peft_config[trained.adapter]
        state = {"model_id": model_id, "base_model": trained.base.name, "lora": trained.spec.model_dump(),
                 "snapshots": sorted(snapshots)}
        configs = {version: weights.config for version, weights in snapshots.items()}
        base_path = trained.base.path

        def write(name: str) -> str:
            for host in ready:
                host.wait()  # the copies into pinned memory (a GPU's) have landed
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                save_adapter(LoraWeights(config, copied["adapter"]), out, base_path)
                (out / STATE_FILE).write_text(json.dumps(state))
                torch.save(copied["optimizer"], out / "optimizer.pt")
                if copied["grads"]:
                    torch.save(copied["grads"], out / "grads.pt")
                for version, config_of in configs.items():
                    (out / "snapshots" / str(version)).mkdir(parents=True)
                    save_adapter(LoraWeights(config_of, copied[f"snapshot-{version}"]),
                                 out / "snapshots" / str(version), base_path)
                target = paths.checkpoint_file(self.root, model_id, "durable", name, ".tar")
                return str(write_archive(out, target, compress=False))

        return write

    def load_durable(self, model_id: str, path: str) -> dict[int, LoraWeights]:
        archive = paths.resolve(self.root, path, ".tar")
        self.remove_model(model_id)
        with tempfile.TemporaryDirectory() as tmp:
            directory = extract_archive(archive, Path(tmp) / "ckpt")
            try:
                state = json.loads((directory / STATE_FILE).read_text())
                spec = LoraSpec.model_validate(state["lora"])
                trained = self._add(model_id, self.bases.get(state["base_model"]), spec)
                device = trained.base.device
                import_adapter(trained.base, trained.adapter, load_adapter(directory))
                trained.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True,
                                                             map_location=device))
                if (directory / "grads.pt").exists():
                    params = trained.params
                    for i, grad in torch.load(directory / "grads.pt", weights_only=True).items():
                        params[int(i)].grad = grad.to(device=device, dtype=params[int(i)].dtype)
                snapshots = {}
                for version in state["snapshots"]:
                    weights = load_adapter(directory / "snapshots" / str(version))
                    snapshots[int(version)] = LoraWeights(weights.config,
                                                          {k: v.to(device) for k, v in weights.tensors.items()})
            except (OSError, ValueError, KeyError, IndexError, RuntimeError) as exc:
                self.remove_model(model_id)
                raise DomainError(400, "corrupt_checkpoint", f"{archive.name} is not a durable state: {exc}") from exc
        return snapshots

    def read_sampler_weights(self, path: str) -> LoraWeights:
        """The adapter inside a sampler snapshot's archive (save_sampler_weights puts it in adapter/)."""
        archive = paths.resolve(self.root, path, ".tar.gz")
        with tempfile.TemporaryDirectory() as tmp:
            directory = extract_archive(archive, Path(tmp) / "snap")
            try:
                weights = load_adapter(directory / "adapter")
            except (OSError, ValueError, KeyError) as exc:
                raise DomainError(400, "corrupt_checkpoint",
                                  f"{archive.name} holds no readable adapter: {exc}") from exc
        return weights

    def load_state(self, request: LoadStateRequest) -> LoadStateOutput:
        archive = paths.resolve(self.root, request.path, ".tar.gz")
        with tempfile.TemporaryDirectory() as tmp:
            directory = extract_archive(archive, Path(tmp) / "ckpt")
            try:
                state = json.loads((directory / STATE_FILE).read_text())
                weights = load_adapter(directory)
                spec = LoraSpec.model_validate(state["lora"])
            except (OSError, ValueError, KeyError) as exc:
                raise DomainError(400, "corrupt_checkpoint", f"{archive.name} is not a tinkerq state: {exc}") from exc
            trained = self.models.get(request.model_id)
            if trained is None:
                trained = self._add(request.model_id, self.bases.get(request.base_model or state["base_model"]), spec)
            import_adapter(trained.base, trained.adapter, weights)
            optimizer_file = directory / "optimizer.pt"
            if request.optimizer:
                if not optimizer_file.exists():
                    raise DomainError(400, "no_optimizer_state", f"{archive.name} was saved without optimizer state")
                trained.optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
            else:
                trained.optimizer.state.clear()
        return LoadStateOutput(model_id=request.model_id, path=request.path, optimizer=request.optimizer,
                               base_model=trained.base.name, lora_rank=trained.spec.rank)
