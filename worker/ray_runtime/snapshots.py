"""The facade's record of what every engine replica holds: per model, its base and the references of its live
snapshots, oldest first, evicted as the replicas evict them. A replica Ray restarts is rebuilt from it."""

from collections import OrderedDict
from typing import Any

from worker.ray_runtime.engine_actor import ModelRecord


class SnapshotRecord:
    def __init__(self, max_snapshots: int) -> None:
        self.max_snapshots = max_snapshots
        self._bases: dict[str, str] = {}
        self._live: dict[str, OrderedDict[int, Any]] = {}

    def add_model(self, model_id: str, base_model: str, weights: Any, version: int = 0) -> None:
        self._bases[model_id] = base_model
        self._live[model_id] = OrderedDict()
        self.apply(model_id, version, weights)

    def apply(self, model_id: str, version: int, weights: Any) -> None:
        live = self._live[model_id]
        live[version] = weights  # holding the reference keeps the tensors in Ray's object store
        while len(live) > self.max_snapshots:
            live.popitem(last=False)

    def restore(self, model_id: str, version: int, weights: Any) -> None:
        """An evicted version served again (read back from its archive), evicting none: the next apply bounds
        the count again, as the engines do."""
        self._live[model_id][version] = weights

    def drop(self, model_id: str, version: int) -> None:
        self._live.get(model_id, {}).pop(version, None)

    def weights(self, model_id: str, version: int) -> Any:
        return self._live[model_id][version]

    def remove(self, model_id: str) -> None:
        self._bases.pop(model_id, None)
        self._live.pop(model_id, None)

    def versions(self, model_id: str) -> list[int]:
        return list(self._live.get(model_id, ()))

    def records(self) -> list[ModelRecord]:
        return [(m, self._bases[m], list(live.items())) for m, live in self._live.items()]
