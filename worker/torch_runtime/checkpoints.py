"""Checkpoint archives: written atomically as tar.gz, extracted only when every member is safe."""

import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from worker.runtime.base import DomainError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 30
# A writer killed between its temp file and the rename (a SIGKILLed worker) leaves the file behind: the next write into
# that directory removes those older than this. A live write's file is minutes old at most; one removed under a
# paused writer only fails its rename, so that writer records nothing.
STALE_TEMP_S = 3600.0
_TEMP_NAME = re.compile(r"^\..+\.tar(\.gz)?\.\w{8}$")  # mkstemp(prefix=".<target name>.") of write_archive


def write_archive(source_dir: Path, target: Path, compress: bool = True) -> Path:
    """tar.gz `source_dir`'s files into `target`, via a temp file and rename, so readers never see half.
    `compress` off: a plain tar (extract_archive reads both), for the periodic durable
    checkpoints, whose float tensors gzip barely shrinks at several times the cost of writing them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        # Level 1: weights barely compress, and level 9 costs minutes on a GB-sized model.
        options = {"mode": "w:gz", "compresslevel": 1} if compress else {"mode": "w"}
        with tarfile.open(tmp, **options) as tar:
            for path in sorted(source_dir.iterdir()):
                tar.add(path, arcname=path.name, recursive=True)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_stale_temps(directory: Path, older_than_s: float = STALE_TEMP_S) -> list[Path]:
    """Remove the temp files of writes that died (write_archive's, older than `older_than_s`); those removed."""
    cutoff = time.time() - older_than_s
    removed = []
    for path in directory.iterdir():
        try:
            if _TEMP_NAME.match(path.name) and path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path)
        except FileNotFoundError:
            continue  # another worker removed it first
        except OSError as exc:  # cleaning up is best effort: it never fails the write it comes before
            log.warning("could not remove the stale temp file %s: %s", path, exc)
    return removed


def _unsafe(member: tarfile.TarInfo) -> str | None:
    name = member.name
    if name.startswith("/") or Path(name).is_absolute():
        return "an absolute path"
    if ".." in Path(name).parts:
        return "a '..' component"
    if member.issym() or member.islnk():
        return "a link"
    if member.isdev() or member.isfifo():
        return "a device or fifo"
    if not (member.isfile() or member.isdir()):
        return "an unsupported member type"
    return None


def extract_archive(archive: Path, target: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Extract into `target` (created), refusing absolute paths, '..', links, devices and oversize."""
    if not archive.is_file():
        raise DomainError(404, "checkpoint_not_found", f"no checkpoint at {str(archive)!r}")
    try:
        with tarfile.open(archive, "r:*") as tar:  # gzip or plain (write_archive's compress)
            members = tar.getmembers()
            total = 0
            for member in members:
                reason = _unsafe(member)
                if reason:
                    raise DomainError(400, "unsafe_checkpoint", f"{archive.name}: member {member.name!r} is {reason}")
                total += member.size
                if total > max_bytes:
                    raise DomainError(400, "checkpoint_too_large",
                                      f"{archive.name} unpacks to more than {max_bytes} bytes")
            target.mkdir(parents=True, exist_ok=True)
            tar.extractall(target, members=members, filter="data")
    except DomainError:
        raise
    except Exception as exc:  # truncated gzip, bad headers, zlib errors, ...
        shutil.rmtree(target, ignore_errors=True)
        raise DomainError(400, "corrupt_checkpoint", f"{archive.name} is not a readable tar.gz: {exc}") from exc
    return target
