"""The base models a deployment serves, by the names its clients use (TINKERQ_BASE_MODELS).

Each entry is a built-in local model (`tinyq-micro`, `randq-0.5b`, `smollm2`, ...), an HF-format directory,
or `name=path`: a directory served under a name of the operator's choosing (e.g. `Qwen/Qwen3-8B=/models/q3`,
so clients keep the names their recipes know). The API advertises exactly these and accepts only them; a
worker builds or loads only these. Unset: every built-in local model.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tinkerq import local_models


class CatalogSettings(BaseSettings):
    """The base models a deployment serves. The API and the workers must be started with the same list."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    base_models: str = Field("", description=(
        "Comma-separated: built-in local model names (`tinyq-micro`, `randq-0.5b`, `smollm2`, ...), HF-format "
        "directories, or `name=path` (a directory served under a name of the operator's choosing, e.g. "
        "`Qwen/Qwen3-8B=/models/q3`). The API advertises exactly these and accepts only them; a worker builds or "
        "loads only these. Empty: every built-in local model."))


class UnknownBaseModel(ValueError):
    pass


@dataclass(frozen=True)
class BaseModelCatalog:
    entries: dict[str, str | None]  # name -> its directory, or None for a built-in built on first use

    @classmethod
    def parse(cls, spec: str) -> "BaseModelCatalog":
        if not spec.strip():
            return cls({name: None for name in (*local_models.LOCAL_MODELS, *local_models.PACKAGED_MODELS)})
        entries: dict[str, str | None] = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            name, _, path = item.partition("=")
            name, path = name.strip(), path.strip()
            if not path and name not in local_models.LOCAL_MODELS and name not in local_models.PACKAGED_MODELS:
                path = name  # a bare directory is served under its own path
            if path and not (Path(path) / "config.json").is_file():
                raise ValueError(f"TINKERQ_BASE_MODELS: {path!r} (for {name!r}) is not an HF-format directory")
            entries[name] = path or None
        if not entries:
            raise ValueError("TINKERQ_BASE_MODELS lists no model")
        return cls(entries)

    @classmethod
    def from_env(cls) -> "BaseModelCatalog":
        return cls.parse(CatalogSettings().base_models)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def path(self, name: str) -> Path:
        """The model's HF directory (a built-in one is built and cached on first use)."""
        if name not in self.entries:
            raise UnknownBaseModel(f"unknown model {name!r}: not a base model this deployment serves; it serves "
                                   f"{', '.join(self.names)} (TINKERQ_BASE_MODELS)")
        return Path(self.entries[name] or local_models.resolve(name))

    def built_path(self, name: str) -> Path | None:
        """The model's directory if it exists already (never builds: for the API, which loads no models)."""
        directory = self.entries.get(name)
        return Path(directory) if directory else local_models.cached_dir(name)

    def describe(self, name: str) -> dict:
        """What get_server_capabilities says of one model."""
        entry: dict = {"model_name": name, "trainable": True, "sampleable": True}
        context = self._config(name).get("max_position_embeddings")
        if context is None and name in local_models.LOCAL_MODELS:
            context = local_models.LOCAL_MODELS[name].context
        if context is not None:
            entry["max_context_length"] = int(context)
        return entry

    def architecture(self, name: str) -> str | None:
        return self._config(name).get("model_type")

    def _config(self, name: str) -> dict:
        directory = self.built_path(name)
        try:
            return json.loads((directory / "config.json").read_text()) if directory else {}
        except (OSError, ValueError):
            return {}
