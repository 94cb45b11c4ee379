"""Files that survive a crash whole: written under a temporary name, flushed to disk, renamed into
place (a reader sees the old file or the new one, never half of one), and never written through a
symbolic link someone left at the final name."""

from __future__ import annotations

import json
import os
import secrets


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the data itself is synced
        pass
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """Flush a file (written by whoever) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably. The temporary file is created exclusively
    and without following links; the rename replaces a link at `path` rather than its target."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


def write_json_atomic(path: str, value, indent: int | None = 2) -> None:
    write_atomic(path, json.dumps(value, indent=indent))


def write_private(path: str, text: str) -> None:
    """A file only its owner can ever read (the job token): created 0600 from the start."""
    write_atomic(path, text, mode=0o600)
