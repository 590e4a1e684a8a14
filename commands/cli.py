"""The `tinkerq` command."""

import logging
import os
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:  # the CLI imports the worker only when a command runs it
    from worker.runtime.base import Engine

app = typer.Typer(help="Ordered sample and weight-sync jobs for RL post-training, through Redis and RQ.",
                  no_args_is_help=True)

RedisUrl = Annotated[str, typer.Option("--redis-url", envvar="REDIS_URL", help="Redis to use")]


def _shards(spec: str | None) -> list[int] | None:
    if not spec or spec == "auto":
        return None
    try:
        return [int(part) for part in spec.split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--shards takes a comma-separated list of integers, got {spec!r}") from exc


@app.command()
def worker(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    shards: Annotated[Optional[str], typer.Option(
        help="comma-separated shard ids, or auto: split every shard evenly with the other auto workers and "
             "rebalance as workers join and leave; default: every shard it can take")] = None,
    runtime: Annotated[Optional[str], typer.Option(
        help="auto (torch: a real model) | torch | reference (the test stand-in) | module:factory")] = None,
    engine: Annotated[Optional[str], typer.Option(help="torch runtime's engine: auto | vllm | torch")] = None,
    gpus: Annotated[Optional[int], typer.Option(
        min=1, help="span this many devices on Ray (the ray runtime): one bundle each of a placement group "
                    "(GPUs where the cluster has them, else CPUs)")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        help="join this Ray cluster (auto: the one this host is a node of, after `ray start`) rather than start "
             "one; not ray:// (Ray Client cannot stream the replicas' results)")] = None,
    burst: Annotated[bool, typer.Option(help="exit once the queues are empty")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Run a long-lived worker: load the runtime once, then consume the shards it owns, in order."""
    from tinkerq.config import QueueConfig, RuntimeConfig
    from worker.main import WorkerProcess, connect, worker_name
    from worker.runtime.registry import build_runtime

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if runtime:
        os.environ["TINKERQ_RUNTIME"] = runtime
    if engine:
        os.environ["TINKERQ_ENGINE"] = engine
    if gpus:
        os.environ["TINKERQ_RAY_GPUS"] = str(gpus)
    if ray_address:
        os.environ["TINKERQ_RAY_ADDRESS"] = ray_address
    loaded = build_runtime(RuntimeConfig())
    try:
        config, name = QueueConfig(), worker_name()
        process = WorkerProcess(connect(redis_url, config, name), loaded, config, shards=_shards(shards), name=name,
                                balanced=shards == "auto")
        process.run(burst=burst, logging_level=log_level)
    finally:
        _close(loaded.engine)


def _close(engine: "Engine", timeout_s: float = 30.0) -> None:
    """Release the engine's processes (vLLM's, Ray's actors and cluster), bounded: a wedged one must not keep
    the worker from exiting."""
    import threading

    closing = threading.Thread(target=engine.close, name="tinkerq-close", daemon=True)
    closing.start()
    closing.join(timeout_s)
    if closing.is_alive():
        logging.getLogger(__name__).warning("the engine did not close in %.0f s; exiting without it", timeout_s)


@app.command()
def api(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    workers: Annotated[int, typer.Option(help="API processes sharing the port (they keep no state)")] = 1,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Serve the Tinker HTTP protocol (point the tinker SDK's base_url here)."""
    import signal

    import uvicorn

    from producer.api.settings import ApiSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Each process builds its own app (and Redis clients) from the environment, after the fork.
    os.environ["REDIS_URL"] = redis_url
    # uvicorn re-raises the SIGTERM it stopped on once it has put back the handler it found: with the default one a
    # clean stop would end with status -15. A stop asked for exits 0, as the worker's does.
    signal.signal(signal.SIGTERM, _stopped)
    # Without a bound uvicorn waits for every open request before it stops (the app answers its long polls at the
    # signal; this covers a request stuck on a frozen Redis).
    uvicorn.run("producer.api.app:app_from_env", factory=True, host=host, port=port, workers=workers,
                log_level=log_level.lower(), timeout_graceful_shutdown=ApiSettings().api_stop_grace_s)


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)


@app.command()
def demo(
    runtime: Annotated[str, typer.Option(help="torch (an RL loop) | reference (ordering only)")] = "torch",
    model: Annotated[str, typer.Option(help="base model for the torch runtime")] = "tinyq-micro",
    steps: Annotated[int, typer.Option(help="training steps")] = 30,
    workdir: Annotated[str, typer.Option(help="where logs, checkpoints and plots go")] = "demo-out",
) -> None:
    """Start a worker (and a Redis, if REDIS_URL is unset) and run a short loop through the queue."""
    from pathlib import Path

    from commands.demo import run

    run(runtime, steps, Path(workdir), model)


@app.command()
def shard(model_id: str) -> None:
    """Print the shard a model id routes to (for the configured TINKERQ_NUM_SHARDS)."""
    from tinkerq.config import QueueConfig
    from tinkerq.keys import queue_name, shard_of

    k = shard_of(model_id, QueueConfig().num_shards)
    typer.echo(f"{k} {queue_name(k)}")


@app.command()
def shards(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per shard, in a list")] = False,
) -> None:
    """Each shard's owner, fencing epoch, queue depth, in-flight and held jobs, and models."""
    import json

    from redis import Redis

    from tinkerq.config import QueueConfig
    from tinkerq.shards import shard_rows, table

    rows = shard_rows(Redis.from_url(redis_url, socket_timeout=10), QueueConfig().num_shards)
    typer.echo(json.dumps([row.as_dict() for row in rows], indent=2) if as_json else table(rows))


@app.command()
def drain(
    worker_name: Annotated[str, typer.Argument(metavar="WORKER", help="the worker's name (`tinkerq shards` owner)")],
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    timeout: Annotated[float, typer.Option(help="seconds to wait for it to finish")] = 600.0,
) -> None:
    """Drain a worker: it finishes the job in hand, checkpoints every model it holds, releases its shards and exits
    0; the other workers take the shards at once."""
    import time

    from redis import Redis

    from tinkerq.config import QueueConfig
    from tinkerq.shards import drained, owned_by, request_drain, shard_rows

    connection = Redis.from_url(redis_url, socket_timeout=10)
    num_shards = QueueConfig().num_shards
    held = owned_by(shard_rows(connection, num_shards), worker_name)
    from rq import Worker

    registered = any(w.name.startswith(f"{worker_name}-") for w in Worker.all(connection=connection))
    if not held and not registered:
        typer.echo(f"no worker named {worker_name!r} holds a shard or is registered (see `tinkerq shards`)", err=True)
        raise typer.Exit(2)
    request_drain(connection, worker_name)
    typer.echo(f"draining {worker_name} (shards {held})")
    deadline = time.monotonic() + timeout
    while not drained(connection, worker_name, num_shards):
        if time.monotonic() > deadline:
            typer.echo(f"{worker_name} has not drained within {timeout:g} s", err=True)
            raise typer.Exit(1)
        time.sleep(0.2)
    typer.echo(f"{worker_name} drained and released shards {held}")
    deadline = time.monotonic() + 10  # the other workers take free shards within a tick: report who did
    while time.monotonic() < deadline:
        owners = {row.shard: row.owner for row in shard_rows(connection, num_shards) if row.shard in held}
        if all(owners.values()):
            break
        time.sleep(0.2)
    typer.echo(f"owners now: {owners}")


if __name__ == "__main__":
    app()
