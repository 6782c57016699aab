"""Safe extraction of a downloaded model archive (how a model folder travels over HTTP)."""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def archive_suffix(name: str) -> str | None:
    """The archive suffix ``name`` ends with, if any."""
    return next((s for s in ARCHIVE_SUFFIXES if name.endswith(s)), None)


def _check_member(member: tarfile.TarInfo, dest: Path, archive: str) -> None:
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        raise InitFailed(f"archive {archive} refused: member {member.name!r} escapes the folder")
    if member.isdev() or member.isfifo():
        raise InitFailed(f"archive {archive} refused: member {member.name!r} is a special file")
    if member.issym() or member.islnk():
        target = PurePosixPath(member.linkname)
        # A symlink's target is relative to its own folder; a hard link's to the archive root.
        base = (dest / name).parent if member.issym() else dest
        resolved = Path(os.path.normpath(base / target))
        if target.is_absolute() or not resolved.is_relative_to(dest):
            raise InitFailed(
                f"archive {archive} refused: link {member.name!r} points outside the folder"
            )


def extract_archive(archive: Path, dest: Path) -> None:
    """Extract ``archive`` into ``dest``, which appears atomically once complete.

    Every member is checked first, so a hostile archive writes nothing; the
    ``data`` filter then applies the standard library's own checks as well.
    """
    staging = dest.with_name(dest.name + ".extracting")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crash mid-extraction
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member, staging.absolute(), archive.name)
            staging.mkdir(parents=True)
            tar.extractall(staging, members=members, filter="data")
    except tarfile.TarError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise InitFailed(f"archive {archive.name} could not be extracted: {exc}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(dest)
    logger.info("extracted %s (%d members) into %s", archive.name, len(members), dest)
