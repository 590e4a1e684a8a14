"""Splitting one forward_backward over trainer ranks and putting the answers back together.

The unit of data parallelism is the in-process trainer's own micro-batch (`packing.plan` at the same token
budget): rank r runs a contiguous run of the request's micro-batches, each exactly as the single-process trainer
would, and the gradients are summed micro-batch by micro-batch in the request's order, as that trainer
accumulates them. So the data-parallel result is the in-process one by construction, not to a tolerance: the
same float32 operations on the same values in the same order. A request of one micro-batch runs on one rank."""

import torch

from schemas import ForwardBackwardOutput, ForwardRequest
from worker.torch_runtime.packing import plan

Span = tuple[int, int]  # datums [first, stop) of one micro-batch


def assignment(request: ForwardRequest, token_budget: int, ranks: int) -> list[list[Span]]:
    """The request's micro-batches, as contiguous runs one per rank of about equal token counts, in order
    (rank 0 the first run); a rank may get none. One rank gets the whole request as one part: the in-process
    trainer's own call, which cuts its micro-batches itself (one call instead of one per micro-batch)."""
    if ranks == 1:
        return [[(0, len(request.data))]]
    lengths = [len(d.model_input) for d in request.data]
    spans = plan(lengths, token_budget)
    sizes = [sum(lengths[a:b]) for a, b in spans]
    total, runs, acc, k = sum(sizes), [], 0, 0
    for rank in range(ranks):
        target = total * (rank + 1) / ranks
        run = []
        while k < len(spans) and (rank == ranks - 1 or acc + sizes[k] / 2 <= target):
            acc += sizes[k]
            run.append(spans[k])
            k += 1
        runs.append(run)
    return runs


def part(request: ForwardRequest, span: Span) -> ForwardRequest:
    """One micro-batch of the request as a request of its own (it fits the budget: one pass)."""
    return request.model_copy(update={"data": request.data[span[0]: span[1]]})


def merged(outputs: list[ForwardBackwardOutput], datums: list[int]) -> ForwardBackwardOutput:
    """The micro-batches' outputs (in request order, with how many datums each had) as one. `loss:sum` is the
    float32 sum of the passes' float32 totals, as the in-process trainer adds them (`packed_forward._outputs`);
    a custom loss's metrics are summed (those keyed `:mean` weighted by datums), in float64 as the SDK does."""
    if len(outputs) == 1:
        return outputs[0]  # one part: the in-process trainer's own answer, as it gave it
    total = sum(datums)
    metrics: dict[str, float] = {}
    for out, n in zip(outputs, datums):
        for key, value in out.metrics.items():
            if key == "loss:sum":
                continue
            share = value * n / total if key.endswith(":mean") else value
            metrics[key] = metrics.get(key, 0.0) + share
    loss = torch.tensor([out.metrics["loss:sum"] for out in outputs], dtype=torch.float32).sum().item()
    return ForwardBackwardOutput(loss_fn_outputs=[o for out in outputs for o in out.loss_fn_outputs],
                                 metrics={"loss:sum": loss, **metrics})
