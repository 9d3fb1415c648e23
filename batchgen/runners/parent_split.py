"""The data-parallel parent weighs the input once for its ranks (data.shard_by=work).

A split by work needs every input row's prompt tokens, so each rank computing it tokenized the whole input, all of
them at once, before their engines could start. The parent, which starts its ranks before it imports torch, reads and
weighs the input while they start: it runs the ranks' own read (row_work.read_shard), keeping no row, writes the
shard of every row, in input order, to <run dir>/.shard-split, and closes a pipe whose read end each rank holds. A
rank waits for that pipe's end, then takes the file's assignment; where there is none (the parent could not weigh
the input, or died) it weighs the input itself, as it would alone. Either way every rank computes the same split.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from pathlib import Path

from batchgen.config import Config
from batchgen.engine.collector import rare_collections
from batchgen.io.atomic import write_atomically
from batchgen.io.shard_split import ASSIGNMENT_TYPECODE, ShardSplit
from batchgen.job.row_work import open_input, read_shard

log = logging.getLogger(__name__)

SPLIT_FILE = ".shard-split"
# "<fd>:<path>" in a rank's environment: the read end of the parent's pipe, and the file it writes before closing it.
PARENT_SPLIT_ENV = "BATCHGEN_PARENT_SPLIT"


def weigh_input(config: Config, num_shards: int) -> array:
    """The shard of every input row under data.shard_by=work over num_shards shards, as each shard computes it."""
    work, rows = open_input(config)
    split = ShardSplit(num_shards, "work", record=True)
    with rare_collections():
        read_shard(rows, split, -1, work)
    return split.assignment


class ParentSplit:
    """The parent's side: the pipe its ranks inherit (`child_env`, `pass_fds`), closed by `publish` once the file
    is written or the weighing failed."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / SPLIT_FILE
        self.path.unlink(missing_ok=True)  # an earlier attempt's: the ranks must not take it before this one's
        self._read_fd, self._write_fd = os.pipe()

    def child_env(self) -> dict[str, str]:
        return {PARENT_SPLIT_ENV: f"{self._read_fd}:{self.path}"}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self._read_fd,)

    def spawned(self) -> None:
        """Every rank holds the read end now: the parent's copy goes."""
        os.close(self._read_fd)

    def publish(self, config: Config, num_shards: int) -> None:
        start = time.perf_counter()
        try:
            assignment = weigh_input(config, num_shards)
            write_atomically(self.path, lambda file: file.write(assignment.tobytes()))
            log.info("Weighed the %d input rows for the ranks' split in %.2f s", len(assignment),
                     time.perf_counter() - start)
        except Exception as exc:  # the ranks then weigh the input themselves, and report what is wrong with it
            log.warning("Could not weigh the input for the ranks (%s: %s): each rank weighs it itself",
                        type(exc).__name__, exc)
        finally:
            self.close()

    def close(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def wait_for_parent_split() -> array | None:
    """In a rank: the parent's assignment once its pipe has closed; None where the parent gave none."""
    given = os.environ.get(PARENT_SPLIT_ENV)
    if given is None:
        return None
    fd, path = given.split(":", 1)
    with os.fdopen(int(fd), "rb") as pipe:
        pipe.read()  # nothing is written: this returns at the pipe's end, when the parent closes it or dies
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    assignment = array(ASSIGNMENT_TYPECODE)
    assignment.frombytes(data)
    return assignment
