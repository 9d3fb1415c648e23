"""Stand-ins for Triton kernels in the compile-process tests: each has `preload(data)`, as a JITFunction does, and
`data` names a file to write."""

from __future__ import annotations

import os
import time
from pathlib import Path


class Writes:
    """Compiles: writes which process it ran in and the environment's BATCHGEN_TEST_VALUE."""

    def preload(self, data: str) -> None:
        Path(data).write_text(f"{os.getpid()} {os.environ.get('BATCHGEN_TEST_VALUE')}")


class Raises:
    def preload(self, data: str) -> None:
        raise RuntimeError(f"cannot compile {data}")


class Crashes:
    def preload(self, data: str) -> None:
        os._exit(3)


class Hangs:
    """Never finishes: writes which process it hangs in, then sleeps."""

    def preload(self, data: str) -> None:
        Path(data).write_text(str(os.getpid()))
        time.sleep(600)


writes, raises, crashes, hangs = Writes(), Raises(), Crashes(), Hangs()
