"""The PyTorch sampling engine: LoRA snapshots by version, batched generation across models."""

import secrets
from collections import OrderedDict, defaultdict

from schemas import ErrorResponse, GeneratedSequence, SampleOutput, SampleRequest, TopkLogprobs
from worker.runtime.base import DomainError, Engine, check_fits
from worker.torch_runtime.bases import BaseModels, LoadedBase, adapter_name
from worker.torch_runtime.lora_io import LoraWeights, import_adapter
from worker.torch_runtime.sampler import PromptScores, Row, Sampler


class TorchEngine(Engine):
    def __init__(self, bases: BaseModels, max_snapshots: int = 4) -> None:
        self.bases = bases
        self.max_snapshots = max_snapshots
        self.snapshots: dict[str, OrderedDict[int, str]] = {}
        self.base_of: dict[str, LoadedBase] = {}

    def add_model(self, model_id: str, base_model: str, weights: LoraWeights) -> None:
        self.remove_model(model_id)
        self.base_of[model_id] = self.bases.get(base_model)
        self.snapshots[model_id] = OrderedDict()
        self.apply_weights(model_id, 0, weights)

    def apply_weights(self, model_id: str, version: int, weights: LoraWeights) -> None:
        base, held = self.base_of[model_id], self.snapshots[model_id]
        name = adapter_name(model_id, version)
        import_adapter(base, name, weights)  # a copy: later training steps do not reach it
        held[version] = name
        while len(held) > self.max_snapshots:
            _, evicted = held.popitem(last=False)
            base.delete_adapter(evicted)

    def live_versions(self, model_id: str) -> list[int]:
        return list(self.snapshots.get(model_id, ()))

    def remove_model(self, model_id: str) -> None:
        base = self.base_of.pop(model_id, None)
        for name in self.snapshots.pop(model_id, {}).values():
            base.delete_adapter(name)

    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        results: list[SampleOutput | ErrorResponse | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            try:
                self._check(request)
                groups[self.base_of[request.model_id].name].append(i)
            except DomainError as exc:
                results[i] = exc.response()
        for indices in groups.values():
            for i, output in zip(indices, self._generate_group([requests[i] for i in indices])):
                results[i] = output
        return results

    def _check(self, request: SampleRequest) -> None:
        base = self.base_of[request.model_id]
        check_fits(request, base.model.config.max_position_embeddings, base.vocab_size)

    def _generate_group(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        base = self.base_of[requests[0].model_id]
        rows, owners = [], []
        for j, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is None:
                seed = secrets.randbits(62)
            adapter = self.snapshots[request.model_id][request.weights_version]
            for k in range(request.num_samples):  # sample k of a seeded request always gets seed + k
                rows.append(Row(request.prompt_tokens, adapter, request.sampling_params, seed + k))
                owners.append(j)
        topk = max(r.topk_prompt_logprobs for r in requests)
        want_scores = any(r.prompt_logprobs or r.topk_prompt_logprobs for r in requests)
        scores = Sampler(base.model, base.tokenizer, base.device).generate(rows, topk, want_scores)
        outputs = []
        for j, request in enumerate(requests):
            mine = [i for i, owner in enumerate(owners) if owner == j]
            outputs.append(self._output(request, [rows[i] for i in mine], scores[mine[0]]))
        return outputs

    @staticmethod
    def _output(request: SampleRequest, rows: list[Row], scores: PromptScores | None) -> SampleOutput:
        sequences = [GeneratedSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason=r.stop_reason) for r in rows]
        topk = None
        if scores is not None and request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            topk = TopkLogprobs(token_ids=[ids[:k] for ids in scores.topk_ids],
                                logprobs=[lps[:k] for lps in scores.topk_logprobs])
        return SampleOutput(
            sequences=sequences,
            prompt_logprobs=scores.logprobs if scores is not None and request.prompt_logprobs else None,
            topk_prompt_logprobs=topk,
            weights_version=request.weights_version,
        )
