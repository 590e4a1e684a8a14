"""The two interfaces a runtime is built from. PyTorch, vLLM and the reference model implement them."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from schemas import (
    CreateModelOutput,
    CreateModelRequest,
    CustomLoss,
    ErrorResponse,
    ForwardBackwardOutput,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepOutput,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
)


class DomainError(Exception):
    """A request that cannot be served as asked: answered with an ErrorResponse, never an RQ failure."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.retryable = status, code, retryable

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=str(self), status=self.status, code=self.code, retryable=self.retryable)


def unknown_model(model_id: str) -> DomainError:
    return DomainError(404, "unknown_model", f"model {model_id!r} does not exist on this worker (create it first)")


def check_fits(request: SampleRequest, context: int, vocab: int) -> None:
    """DomainError unless the request's prompt and completion fit the model's context and vocabulary."""
    if len(request.prompt_tokens) + request.sampling_params.max_tokens > context:
        raise DomainError(400, "context_exceeded",
                          f"prompt ({len(request.prompt_tokens)}) + max_tokens exceeds the context of {context}")
    bad = [t for t in request.prompt_tokens if t >= vocab]
    if bad:
        raise DomainError(400, "invalid_token", f"prompt token {bad[0]} is outside the vocabulary ({vocab})")


Keyed = list[tuple[str, SampleRequest]]  # requests with the key their result is handed back under
Done = Callable[[str, SampleOutput | ErrorResponse], None]
# More queued requests for a running batch, only those the predicate accepts ([] when there are none).
Admit = Callable[[Callable[[SampleRequest], bool]], Keyed]


T = TypeVar("T")


def servable(items: Keyed, done: Done, prepare: Callable[[SampleRequest], T]) -> list[tuple[str, SampleRequest, T]]:
    """The items `prepare` accepts, each with what it returned; a refused one (DomainError) is answered at once."""
    accepted = []
    for key, request in items:
        try:
            accepted.append((key, request, prepare(request)))
        except DomainError as exc:
            done(key, exc.response())
    return accepted


def in_order(serve: Callable[[Keyed, Done], None], requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
    """The results of a streaming `serve` over `requests`, as a list in their order."""
    results: dict[str, SampleOutput | ErrorResponse] = {}
    serve([(str(i), r) for i, r in enumerate(requests)], results.__setitem__)
    return [results[str(i)] for i in range(len(requests))]


class DurableCheckpoint(BaseModel):
    """A model's whole state on disk (Trainer.save_durable) and what the Runtime knew beside it: the version last
    applied and the archive of every persisted one. Recorded in the journal's base (worker/durability/journal.py)."""

    path: str
    applied: int
    persisted: dict[int, str] = {}


@dataclass
class PendingCheckpoint:
    """A model's whole state captured at one journal position (Runtime.capture), not yet on disk: `write` puts it
    there under a name, on a side thread where `off_thread` (the trainer copied it aside), else where the step runs."""

    writer: Callable[[str], str]
    applied: int
    persisted: dict[int, str]
    off_thread: bool

    def write(self, name: str) -> DurableCheckpoint | None:
        """The checkpoint written, or None where the trainer writes no durable state."""
        try:
            path = self.writer(name)
        except NotImplementedError:
            return None
        return DurableCheckpoint(path=path, applied=self.applied, persisted=self.persisted)


class Engine(ABC):
    """Batched generation over weight snapshots addressed by (model id, version)."""

    # `make_room` lends the trainer this engine's device memory (vLLM's sleep mode): no generation during a pass
    sleeps_for_training = False

    @abstractmethod
    def add_model(self, model_id: str, base_model: str, weights: Any, version: int = 0) -> None:
        """Register a model whose first version (0, or another when restored) is `weights` (as exported by the
        trainer)."""

    @abstractmethod
    def apply_weights(self, model_id: str, version: int, weights: Any) -> None:
        """Make `weights` servable as snapshot `version`, evicting the oldest beyond the engine's bound."""

    @abstractmethod
    def live_versions(self, model_id: str) -> list[int]:
        """Snapshot versions this engine can serve for the model, oldest first ([] if unknown)."""

    @abstractmethod
    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        """Serve every request from its own `weights_version`, all in one batch where possible.
        A request the engine cannot serve (too long for the context, ...) gets its own error."""

    def generate_stream(self, items: Keyed, done: Done, admit: Admit | None = None) -> None:
        """Serve `items`, handing each result to `done` once it is ready, and the requests that `admit` returns
        while serving. This default runs batch after batch: the items, then what `admit` returns, until it
        returns nothing. An engine that decodes step by step admits between steps (continuous batching)."""
        while items:
            for (key, _), result in zip(items, self.generate([r for _, r in items]), strict=True):
                done(key, result)
            items = admit(lambda request: True) if admit else []

    def snapshot_weights(self, model_id: str, version: int) -> Any | None:
        """A live snapshot's weights as the trainer exports them, for a durable checkpoint (None: this engine
        cannot give them back, so no checkpoint is written and the journal keeps every entry)."""
        return None

    def restore_snapshot(self, model_id: str, version: int, weights: Any) -> bool:
        """Serve an evicted version again (read back from its archive), without evicting any live one: never
        called while a batch runs, and the next sync's eviction bounds the count again. False: not possible here."""
        return False

    def warm(self, base_model: str) -> None:  # noqa: B027 - optional
        """Start what serving models of `base_model` needs (an engine, its weights) now rather than on first use:
        a standby warms the bases it may take over (worker/shards/preload.py). DomainError for a base not
        served here."""

    def check_base(self, base_model: str) -> None:
        """Raise DomainError unless this engine can serve samples of the bare base model (no adapter)."""
        raise DomainError(400, "unsupported", "this engine does not sample bare base models")

    def check_create(self, request: CreateModelRequest) -> None:  # noqa: B027 - optional
        """Raise DomainError if this engine could not serve the model (called before the trainer builds it)."""

    def remove_model(self, model_id: str) -> None:  # noqa: B027 - optional
        """Drop every snapshot of a model."""

    def make_room(self) -> None:  # noqa: B027 - optional
        """The trainer is about to run a forward pass: an engine that can lend it device memory until its own next
        call does (vLLM's sleep mode, `TINKERQ_VLLM_SLEEP_DURING_TRAINING`)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the engine's resources (processes, device memory, files)."""


class Trainer(ABC):
    root: Path  # where its checkpoints live (worker/runtime/paths.py lays them out)
    checkpoint_suffix = ".tar.gz"

    @abstractmethod
    def has_model(self, model_id: str) -> bool: ...

    @abstractmethod
    def create_model(self, request: CreateModelRequest) -> CreateModelOutput: ...

    @abstractmethod
    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput: ...

    @abstractmethod
    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput: ...

    @abstractmethod
    def export_weights(self, model_id: str) -> Any:
        """The current weights in the form this runtime's engine imports (in memory, no disk)."""

    @abstractmethod
    def save_sampler_weights(self, model_id: str, name: str) -> str:
        """Persist the current weights as a sampler snapshot; return its path."""

    @abstractmethod
    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str:
        """Persist weights (and optimizer state); return its path."""

    @abstractmethod
    def load_state(self, request: LoadStateRequest) -> LoadStateOutput: ...

    def base_model(self, model_id: str) -> str:
        return model_id

    def warm(self, base_model: str) -> None:  # noqa: B027 - optional
        """Load `base_model` now rather than at the first create or restore on it (a standby, worker/shards/preload.py).
        DomainError for a base this deployment does not serve."""

    @abstractmethod
    def remove_model(self, model_id: str) -> None:
        """Drop the model's adapter, optimizer and gradients (no error if it is not held)."""

    def save_durable(self, model_id: str, name: str, snapshots: dict[int, Any]) -> str:
        """Write everything the model is (weights, optimizer, config, pending gradients) and the weights of its
        live snapshots (`snapshots`: version -> exported weights) atomically; return its path. NotImplementedError:
        this trainer writes none, and durability rests on the journal alone."""
        raise NotImplementedError

    def durable_writer(self, model_id: str, snapshots: dict[int, Any]) -> Callable[[str], str] | None:
        """save_durable in two steps, for a write off the training thread: copy now everything it would write
        (host memory: the next step changes the live tensors), and return the function that writes that copy under
        a name (called on a side thread) and returns its path. None: this trainer copies nothing aside, so
        save_durable runs where the step runs."""
        return None

    def load_durable(self, model_id: str, path: str) -> dict[int, Any]:
        """Rebuild the model from save_durable's file; return the snapshots' weights. DomainError if unreadable."""
        raise NotImplementedError

    def read_sampler_weights(self, path: str) -> Any:
        """A persisted sampler snapshot's weights, as export_weights gives them (DomainError if unreadable)."""
        raise DomainError(410, "snapshot_evicted", "this runtime cannot read sampler snapshots back")

    def check_custom_loss(self, loss: CustomLoss) -> None:  # noqa: B027 - optional
        """Raise DomainError if forward_backward could not run this custom loss (it is compiled here)."""
