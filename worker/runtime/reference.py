"""A deterministic stand-in model for testing queue semantics without torch.

Its "weights" are the number of optimizer steps taken. Every sampled token is the weights version
it was served from, so a test can read off exactly which snapshot served each sample.
"""

import json
import time
from collections import OrderedDict
from pathlib import Path

from schemas import (
    CreateModelOutput,
    CreateModelRequest,
    ForwardBackwardOutput,
    ForwardRequest,
    GeneratedSequence,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepOutput,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
)
from worker.runtime import paths
from worker.runtime.base import DomainError, Engine, Trainer


class ReferenceTrainer(Trainer):
    checkpoint_suffix = ".json"

    def __init__(self, checkpoint_root: Path) -> None:
        self.root = checkpoint_root
        self.steps: dict[str, int] = {}
        self.pending_grads: dict[str, int] = {}
        self.bases: dict[str, str] = {}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.steps

    def base_model(self, model_id: str) -> str:
        return self.bases[model_id]

    def remove_model(self, model_id: str) -> None:
        for held in (self.steps, self.pending_grads, self.bases):
            held.pop(model_id, None)

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput:
        self.bases[request.model_id] = request.base_model
        self.steps[request.model_id] = 0
        self.pending_grads[request.model_id] = 0
        rank = request.lora.rank if request.lora else None
        return CreateModelOutput(model_id=request.model_id, base_model=request.base_model, lora_rank=rank)

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        step = self.steps[request.model_id]
        logprob = -1.0 / (1 + step)
        outputs = [{"logprobs": [logprob] * len(d.model_input)} for d in request.data]
        # Python floats (tolist): a sum past float64's range is inf, as it always was, not a numpy overflow warning
        loss = -sum(logprob * sum(d.loss_fn_inputs["weights"].tolist() if "weights" in d.loss_fn_inputs
                                  else [1.0] * len(d.model_input)) for d in request.data)
        if backward:
            self.pending_grads[request.model_id] += len(request.data)
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": loss, "step:max": float(step)})

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        self.steps[request.model_id] += 1
        datums, self.pending_grads[request.model_id] = self.pending_grads[request.model_id], 0
        return OptimStepOutput(metrics={"step:max": float(self.steps[request.model_id]), "datums:sum": float(datums)})

    def export_weights(self, model_id: str) -> dict:
        return {"step": self.steps[model_id]}

    def _write(self, model_id: str, kind: str, name: str) -> str:
        path = paths.checkpoint_file(self.root, model_id, kind, name, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model_id": model_id, "step": self.steps[model_id],
                                   "base_model": self.bases[model_id]}))
        tmp.rename(path)
        return str(path)

    def save_sampler_weights(self, model_id: str, name: str) -> str:
        return self._write(model_id, "sampler_weights", name)

    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str:
        return self._write(model_id, "weights", name)

    def save_durable(self, model_id: str, name: str, snapshots: dict[int, dict]) -> str:
        path = paths.checkpoint_file(self.root, model_id, "durable", name, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model_id": model_id, "step": self.steps[model_id],
                                   "base_model": self.bases[model_id],
                                   "pending_grads": self.pending_grads[model_id],
                                   "snapshots": {str(v): w for v, w in snapshots.items()}}))
        tmp.rename(path)
        return str(path)

    def load_durable(self, model_id: str, path: str) -> dict[int, dict]:
        try:
            state = json.loads(Path(path).read_text())
            self.steps[model_id], self.pending_grads[model_id] = int(state["step"]), int(state["pending_grads"])
            self.bases[model_id] = state["base_model"]
            return {int(v): dict(w) for v, w in state["snapshots"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.remove_model(model_id)
            raise DomainError(404, "checkpoint_unreadable", f"cannot load durable checkpoint {path!r}: {exc}") from exc

    def read_sampler_weights(self, path: str) -> dict:
        try:
            return {"step": int(json.loads(Path(path).read_text())["step"])}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DomainError(404, "checkpoint_unreadable", f"cannot read snapshot {path!r}: {exc}") from exc

    def load_state(self, request: LoadStateRequest) -> LoadStateOutput:
        try:
            state = json.loads(paths.resolve(self.root, request.path, ".json").read_text())
            step = int(state["step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DomainError(404, "checkpoint_unreadable", f"cannot load checkpoint {request.path!r}: {exc}") from exc
        self.steps[request.model_id] = step
        self.pending_grads[request.model_id] = 0
        self.bases[request.model_id] = request.base_model or state.get("base_model", "reference")
        return LoadStateOutput(model_id=request.model_id, path=request.path, optimizer=request.optimizer,
                               base_model=self.bases[request.model_id])


class ReferenceEngine(Engine):
    def __init__(self, max_snapshots: int = 4, delay_per_token_s: float = 0.0) -> None:
        self.max_snapshots = max_snapshots
        self.delay_per_token_s = delay_per_token_s
        self.snapshots: dict[str, OrderedDict[int, dict]] = {}
        self.batches: list[int] = []  # sizes of the batches generate() was given, for tests and benchmarks

    def add_model(self, model_id: str, base_model: str, weights: dict, version: int = 0) -> None:
        self.snapshots[model_id] = OrderedDict({version: weights})

    def snapshot_weights(self, model_id: str, version: int) -> dict:
        return dict(self.snapshots[model_id][version])

    def restore_snapshot(self, model_id: str, version: int, weights: dict) -> bool:
        self.snapshots[model_id][version] = weights
        return True

    def apply_weights(self, model_id: str, version: int, weights: dict) -> None:
        held = self.snapshots[model_id]
        held[version] = weights
        while len(held) > self.max_snapshots:
            held.popitem(last=False)

    def live_versions(self, model_id: str) -> list[int]:
        return list(self.snapshots.get(model_id, ()))

    def remove_model(self, model_id: str) -> None:
        self.snapshots.pop(model_id, None)

    def check_base(self, base_model: str) -> None:
        """The stand-in's base model is the untrained one: step 0."""

    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        self.batches.append(len(requests))
        longest = max(r.sampling_params.max_tokens for r in requests)
        if self.delay_per_token_s:
            time.sleep(self.delay_per_token_s * longest)
        return [self._one(r) for r in requests]

    def _one(self, request: SampleRequest) -> SampleOutput:
        version = request.weights_version
        step = 0 if request.base_model is not None else self.snapshots[request.model_id][version]["step"]
        n = request.sampling_params.max_tokens
        sequence = GeneratedSequence(tokens=[version] * n, logprobs=[-1.0 / (1 + step)] * n, stop_reason="length")
        prompt_logprobs = None
        if request.prompt_logprobs:
            prompt_logprobs = [None] + [-1.0 / (1 + step)] * (len(request.prompt_tokens) - 1)
        return SampleOutput(
            sequences=[sequence] * request.num_samples, prompt_logprobs=prompt_logprobs, weights_version=version
        )
