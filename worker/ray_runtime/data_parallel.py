"""Splitting one forward_backward over trainer ranks and putting the answers back together. The loss of a
request is the sum of its datums' (as the SDK totals it), so contiguous slices whose gradients are summed
give the gradient of the whole."""

from schemas import ForwardBackwardOutput, ForwardRequest


def slices(request: ForwardRequest, ranks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) datum ranges, one per rank, of about equal token counts; a rank may get none."""
    sizes = [len(d.model_input) for d in request.data]
    total, bounds, start, acc = sum(sizes), [], 0, 0
    for rank in range(ranks):
        target = total * (rank + 1) / ranks
        end = start
        while end < len(sizes) and (rank == ranks - 1 or acc + sizes[end] / 2 <= target):
            acc += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds


def merged(outputs: list[ForwardBackwardOutput], datums: list[int]) -> ForwardBackwardOutput:
    """The ranks' outputs (in datum order, with how many datums each had) as one: per-datum outputs
    concatenated, metrics summed, those keyed `:mean` weighted by datums (the SDK's custom-loss totals)."""
    total = sum(datums)
    metrics: dict[str, float] = {}
    for out, n in zip(outputs, datums):
        for key, value in out.metrics.items():
            share = value * n / total if key.endswith(":mean") else value
            metrics[key] = metrics.get(key, 0.0) + share
    return ForwardBackwardOutput(loss_fn_outputs=[o for out in outputs for o in out.loss_fn_outputs],
                                 metrics=metrics)
