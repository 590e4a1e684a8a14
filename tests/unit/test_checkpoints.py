"""Checkpoint archives: atomic writes and extraction that refuses anything unsafe."""

import io
import os
import tarfile
import time
from pathlib import Path

import pytest

from worker.runtime import DomainError
from worker.torch_runtime.checkpoints import STALE_TEMP_S, extract_archive, write_archive


def archive_with(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_member(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def test_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_text("{}")
    (src / "sub" / "b.bin").write_bytes(b"\x00" * 10)
    archive = write_archive(src, tmp_path / "out" / "ck.tar.gz")
    out = extract_archive(archive, tmp_path / "x")
    assert (out / "a.json").read_text() == "{}" and (out / "sub" / "b.bin").stat().st_size == 10
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["ck.tar.gz"]  # no temp file left behind


def test_a_write_removes_the_temp_files_that_killed_writes_left_and_only_those(tmp_path):
    """A worker SIGKILLed mid-write leaves `.<name>.tar.<random>` behind; the next write there removes it once it is
    older than any live write, and leaves a fresh one (a write in progress), checkpoints and other files alone."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text("{}")
    out = tmp_path / "durable"
    out.mkdir()
    stale, fresh = out / ".j10-0a1b2c3d.tar.k3j_x9q2", out / ".j20-1f2e3d4c.tar.gz.ab12cd34"
    kept = [fresh, out / "j5-00000000.tar", out / ".notes", out / "j10.tar.other"]
    for path in [stale, *kept]:
        path.write_bytes(b"partial")
    hour_ago = time.time() - STALE_TEMP_S - 60
    for path in [stale, *kept[1:]]:
        os.utime(path, (hour_ago, hour_ago))
    write_archive(src, out / "j30-12345678.tar", compress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in kept] + ["j30-12345678.tar"])


@pytest.mark.parametrize(
    "member,reason",
    [
        (file_member("/etc/evil"), "absolute"),
        (file_member("../evil"), "'..'"),
        (file_member("ok/../../evil"), "'..'"),
        (special("link", tarfile.SYMTYPE, "/etc/passwd"), "link"),
        (special("hard", tarfile.LNKTYPE, "a.json"), "link"),
        (special("dev", tarfile.CHRTYPE), "device"),
        (special("blk", tarfile.BLKTYPE), "device"),
        (special("fifo", tarfile.FIFOTYPE), "fifo"),
    ],
)
def test_unsafe_members_are_rejected_and_nothing_is_written(tmp_path, member, reason):
    archive = archive_with(tmp_path, file_member("a.json", b"{}"), member)
    with pytest.raises(DomainError, match=reason) as info:
        extract_archive(archive, tmp_path / "x")
    assert info.value.code == "unsafe_checkpoint" and info.value.status == 400
    assert not (tmp_path / "x").exists()
    assert not Path("/etc/evil").exists() and not (tmp_path.parent / "evil").exists()


def test_oversize_archives_are_rejected(tmp_path):
    archive = archive_with(tmp_path, file_member("big", b"0" * 5000))
    with pytest.raises(DomainError, match="more than 1000 bytes"):
        extract_archive(archive, tmp_path / "x", max_bytes=1000)


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(DomainError) as missing:
        extract_archive(tmp_path / "nope.tar.gz", tmp_path / "x")
    assert missing.value.code == "checkpoint_not_found" and missing.value.status == 404
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_bytes(b"1" * 100000)
    good = write_archive(src, tmp_path / "good.tar.gz")
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(good.read_bytes()[:200])
    (tmp_path / "garbage.tar.gz").write_bytes(b"not a tarball at all")
    for bad in (truncated, tmp_path / "garbage.tar.gz"):
        with pytest.raises(DomainError) as corrupt:
            extract_archive(bad, tmp_path / "x")
        assert corrupt.value.code == "corrupt_checkpoint"
