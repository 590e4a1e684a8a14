"""Tinker's checkpoint URIs: tinker://<model_id>/(weights|sampler_weights)/<name>."""

import re

from schemas.ids import CHECKPOINT_NAME, MODEL_ID

TINKER_URI = re.compile(rf"^tinker://(?P<model>{MODEL_ID})/(?P<kind>weights|sampler_weights)/"
                        rf"(?P<name>{CHECKPOINT_NAME})$")


def tinker_uri(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_tinker_uri(uri: str) -> tuple[str, str, str] | None:
    """(model_id, kind, name), or None if `uri` is not a checkpoint URI."""
    match = TINKER_URI.match(uri)
    return (match["model"], match["kind"], match["name"]) if match else None
