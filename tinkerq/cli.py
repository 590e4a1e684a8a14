"""The `tinkerq` command."""

import logging
import os
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Ordered sample and weight-sync jobs for RL post-training, through Redis and RQ.",
                  no_args_is_help=True)

RedisUrl = Annotated[str, typer.Option("--redis-url", envvar="REDIS_URL", help="Redis to use")]


def _shards(spec: str | None) -> list[int] | None:
    if not spec:
        return None
    try:
        return [int(part) for part in spec.split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--shards takes a comma-separated list of integers, got {spec!r}") from exc


@app.command()
def worker(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    shards: Annotated[Optional[str], typer.Option(help="comma-separated shard ids; default: every shard")] = None,
    runtime: Annotated[Optional[str], typer.Option(
        help="auto (torch: a real model) | torch | reference (the test stand-in) | module:factory")] = None,
    engine: Annotated[Optional[str], typer.Option(help="torch runtime's engine: auto | vllm | torch")] = None,
    burst: Annotated[bool, typer.Option(help="exit once the queues are empty")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Run a long-lived worker: load the runtime once, then consume the shards it owns, in order."""
    from tinkerq.config import QueueConfig, RuntimeConfig
    from worker.main import WorkerProcess, connect, worker_name
    from worker.runtime.factory import build_runtime

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if runtime:
        os.environ["TINKERQ_RUNTIME"] = runtime
    if engine:
        os.environ["TINKERQ_ENGINE"] = engine
    config, name = QueueConfig(), worker_name()
    process = WorkerProcess(connect(redis_url, config, name), build_runtime(RuntimeConfig()), config,
                            shards=_shards(shards), name=name)
    process.run(burst=burst, logging_level=log_level)


@app.command()
def api(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    workers: Annotated[int, typer.Option(help="API processes sharing the port (they keep no state)")] = 1,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Serve the Tinker HTTP protocol (point the tinker SDK's base_url here)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Each process builds its own app (and Redis clients) from the environment, after the fork.
    os.environ["REDIS_URL"] = redis_url
    uvicorn.run("producer.api.app:app_from_env", factory=True, host=host, port=port, workers=workers,
                log_level=log_level.lower())


@app.command()
def demo(
    runtime: Annotated[str, typer.Option(help="torch (an RL loop) | reference (ordering only)")] = "torch",
    model: Annotated[str, typer.Option(help="base model for the torch runtime")] = "tinyq-micro",
    steps: Annotated[int, typer.Option(help="training steps")] = 30,
    workdir: Annotated[str, typer.Option(help="where logs, checkpoints and plots go")] = "demo-out",
) -> None:
    """Start a worker (and a Redis, if REDIS_URL is unset) and run a short loop through the queue."""
    from pathlib import Path

    from tinkerq.demo import run

    run(runtime, steps, Path(workdir), model)


@app.command()
def shard(model_id: str) -> None:
    """Print the shard a model id routes to (for the configured TINKERQ_NUM_SHARDS)."""
    from tinkerq.config import QueueConfig
    from tinkerq.keys import queue_name, shard_of

    k = shard_of(model_id, QueueConfig().num_shards)
    typer.echo(f"{k} {queue_name(k)}")


if __name__ == "__main__":
    app()
