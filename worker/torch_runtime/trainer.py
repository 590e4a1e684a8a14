"""A multi-tenant LoRA trainer: one adapter and one AdamW per Tinker model, on shared base weights."""

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig

from schemas import (
    AdamParams,
    CreateModelOutput,
    CreateModelRequest,
    CustomLoss,
    ForwardBackwardOutput,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepOutput,
    OptimStepRequest,
)
from schemas import LoraConfig as LoraSpec
from worker.runtime import paths
from worker.runtime.base import DomainError, Trainer
from worker.torch_runtime import custom_loss, losses
from worker.torch_runtime.bases import BaseModels, LoadedBase, adapter_name
from worker.torch_runtime.checkpoints import extract_archive, write_archive
from worker.torch_runtime.lora_io import LoraWeights, export_adapter, import_adapter, load_adapter, save_adapter, \
    save_merged

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
STATE_FILE = "tinkerq_state.json"


@dataclass
class TrainedModel:
    model_id: str
    base: LoadedBase
    adapter: str
    spec: LoraSpec
    optimizer: torch.optim.AdamW

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.base.model.named_parameters() if f".{self.adapter}." in n]


def _tensors(inputs: dict[str, list[float]], device: torch.device) -> dict[str, torch.Tensor]:
    """A datum's per-token loss inputs as float32 tensors (target_tokens already went into the batch)."""
    return {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in inputs.items() if k != "target_tokens"}


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
    def __init__(self, bases: BaseModels, checkpoint_root: Path) -> None:
        self.bases = bases
        self.root = checkpoint_root.resolve()
        self.models: dict[str, TrainedModel] = {}
        self._custom_losses: dict[str, custom_loss.CompiledLoss] = {}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    def base_model(self, model_id: str) -> str:
        return self.models[model_id].base.name

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
        optimizer = torch.optim.AdamW(params, **adamw_kwargs(AdamParams()))
        self.models[model_id] = TrainedModel(model_id, base, name, spec, optimizer)
        return self.models[model_id]

    # -- forward / backward ---------------------------------------------------------------------

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        trained = self.models[request.model_id]
        base = trained.base
        tokens, targets, lengths = self._batch(request, base.vocab_size)
        base.model.set_adapter(trained.adapter)
        with torch.set_grad_enabled(backward):
            mask = (torch.arange(tokens.shape[1])[None, :] < torch.tensor(lengths)[:, None]).to(base.device)
            logits = base.model(input_ids=tokens.to(base.device), attention_mask=mask.long()).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.to(base.device)[..., None])[..., 0]
            per_datum = [logprobs[i, :n] for i, n in enumerate(lengths)]
            total, outputs, metrics = self._losses(request, per_datum, base.device)
            if backward:
                total.backward()
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": total.item(), **metrics})

    def _losses(self, request: ForwardRequest, logprobs: list[torch.Tensor],
                device: torch.device) -> tuple[torch.Tensor, list[dict[str, list[float]]], dict[str, float]]:
        """The request's total loss, each datum's outputs, and the loss's own metrics."""
        if request.custom_loss is not None:
            inputs = [_tensors(d.loss_fn_inputs, device) for d in request.data]
            try:
                total, metrics = custom_loss.run_loss_batch(self._compiled(request.custom_loss), logprobs, inputs)
            except custom_loss.CustomLossError as exc:
                raise DomainError(400, "invalid_custom_loss", str(exc)) from exc
            return total, [{"logprobs": p.tolist()} for p in logprobs], metrics
        total = torch.zeros((), device=device)
        outputs = []
        for datum, p in zip(request.data, logprobs, strict=True):
            elementwise = self._loss(request, datum.loss_fn_inputs, p, device)
            total = total + elementwise.sum()
            outputs.append({"logprobs": p.tolist(), "elementwise_loss": elementwise.tolist()})
        return total, outputs, {}

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

    @staticmethod
    def _batch(request: ForwardRequest, vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        lengths = [len(d.model_input) for d in request.data]
        tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        targets = torch.zeros_like(tokens)
        for i, datum in enumerate(request.data):
            if "target_tokens" not in datum.loss_fn_inputs:
                raise DomainError(400, "invalid_request", f"data[{i}].loss_fn_inputs needs target_tokens")
            row = datum.model_input
            target = [int(t) for t in datum.loss_fn_inputs["target_tokens"]]
            bad = [t for t in row + target if not 0 <= t < vocab]
            if bad:
                raise DomainError(400, "invalid_request", f"data[{i}] has token id {bad[0]} outside [0, {vocab})")
            tokens[i, : len(row)] = torch.tensor(row)
            targets[i, : len(row)] = torch.tensor(target)
        return tokens, targets, lengths

    @staticmethod
    def _loss(request: ForwardRequest, inputs: dict[str, list[float]], p: torch.Tensor, device) -> torch.Tensor:
        tensors = _tensors(inputs, device)
        try:
            return losses.elementwise_loss(request.loss_fn, p, tensors, request.loss_fn_config)
        except KeyError as exc:
            raise DomainError(400, "invalid_request", f"{request.loss_fn}: {exc.args[0]}") from exc

    # -- optimizer ------------------------------------------------------------------------------

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        trained = self.models[request.model_id]
        adam = request.adam_params
        for group in trained.optimizer.param_groups:
            group.update(adamw_kwargs(adam))
        params = [p for p in trained.params if p.grad is not None]
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        return OptimStepOutput(metrics={"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate})

    # -- weights in and out ---------------------------------------------------------------------

    def export_weights(self, model_id: str) -> LoraWeights:
        trained = self.models[model_id]
        return export_adapter(trained.base, trained.adapter)

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
