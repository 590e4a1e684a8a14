"""No Docker engine runs here, so check docker-compose.yml against the CLI and the pins instead."""

import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
import typer.main
import yaml

from commands.cli import app
from tinkerq.config import RuntimeConfig
from worker.runtime.registry import RUNTIMES, runtime_name

ROOT = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = SPEC["services"]
# the services whose process is `tinkerq` (the image's entrypoint, or a shell that execs it)
TINKERQ = {name: s for name, s in SERVICES.items()
           if "build" in s and "tinkerq" in " ".join(s.get("entrypoint", ["tinkerq"]))}
RAY = {name: s for name, s in SERVICES.items() if "ray" in s.get("profiles", [])}
DEFAULTED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def interpolated(value: str) -> str:
    """`value` as compose reads it with no variable set: ${VAR:-default} is the default, $$ a literal $."""
    assert "${" not in DEFAULTED.sub("", value), f"{value!r} names a variable without a default"
    return DEFAULTED.sub(lambda m: m.group(2), value).replace("$$", "$")


def flag(args: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in a command line."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


def parse_cli(args: list[str]) -> tuple[str, dict]:
    """Parse args exactly as `tinkerq` would; raises click's UsageError on anything unknown."""
    group = typer.main.get_command(app)
    sub = group.get_command(click.Context(group), args[0])
    assert sub is not None, f"tinkerq has no command {args[0]!r}"
    return args[0], sub.make_context(args[0], list(args[1:])).params


def test_services_present():
    assert {"redis", "api", "worker", "dashboard"} <= set(SERVICES)


def test_a_plain_compose_up_runs_what_it_ran_before_the_ray_profile():
    plain = {name for name, s in SERVICES.items() if not s.get("profiles")}
    assert plain == {"redis", "api", "worker", "dashboard"}
    assert set(RAY) == {"ray-head", "worker-ray"}


def test_redis_keeps_queued_work_across_restarts():
    command = SERVICES["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


@pytest.mark.parametrize("name", sorted(TINKERQ))
def test_tinkerq_services_run_real_cli_commands_against_the_compose_redis(name):
    service = TINKERQ[name]
    command, params = parse_cli([interpolated(arg) for arg in service["command"]])
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


def pyproject_extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("name", sorted(RAY))
def test_ray_services_share_an_image_with_the_ray_and_gpu_extras(name):
    extras = RAY[name]["build"]["args"]["EXTRAS"].split(",")
    assert {"ray", "vllm", "torch"} <= set(extras)
    assert set(extras) <= set(pyproject_extras()), "the image asks for an extra pyproject.toml does not define"
    # head and nodes must run the same Ray and Python: one image, built once
    assert len({s["image"] for s in RAY.values()}) == 1 and len({str(s["build"]) for s in RAY.values()}) == 1


def test_ray_head_starts_a_head_that_keeps_no_bundles():
    head = SERVICES["ray-head"]
    assert head["entrypoint"] == ["ray"]
    args = head["command"]
    assert args[0] == "start" and "--head" in args and "--block" in args  # --block: the container lives with it
    # no CPUs or GPUs on the head: the placement group lands on the node holding the GPUs
    assert flag(args, "--num-gpus") == "0" and flag(args, "--num-cpus") == "0"


def ray_worker_script() -> tuple[str, list[str]]:
    """worker-ray's shell script and its command line as the script's "$@" (after $0)."""
    entry = SERVICES["worker-ray"]["entrypoint"]
    assert entry[:2] == ["sh", "-c"] and len(entry) == 4, entry
    return interpolated(entry[2]), [interpolated(arg) for arg in SERVICES["worker-ray"]["command"]]


def test_ray_worker_joins_the_head_as_a_node_then_runs_the_worker_on_it():
    script, args = ray_worker_script()
    subprocess.run(["sh", "-n", "-c", script], check=True)  # a syntax error fails here, not in the container
    steps = [shlex.split(step) for step in script.split("&&")]
    assert len(steps) == 2, script
    join, run = steps
    assert join[:2] == ["ray", "start"] and "--head" not in join
    host, port = flag(join, "--address").rsplit(":", 1)
    assert host == "ray-head" and port == flag(SERVICES["ray-head"]["command"], "--port")
    assert run == ["exec", "tinkerq", "$@"]  # the command line below is what runs, whole
    command, params = parse_cli(args)
    assert command == "worker"
    # Ray Client (ray://) cannot carry streaming actor calls; "auto" is the node the script just started
    assert params["ray_address"] == "auto"
    assert params["shards"] == "auto"
    # the runtime those settings pick is the Ray runtime (with --runtime torch it once ran in process on one GPU)
    chosen = RuntimeConfig(runtime=params["runtime"], ray_gpus=params["gpus"], ray_address=params["ray_address"])
    assert runtime_name(chosen) == "ray"
    assert SERVICES["worker-ray"]["depends_on"]["ray-head"]


def test_ray_worker_reserves_as_many_gpus_as_it_places_bundles():
    worker = SERVICES["worker-ray"]
    _, args = ray_worker_script()
    gpus = parse_cli(args)[1]["gpus"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]
    assert int(interpolated(str(device["count"]))) == gpus > 1
    # the same variable sets both, so that one setting changes both
    assert DEFAULTED.search(str(device["count"])).group(1) == DEFAULTED.search(" ".join(worker["command"])).group(1)
    assert "stop_grace_period" in worker
