"""Crash-safe file replacement: a reader sees the old file or the complete new one, never a partial one. And the lock
that keeps a second process out of a directory that a job is writing."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
LOCK_FILE = ".batchgen.lock"
# flock fails with these where the file system cannot lock files (Lustre mounted with noflock, some NFS setups).
NO_LOCKING_ERRNOS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP})


def tmp_path_for(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_path(path: Path) -> None:
    """Makes a closed file's contents, or the renames and deletions inside a directory, durable across a power loss
    (fsync acts on the file or directory, whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """write_file_atomically with `<path>.tmp` opened as a Python file for `write`."""
    def write_file(tmp_path: Path) -> None:
        with tmp_path.open("wb") as file:
            write(file)

    write_file_atomically(path, write_file)


def write_file_atomically(path: Path, write_file: Callable[[Path], None]) -> None:
    """Runs `write_file` on the path `<path>.tmp`, which it opens, writes and closes itself (Arrow's own files write
    without holding the GIL), fsyncs it and renames it over `path`.

    A failure (a full disk, a file-size limit) removes the `.tmp` file and raises an OSError naming `path`; a crash
    leaves at most a stale `.tmp` file behind, which the next writer removes.
    """
    tmp_path = tmp_path_for(path)
    try:
        write_file(tmp_path)
        fsync_path(tmp_path)
        os.replace(tmp_path, path)
        fsync_path(path.parent)
    except BaseException as exc:
        tmp_path.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # the writer names no file: name the one being written
            # Arrow's errors carry the errno with a longer text of their own
            strerror = os.strerror(exc.errno) if exc.errno else exc.strerror
            raise OSError(exc.errno, strerror, str(path)) from exc
        raise


class DirectoryInUse(Exception):
    """Another live process holds the directory's lock; the message names it."""


class DirectoryLock:
    """An exclusive lock on a directory for as long as one job writes it: flock on <directory>/.batchgen.lock, which
    the kernel releases when the process ends, however it ends (kill -9 included). The file records the holder's pid
    and host for the message a second process gets. It is never removed while it may be held: a process that opened
    it and then locked a removed file would hold a lock no later process sees."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises DirectoryInUse at once; creates the directory if needed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0)
            os.close(fd)
            raise DirectoryInUse(f"{self.path.parent} is in use by another job ({_describe_holder(holder)}, lock "
                                 f"file {self.path}): two jobs there would compute the same rows. Wait for it to "
                                 "end, or stop it, then resume with job.resume=true") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_LOCKING_ERRNOS:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
            log.warning("%s: the file system cannot lock files (%s), so a second job on this directory would not "
                        "be stopped", self.path, exc.strerror)
            return
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _describe_holder(recorded: bytes) -> str:
    try:
        holder = json.loads(recorded)
    except ValueError:  # the holder has locked the file but not yet written itself into it
        return "its pid and host are not recorded yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
    return f"pid {holder['pid']} on host {holder['host']}, since {since}"
