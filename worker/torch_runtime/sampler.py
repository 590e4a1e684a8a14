"""Continuous batched generation with a KV cache over rows that may each use a different LoRA adapter.

Reported logprobs are those of the model's own distribution (temperature 1, no top-k/top-p), i.e.
exactly what the trainer's `forward` computes for the same tokens; temperature, top-k and top-p
only shape the distribution tokens are drawn from.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from schemas import SamplingParams


@dataclass
class Row:
    prompt: list[int]
    adapter: str
    params: SamplingParams
    seed: int
    owner: str = ""  # the request the row samples for
    want_prompt_scores: bool = False
    topk: int = 0  # prompt top-k alternatives, with the scores
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    scores: "PromptScores | None" = None


@dataclass
class PromptScores:
    logprobs: list[float | None]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


def _stop_ids(params: SamplingParams, eos_id: int | None) -> set[int]:
    if params.stop == []:
        return set()  # [] means never stop early, not even at EOS
    ids = {eos_id} if eos_id is not None else set()
    if params.stop and isinstance(params.stop[0], int):
        ids |= set(params.stop)
    return ids


def draw(logits: torch.Tensor, rows: list["Row"], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, all rows at once: temperature, top-k and top-p per row, then the Gumbel-max
    trick with noise from each row's own generator (so a seeded row draws the same tokens in any batch)."""
    width = logits.shape[-1]
    temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):  # the sort is the costly part
        scaled = scaled.masked_fill(~_nucleus(scaled, rows), float("-inf"))
    noise = torch.stack([torch.rand(width, generator=g, device=logits.device) for g in generators])
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    sampled = torch.argmax(scaled + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def _nucleus(scaled: torch.Tensor, rows: list["Row"]) -> torch.Tensor:
    """Which tokens each row may draw under its top-k and top-p."""
    width = scaled.shape[-1]
    ranked, order = torch.sort(scaled, dim=-1, descending=True)
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else width for r in rows], device=scaled.device)
    keep_sorted = ranked >= ranked.gather(-1, (top_k.clamp(max=width) - 1)[:, None])
    top_p = torch.tensor([r.params.top_p for r in rows], device=scaled.device)
    probs = torch.softmax(ranked.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    keep_sorted &= probs.cumsum(-1) - probs < top_p[:, None]  # keep the token that crosses p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@dataclass
class _Decoding:
    """The rows being decoded together, with their KV cache: row i owns index i of every tensor."""

    rows: list[Row]
    generators: list[torch.Generator]
    stops: list[set[int]]
    cache: object  # transformers' DynamicCache
    mask: torch.Tensor  # [rows, cache length]
    last_pos: torch.Tensor  # [rows]
    logits: torch.Tensor  # [rows, vocab]: the next token's distribution

    @property
    def mergeable(self) -> bool:
        """Whether rows can join and the cache be trimmed: every layer is a plain full-attention cache (a
        sliding-window layer keeps only its window, so its length is not the mask's)."""
        from transformers.cache_utils import DynamicLayer

        return all(isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False)
                   for layer in self.cache.layers)

    def keep(self, indices: list[int]) -> None:
        index = torch.tensor(indices, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in indices]
        self.generators = [self.generators[i] for i in indices]
        self.stops = [self.stops[i] for i in indices]
        self.mask, self.last_pos, self.logits = self.mask[index], self.last_pos[index], self.logits[index]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if indices and self.mergeable:  # columns only departed rows used (padding for all left) are dropped
            start = int(self.mask.any(dim=0).int().argmax())
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def join(self, other: "_Decoding") -> None:
        """Append another batch's rows; the shorter cache is left-padded (masked out) to the longer one."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.rows += other.rows
        self.generators += other.generators
        self.stops += other.stops
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, -2), _left_pad(theirs.keys, width, -2)])
            mine.values = torch.cat([_left_pad(mine.values, width, -2), _left_pad(theirs.values, width, -2)])
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(other.mask, width, -1)])
        self.last_pos = torch.cat([self.last_pos, other.last_pos])
        self.logits = torch.cat([self.logits, other.logits])


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Sampler:
    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def run(self, rows: list[Row], admit: Callable[[], list[Row]], finished: Callable[[list[Row]], None]) -> None:
        """Continuous batching: decode `rows` step by step, filling each row's tokens, logprobs, stop_reason
        and (if it asks) prompt scores in place; between steps, hand the rows that are done to `finished` and
        prefill the rows `admit` returns into the running batch, until no row is left."""
        batch = self._prefill(rows)
        can_join = batch.mergeable  # else (a sliding-window cache) the batch runs as it started
        while batch.rows:
            self._step_tokens(batch)
            if any(row.stop_reason is not None for row in batch.rows):
                finished([row for row in batch.rows if row.stop_reason is not None])
                batch.keep([i for i, row in enumerate(batch.rows) if row.stop_reason is None])
            if batch.rows:
                self._decode(batch)
            joining = admit() if can_join else []
            if joining and batch.rows:
                batch.join(self._prefill(joining))
            elif joining:
                batch = self._prefill(joining)

    def _prefill(self, rows: list[Row]) -> _Decoding:
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)  # left padding
            mask[i, width - len(row.prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_scores = any(r.want_prompt_scores for r in rows)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         **self._adapters(rows), use_cache=True, logits_to_keep=0 if want_scores else 1)
        if want_scores:
            self._prompt_scores(rows, out.logits, width)
        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in rows]
        return _Decoding(rows, generators, [_stop_ids(r.params, self.eos_id) for r in rows], out.past_key_values,
                         mask, positions[:, -1], out.logits[:, -1].float())

    def _step_tokens(self, batch: _Decoding) -> None:
        """Draw every row's next token and append it (which may end the row)."""
        next_ids = draw(batch.logits, batch.rows, batch.generators)
        chosen = torch.log_softmax(batch.logits, dim=-1).gather(-1, next_ids[:, None])[:, 0]
        for row, token, logprob, stop_ids in zip(batch.rows, next_ids.tolist(), chosen.tolist(), batch.stops):
            self._append(row, token, logprob, stop_ids)

    def _decode(self, batch: _Decoding) -> None:
        """One forward step over the rows still running, feeding each its last token."""
        last = torch.tensor([row.tokens[-1] for row in batch.rows], dtype=torch.long, device=self.device)
        ones = torch.ones((len(batch.rows), 1), dtype=torch.long, device=self.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        batch.last_pos = batch.last_pos + 1
        out = self.model(input_ids=last[:, None], attention_mask=batch.mask, position_ids=batch.last_pos[:, None],
                         past_key_values=batch.cache, **self._adapters(batch.rows), use_cache=True)
        batch.cache, batch.logits = out.past_key_values, out.logits[:, -1].float()

    def _adapters(self, rows: list[Row]) -> dict:
        """peft's per-row adapters; a base that has none yet is a plain model, and every row is a base row."""
        from peft import PeftModel

        return {"adapter_names": [r.adapter for r in rows]} if isinstance(self.model, PeftModel) else {}

    def _append(self, row: Row, token: int, logprob: float, stop_ids: set[int]) -> None:
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if token in stop_ids:
            row.stop_reason = "stop"
        elif row.params.stop and isinstance(row.params.stop[0], str):
            text = self.tokenizer.decode(row.tokens)
            if any(s in text for s in row.params.stop):
                row.stop_reason = "stop"
        if row.stop_reason is None and len(row.tokens) >= row.params.max_tokens:
            row.stop_reason = "length"

    @staticmethod
    def _prompt_scores(rows: list[Row], logits: torch.Tensor, width: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for i, row in enumerate(rows):
            if not row.want_prompt_scores:
                continue
            start = width - len(row.prompt)
            # position j of the prompt is predicted by the logits at j - 1; position 0 has no context
            predicting = logprobs[i, start: width - 1]
            targets = torch.tensor(row.prompt[1:], device=logprobs.device)
            values: list[float | None] = [None] + predicting.gather(-1, targets[:, None])[:, 0].tolist()
            ids, lps = [[]], [[]]
            if row.topk > 0:
                top = torch.topk(predicting, row.topk, dim=-1)
                ids += top.indices.tolist()
                lps += top.values.tolist()
            row.scores = PromptScores(values, ids, lps)
