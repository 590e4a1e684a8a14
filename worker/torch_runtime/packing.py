"""A request's datums as one flat token stream, cut into micro-batches of whole datums up to a token budget.

Datums are packed end to end without padding: a micro-batch is one row of tokens whose positions restart at
each datum, and whose boundaries (`cu_seqlens`) tell the attention where one sequence ends. Built with a few
tensor operations over the whole request, not per datum.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from schemas import Datum
from worker.runtime.base import DomainError


@dataclass(frozen=True)
class Flat:
    """Every datum's tokens and targets end to end; datum i is [starts[i], starts[i] + lengths[i])."""

    tokens: torch.Tensor  # [N] long
    targets: torch.Tensor  # [N] long
    lengths: list[int]
    starts: list[int]
    # loss_fn_inputs other than target_tokens, each key flattened over the datums that have it
    inputs: dict[str, "FlatInput"]

    def inputs_of(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v.values[v.starts[i]: v.starts[i] + self.lengths[i]] for k, v in self.inputs.items()
                if i in v.starts}


@dataclass(frozen=True)
class FlatInput:
    values: torch.Tensor  # float32, on the device
    starts: dict[int, int]  # datum index -> offset in values


@dataclass(frozen=True)
class MicroBatch:
    first: int  # datum indices [first, stop)
    stop: int
    start: int  # token offsets [start, end) in the flat stream
    end: int
    positions: torch.Tensor  # [n] long: position of each token in its own datum
    cu_seqlens: torch.Tensor  # [k + 1] int32: datum boundaries within the micro-batch
    max_len: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def flatten(data: list[Datum], vocab: int, device: torch.device) -> Flat:
    lengths = [len(d.model_input) for d in data]
    for i, d in enumerate(data):
        if "target_tokens" not in d.loss_fn_inputs:
            raise DomainError(400, "invalid_request", f"data[{i}].loss_fn_inputs needs target_tokens")
    tokens = torch.from_numpy(np.concatenate([d.model_input for d in data]).astype(np.int64))
    # truncated like int(), as Tinker's float lists hold ints
    targets = torch.from_numpy(np.concatenate([d.loss_fn_inputs["target_tokens"] for d in data]).astype(np.int64))
    starts = [0, *accumulate(lengths)][:-1]
    _check_range(tokens, targets, lengths, starts, vocab)
    return Flat(tokens, targets, lengths, starts, _flat_inputs(data, starts, device))


def _check_range(tokens: torch.Tensor, targets: torch.Tensor, lengths: list[int], starts: list[int],
                 vocab: int) -> None:
    both = torch.cat([tokens, targets])
    if int(both.min()) >= 0 and int(both.max()) < vocab:
        return
    for i, (s, n) in enumerate(zip(starts, lengths)):  # only on the error path: name the first bad datum
        row = torch.cat([tokens[s: s + n], targets[s: s + n]])
        bad = row[(row < 0) | (row >= vocab)]
        if len(bad):
            raise DomainError(400, "invalid_request", f"data[{i}] has token id {int(bad[0])} outside [0, {vocab})")


def _flat_inputs(data: list[Datum], starts: list[int], device: torch.device) -> dict[str, FlatInput]:
    keys = dict.fromkeys(k for d in data for k in d.loss_fn_inputs if k != "target_tokens")
    out = {}
    for key in keys:
        have = [i for i, d in enumerate(data) if key in d.loss_fn_inputs]
        # as float32, as torch.tensor(values, dtype=torch.float64).float() of the lists these once were
        values = torch.from_numpy(np.concatenate([data[i].loss_fn_inputs[key] for i in have]).astype(np.float32))
        offsets = [0, *accumulate(len(data[i].model_input) for i in have)][:-1]
        out[key] = FlatInput(values.to(device, non_blocking=True), dict(zip(have, offsets)))
    return out


def plan(lengths: list[int], token_budget: int) -> list[tuple[int, int]]:
    """Consecutive datums [first, stop) up to token_budget tokens each; a longer datum goes alone."""
    spans, first, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used and used + n > token_budget:
            spans.append((first, i))
            first, used = i, 0
        used += n
    spans.append((first, len(lengths)))
    return spans


def micro_batches(flat: Flat, token_budget: int, device: torch.device) -> Iterator[MicroBatch]:
    for first, stop in plan(flat.lengths, token_budget):
        lengths = torch.tensor(flat.lengths[first:stop])
        bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=bounds[1:])
        n = int(bounds[-1])
        positions = torch.arange(n) - torch.repeat_interleave(bounds[:-1].long(), lengths)
        start = flat.starts[first]
        yield MicroBatch(first, stop, start, start + n, positions.to(device, non_blocking=True),
                         bounds.to(device, non_blocking=True), int(lengths.max()))
