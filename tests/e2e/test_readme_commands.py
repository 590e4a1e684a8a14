"""Every command the README offers runs here, as a user runs it (a subprocess of this checkout), so none rots unseen:
`make bench` (bench/queue_overhead.py, in its quick mode), each `tinkerq` subcommand's `--help` (read from the CLI
app, so a new subcommand is covered without touching this file) and `make demo` (the RL demo, in a few steps)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from redis import Redis

from commands.cli import app

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = sorted(typer.main.get_command(app).commands)


def run(args: list[str], redis_url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if redis_url:
        env["REDIS_URL"] = redis_url
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def test_the_cli_has_the_subcommands_the_readme_names() -> None:
    assert {"worker", "api", "demo", "shards", "drain"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_help(command: str) -> None:
    """`tinkerq --help` and `tinkerq <command> --help` exit 0 with a usage line."""
    done = run(["-m", "commands.cli", *filter(None, [command]), "--help"])
    assert "Usage:" in done.stdout


@pytest.mark.slow
def test_bench_quick(r: Redis, redis_url: str, tmp_path: Path) -> None:
    """`make bench BENCH_ARGS=--quick`: every path answers (the bench stops on any answer it did not ask for) and
    the table and the JSON come out."""
    out = tmp_path / "queue_overhead.json"
    done = run(["bench/queue_overhead.py", "--quick", "--out", str(out)], redis_url, timeout=180)
    for line in ("bare RQ no-op", "tinkerq sample", "p50 ratio tinkerq / bare RQ", "a round of 8 requests",
                 f"wrote {out}"):
        assert line in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["quick"] and report["n"] == 25 and report["batch_round"]["rounds"] == 3
    assert report["tinkerq"]["p50_ms"] > 0 and report["bare_rq"]["p50_ms"] > 0
    assert report["enqueue_per_s"]["tinkerq"] > 0


@pytest.mark.slow
def test_tenant_latency_quick(r: Redis, redis_url: str, tmp_path: Path) -> None:
    """bench/tenant_latency.py --quick (docs/benchmarks.md): both tenants' paths answer on both schedules, the
    table, the JSON, the histogram and the lanes' timeline come out."""
    out = tmp_path / "tenant_latency.json"
    done = run(["bench/tenant_latency.py", "--quick", "--out", str(out)], redis_url, timeout=300)
    for line in ("idle", "training back to back", "B's p99, A training / A idle", f"wrote {out}"):
        assert line in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["quick"] and set(report["schedules"]) == {"serial", "lanes"}
    for row in report["schedules"].values():
        assert row["a_ops"]["p50_ms"] > 0 and row["b_busy"]["p99_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert out.with_name("tenant_latency-timeline.png").stat().st_size > 0


@pytest.mark.slow
def test_demo_quick(r: Redis, redis_url: str, tmp_path: Path) -> None:
    """`make demo` in three steps: the worker loads the README's model, the RL loop runs through the queue and
    writes its reward curve."""
    done = run(["-m", "commands.cli", "demo", "--model", "tinyq-micro", "--steps", "3", "--workdir", str(tmp_path)],
               redis_url, timeout=300)
    assert "mean reward: first 3 steps" in done.stdout, done.stdout
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
