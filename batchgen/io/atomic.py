"""Crash-safe file replacement: a reader sees the old file or the complete new one, never a partial one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"


def tmp_path_for(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_directory(directory: Path) -> None:
    """Makes renames and deletions inside `directory` durable across a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Runs `write` on `<path>.tmp`, fsyncs it and renames it over `path`.

    A crash leaves at most a stale `.tmp` file behind, which the next writer removes.
    """
    tmp_path = tmp_path_for(path)
    with tmp_path.open("wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp_path, path)
    fsync_directory(path.parent)
