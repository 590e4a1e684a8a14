"""Where checkpoints live, and what `tinker://<model_id>/<kind>/<name>` URIs mean on this worker."""

import hashlib
import re
from pathlib import Path

from worker.runtime.base import DomainError

KINDS = ("weights", "sampler_weights")
_TINKER_URI = re.compile(r"^tinker://(?P<model>[A-Za-z0-9_.:-]{1,128})/(?P<kind>weights|sampler_weights)/"
                         r"(?P<name>[A-Za-z0-9_.-]{1,128})$")


def model_dir(root: Path, model_id: str) -> Path:
    # Model ids carry ':'; a digest keeps directory names portable and of bounded length.
    return root / ("m" + hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest())


def checkpoint_file(root: Path, model_id: str, kind: str, name: str, suffix: str) -> Path:
    return model_dir(root, model_id) / kind / f"{name}{suffix}"


def tinker_uri(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def resolve(root: Path, path: str, suffix: str) -> Path:
    """A tinker:// URI or a filesystem path, as a file under `root` (anything else is refused)."""
    match = _TINKER_URI.match(path)
    if match:
        return checkpoint_file(root, match["model"], match["kind"], match["name"], suffix)
    if path.startswith("tinker://"):
        raise DomainError(400, "invalid_path", f"{path!r} is not tinker://<model_id>/(weights|sampler_weights)/<name>")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise DomainError(400, "invalid_path", f"checkpoints load only from under the checkpoint root, not {path!r}")
    return resolved
