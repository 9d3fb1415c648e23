"""end_process: the process of finished jobs (or of a job stopped by a tensor-parallel follower's death) ends with its
exit status, its exit handlers run and its output flushed, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
from batchgen.job.exits import end_process

class FreedAtTeardown:
    def __del__(self):
        print("teardown", file=sys.stderr, flush=True)

kept = FreedAtTeardown()
atexit.register(lambda: print("exit handler", file=sys.stderr, flush=True))
print("written")  # a pipe buffers it: only a flush writes it
{end}({status})
"""


def run(end: str, status: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(end=end, status=status)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("status", [0, 1])
def test_end_process_runs_the_exit_handlers_flushes_and_skips_the_teardown(status):
    ended = run("end_process", status)
    assert ended.returncode == status
    assert ended.stdout == "written\n"
    assert ended.stderr == "exit handler\n"
    exited = run("sys.exit", status)  # the ordinary exit, which this script's teardown line shows
    assert exited.returncode == status and exited.stderr == "exit handler\nteardown\n"
