"""The Trainer the Runtime sees: data-parallel trainer ranks (Ray actors) acting as one.

Every rank holds every model (same initialisation, same steps); a forward_backward is split over them along
the in-process trainer's micro-batches, and its gradients are summed over the ranks once every rank's share
succeeded (data_parallel.py says why the result is the in-process one exactly). Exported weights stay in Ray's
object store: what export_weights returns is a reference, handed to the engine replicas without passing through
this process."""

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
from worker.ray_runtime.data_parallel import assignment, merged, part
from worker.runtime.base import Trainer

CALL_TIMEOUT_S = 1800.0  # one training call; longer is an infrastructure fault (the consumer's RQ job fails)
# How a sync's weights reach the engine replicas, named for reports (bench/ray_scaling.py prints it): rank 0's
# export is a task return value, kept once by Ray (in its shared-memory object store; one under 100 KiB travels
# inline in the reply instead) and read by every replica. No CUDA IPC or NCCL yet.
WEIGHT_TRANSPORT = "ray-object-store"


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
        # the ranks' pass budget: a request is split along the micro-batches the in-process trainer would make
        self.micro_batch_tokens: int = _all([ranks[0].micro_batch_tokens.remote()])[0]

    def has_model(self, model_id: str) -> bool:
        return model_id in self._bases

    def base_model(self, model_id: str) -> str:
        return self._bases[model_id]

    def warm(self, base_model: str) -> None:
        _first_failure(_all([rank.warm.remote(base_model) for rank in self.ranks]))

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput:
        outputs = _all([rank.create_model.remote(request) for rank in self.ranks])
        _first_failure(outputs)
        self._bases[request.model_id] = outputs[0].base_model
        return outputs[0]

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        runs = assignment(request, self.micro_batch_tokens, len(self.ranks))
        outputs = _all([rank.forward.remote([part(request, span) for span in run], backward)
                        for rank, run in zip(self.ranks, runs)])
        if any(isinstance(out, Failed) for out in outputs):
            if backward:  # nothing was added to any rank's gradients yet: drop what the others computed
                _all([rank.discard.remote(request.model_id) for rank in self.ranks])
            _first_failure(outputs)
        if backward:
            _all([rank.commit.remote(request.model_id, [len(run) for run in runs]) for rank in self.ranks])
        return merged([out for rank_outputs in outputs for out in rank_outputs],
                      [b - a for run in runs for a, b in run])

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        outputs = _all([rank.optim_step.remote(request) for rank in self.ranks])
        _first_failure(outputs)
        return outputs[0]

    def remove_model(self, model_id: str) -> None:
        """Drop the model's adapter, optimizer and gradients on every rank (durable restore rebuilds it)."""
        _all([rank.remove_model.remote(model_id) for rank in self.ranks])
        self._bases.pop(model_id, None)

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
