"""Where checkpoints live, and what `tinker://<model_id>/<kind>/<name>` URIs mean on this worker."""

import hashlib
from pathlib import Path

from tinkerq.uris import parse_tinker_uri
from worker.runtime.base import DomainError


def model_dir(root: Path, model_id: str) -> Path:
    # Model ids carry ':'; a digest keeps directory names portable and of bounded length.
    return root / ("m" + hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest())


def checkpoint_file(root: Path, model_id: str, kind: str, name: str, suffix: str) -> Path:
    return model_dir(root, model_id) / kind / f"{name}{suffix}"


def resolve(root: Path, path: str, suffix: str) -> Path:
    """A tinker:// URI or a filesystem path, as a file under `root` (anything else is refused)."""
    parsed = parse_tinker_uri(path)
    if parsed:
        return checkpoint_file(root, *parsed, suffix)
    if path.startswith("tinker://"):
        raise DomainError(400, "invalid_path", f"{path!r} is not tinker://<model_id>/(weights|sampler_weights)/<name>")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise DomainError(400, "invalid_path", f"checkpoints load only from under the checkpoint root, not {path!r}")
    return resolved
