"""No Docker engine runs here, so check docker-compose.yml against the CLI and the pins instead."""

import re
import shlex
from pathlib import Path

import click
import pytest
import typer.main
import yaml

from commands.cli import app
from worker.runtimes import RUNTIMES

ROOT = Path(__file__).resolve().parent.parent
SPEC = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = SPEC["services"]
TINKERQ = {name: s for name, s in SERVICES.items() if "build" in s}


def parse_cli(args: list[str]) -> tuple[str, dict]:
    """Parse args exactly as `tinkerq` would; raises click's UsageError on anything unknown."""
    group = typer.main.get_command(app)
    sub = group.get_command(click.Context(group), args[0])
    assert sub is not None, f"tinkerq has no command {args[0]!r}"
    return args[0], sub.make_context(args[0], list(args[1:])).params


def test_services_present():
    assert {"redis", "api", "worker", "dashboard"} <= set(SERVICES)


def test_redis_keeps_queued_work_across_restarts():
    command = SERVICES["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


@pytest.mark.parametrize("name", sorted(TINKERQ))
def test_tinkerq_services_run_real_cli_commands_against_the_compose_redis(name):
    service = TINKERQ[name]
    command, params = parse_cli(service["command"])
    env = service["environment"]
    assert params["redis_url"] == env["REDIS_URL"]
    assert re.match(r"redis://redis:6379/\d+$", env["REDIS_URL"])
    if command == "worker":
        assert params["runtime"] in RUNTIMES
    if command == "api":
        assert params["host"] == "0.0.0.0"
        assert f"{params['port']}:{params['port']}" in service["ports"]
        assert "TINKERQ_API_KEYS" in env  # compose refuses to start the API without keys


def test_every_tinkerq_service_agrees_on_the_shard_count():
    counts = {s["environment"]["TINKERQ_NUM_SHARDS"] for s in TINKERQ.values()}
    assert len(counts) == 1


def test_worker_reserves_a_gpu_and_gets_time_to_finish_its_job():
    worker = SERVICES["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert "stop_grace_period" in worker


def test_dashboard_uses_the_json_serializer_and_our_rq_pin():
    command = " ".join(SERVICES["dashboard"]["command"])
    args = shlex.split(command.split("&&")[-1])
    assert args[0] == "rq-dashboard" and "--json" in args
    assert args[args.index("-u") + 1] == TINKERQ["worker"]["environment"]["REDIS_URL"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in re.findall(r"(rq(?:-dashboard)?==[\d.]+)", command):
        assert pin in pyproject, f"dashboard installs {pin}, which pyproject.toml does not pin"


def test_image_entrypoint_is_the_cli():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tinkerq"]' in dockerfile
