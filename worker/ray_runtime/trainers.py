"""The Trainer the Runtime sees: data-parallel trainer ranks (Ray actors) acting as one.

Every rank holds every model (same initialisation, same steps); a forward_backward is split over them by
tokens, and its gradients are summed at optim_step. Exported weights stay in Ray's object store: what
export_weights returns is a reference, handed to the engine replicas without passing through this process."""

from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from schemas import (
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
from worker.ray_runtime.boundary import Failed, unwrap
from worker.ray_runtime.data_parallel import merged, slices
from worker.runtime.base import Trainer

CALL_TIMEOUT_S = 1800.0  # one training call; longer is an infrastructure fault (the consumer's RQ job fails)


def _all(refs: list[ray.ObjectRef]) -> list[Any]:
    return ray.get(refs, timeout=CALL_TIMEOUT_S)


def _first_failure(values: list[Any]) -> None:
    for value in values:
        unwrap(value)


class RayTrainer(Trainer):
    def __init__(self, ranks: list[ActorHandle], checkpoint_root: Path) -> None:
        self.ranks = ranks
        self.root = checkpoint_root.resolve()
        self._bases: dict[str, str] = {}

    def has_model(self, model_id: str) -> bool:
        return model_id in self._bases

    def base_model(self, model_id: str) -> str:
        return self._bases[model_id]

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput:
        outputs = _all([rank.create_model.remote(request) for rank in self.ranks])
        _first_failure(outputs)
        self._bases[request.model_id] = outputs[0].base_model
        return outputs[0]

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        parts = [(rank, request.model_copy(update={"data": request.data[a:b]}), b - a)
                 for rank, (a, b) in zip(self.ranks, slices(request, len(self.ranks))) if b > a]
        outputs = _all([rank.forward.remote(part, backward) for rank, part, _ in parts])
        if any(isinstance(out, Failed) for out in outputs):
            if backward:  # the ranks whose slice went through take back its gradients, as one trainer would
                _all([rank.rollback.remote(request.model_id)
                      for (rank, _, _), out in zip(parts, outputs) if not isinstance(out, Failed)])
            _first_failure(outputs)
        return merged(outputs, [n for _, _, n in parts])

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        outputs = _all([rank.optim_step.remote(request) for rank in self.ranks])
        _first_failure(outputs)
        return outputs[0]

    def export_weights(self, model_id: str) -> ray.ObjectRef:
        return self.ranks[0].export_weights.remote(model_id)  # a reference, owned by this process

    def save_sampler_weights(self, model_id: str, name: str) -> str:
        return unwrap(_all([self.ranks[0].save_sampler_weights.remote(model_id, name)])[0])

    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str:
        return unwrap(_all([self.ranks[0].save_state.remote(model_id, name, include_optimizer)])[0])

    def load_state(self, request: LoadStateRequest) -> LoadStateOutput:
        outputs = _all([rank.load_state.remote(request) for rank in self.ranks])
        _first_failure(outputs)
        self._bases[request.model_id] = outputs[0].base_model
        return outputs[0]

    def check_custom_loss(self, loss: CustomLoss) -> None:
        unwrap(_all([self.ranks[0].check_custom_loss.remote(loss)])[0])
