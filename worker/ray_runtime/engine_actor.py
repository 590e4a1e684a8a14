"""An engine replica as a Ray actor: one Engine (PyTorch, or vLLM where it imports) in its own process.

Every call names the incarnation the caller last synced; a replica Ray restarted has a new one and answers
Stale until the caller has replayed the models and snapshots into it (`restore`), so a restarted replica
never serves, or takes a sync for, state it does not hold."""

import os
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import ray
from ray.actor import ActorHandle

from schemas import CreateModelRequest, ErrorResponse, SampleOutput
from tinkerq.config import RuntimeConfig
from worker.ray_runtime import cluster
from worker.ray_runtime.boundary import Failed, Stale, guarded
from worker.ray_runtime.weight_group import GroupMember, WeightsMeta
from worker.runtime.base import Keyed

# (model id, base model, [(version, weights or a reference to them), ...] oldest first)
ModelRecord = tuple[str, str, list[tuple[int, Any]]]
_END = object()
NEED_TIMEOUT_S = 600.0  # the trainer rank's dry run (it loads the base first where it has not)


class EngineReplica:
    def __init__(self, config: RuntimeConfig, beside: ActorHandle | None = None,
                 devices: list[str] | None = None) -> None:
        """`beside`: the trainer rank on this replica's GPU, whose measured need sizes vLLM's share of it, as the
        in-process runtime's trainer does (TINKERQ_VLLM_GPU_MEMORY_UTILIZATION=auto). `devices`: the GPUs of a
        tensor-parallel engine (its own bundle's first), which vLLM's worker processes take one each."""
        if devices:  # before anything initialises CUDA here; Ray made only this bundle's GPU visible
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        cluster.configure_actor()
        from worker.torch_runtime.assembly import make_engine, set_threads
        from worker.torch_runtime.base_models import BaseModels

        set_threads(config)
        bases = BaseModels(config.device, config.dtype)
        need = None
        if beside is not None:
            def need(base_model: str) -> tuple[int, int]:
                asked = beside.trainer_need.remote(base_model, config.vllm_max_lora_rank)
                return ray.get(asked, timeout=NEED_TIMEOUT_S)
        self.engine = make_engine(config, bases, need)
        self.incarnation = uuid.uuid4().hex
        self.weights = GroupMember(bases.device)  # its place in the weights group (weight_group.py)

    def hello(self) -> tuple[str, int]:
        """This incarnation and its process id (the fault test kills that process)."""
        return self.incarnation, os.getpid()

    def _check(self, expect: str | None) -> None:
        if expect != self.incarnation:
            raise Stale(self.incarnation)

    def restore(self, models: list[ModelRecord]) -> str:
        """Hold exactly these models and snapshots (the caller's record of what every replica holds)."""
        for model_id in list(getattr(self.engine, "snapshots", {})):
            self.engine.remove_model(model_id)
        for model_id, base, versions in models:
            (first_version, first), *rest = versions
            self.engine.add_model(model_id, base, _resolved(first))
            if first_version != 0:
                # add_model names its weights version 0: apply the first live snapshot under its own version
                # too; the extra 0 is never asked for (the caller's record is what requests are pinned to).
                self.engine.apply_weights(model_id, first_version, _resolved(first))
            for version, weights in rest:
                self.engine.apply_weights(model_id, version, _resolved(weights))
        return self.incarnation

    def add_model(self, expect: str | None, model_id: str, base_model: str, weights: Any, version: int = 0) -> None:
        self._check(expect)
        self.engine.add_model(model_id, base_model, weights, version)

    def apply_weights(self, expect: str | None, model_id: str, version: int, weights: Any) -> None:
        self._check(expect)
        self.engine.apply_weights(model_id, version, weights)

    def weights_join(self, host: str, port: int, rank: int, world: int, generation: int, backend: str) -> None:
        self.weights.join(host, port, rank, world, generation, backend)

    def weights_leave(self) -> None:
        self.weights.leave()

    def weights_ready(self, expect: str | None) -> tuple[str | None, int]:
        """Before a sync: that this is the incarnation the caller synced (Stale if not), its GPU and its formation."""
        self._check(expect)
        return self.weights.gpu, self.weights.generation

    def receive_weights(self, expect: str | None, model_id: str, version: int, meta: WeightsMeta,
                        base_model: str | None) -> None:
        """Take trainer rank 0's export (by CUDA IPC or the group's broadcast): add the model (base_model given) or
        apply a snapshot as `version`."""
        self._check(expect)
        weights = self.weights.receive(meta)
        if base_model is not None:
            self.engine.add_model(model_id, base_model, weights, version)
        else:
            self.engine.apply_weights(model_id, version, weights)

    def restore_snapshot(self, expect: str | None, model_id: str, version: int, weights: Any) -> bool:
        self._check(expect)
        return self.engine.restore_snapshot(model_id, version, weights)

    def remove_model(self, expect: str | None, model_id: str) -> None:
        self._check(expect)
        self.engine.remove_model(model_id)

    def warm(self, base_model: str) -> Failed | None:
        return guarded(lambda: self.engine.warm(base_model))

    def check_base(self, base_model: str) -> Failed | None:
        return guarded(lambda: self.engine.check_base(base_model))

    def check_create(self, request: CreateModelRequest) -> Failed | None:
        return guarded(lambda: self.engine.check_create(request))

    def serve(self, expect: str | None, items: Keyed) -> Iterator[list[tuple[str, SampleOutput | ErrorResponse]]]:
        """(key, result) for each item, as soon as it is ready (a Ray streaming generator; those ready together in
        one list). The engine runs on a thread of its own, so that its continuous batching hands results out while
        it still decodes."""
        self._check(expect)
        results: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                self.engine.generate_stream(items, lambda key, result: results.put((key, result)))
                results.put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there
                results.put(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        item = None
        while item is not _END:
            # everything ready by now in one yield: each costs the caller a round trip through Ray
            ready, item = [], results.get()
            while item is not _END and not isinstance(item, BaseException):
                ready.append(item)
                try:
                    item = results.get_nowait()
                except queue.Empty:
                    item = None
                    break
            if ready:
                yield ready
            if isinstance(item, BaseException):
                raise item
        thread.join()


def _resolved(weights: Any) -> Any:
    """Weights nested in a list arrive as references (Ray resolves only top-level arguments)."""
    return ray.get(weights) if isinstance(weights, ray.ObjectRef) else weights
