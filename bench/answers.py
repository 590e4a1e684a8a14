"""What the queue benchmarks share: checking each answer they wait for, and latency percentiles.

A benchmark measures only answers that are the ones it asked for: anything else (an error, another kind of result,
nothing before the timeout) stops it with what came back, rather than a number measured over errors."""

import statistics
import sys
from pathlib import Path

from schemas.results import Result


class BenchFailed(SystemExit):
    """An answer the bench waited for was not the one asked for: stop with what came back (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{Path(sys.argv[0]).stem}: {message}")


def expect(result: Result | None, kind: str, what: str, timeout: float, log: Path | None = None) -> Result:
    """The answer, if it is a `kind` result; else stop the bench naming what came back (and the worker's log)."""
    see = f"; worker log: {log}" if log else ""
    if result is None:
        raise BenchFailed(f"{what}: no answer within {timeout:g} s{see}")
    if result.type == "error":
        raise BenchFailed(f"{what}: ErrorResponse {result.code} ({result.status}): {result.error}{see}")
    if result.type != kind:
        raise BenchFailed(f"{what}: expected a {kind} result, got {result.type}{see}")
    return result


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p90, p99, mean and max of latencies given in seconds, in milliseconds."""
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": statistics.median(ms), "p90_ms": ms[max(0, int(0.9 * len(ms)) - 1)],
            "p99_ms": ms[max(0, int(0.99 * len(ms)) - 1)], "mean_ms": statistics.fmean(ms), "max_ms": ms[-1]}
