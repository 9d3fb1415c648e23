"""What a process's first Triton kernel otherwise waits for, started on threads as the job begins on a CUDA GPU, so
that it runs beside the job's reading of its input and the model's load, mostly without the GIL:
- hashing Triton's own files, the part of the kernels' cache keys computed once a process (about 0.4 s of hashlib on
  an H200's host);
- Triton's CUDA driver, which on a fresh machine first builds its C helper module (about 1 s, most of it the C
  compiler's, in a subprocess). The engine waits for it (`wait_for_triton_driver`) before its first kernel: two
  threads that both found no driver would each build one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

_driver_start: threading.Thread | None = None  # start_triton_in_background's, until wait_for_triton_driver


def start_triton_in_background() -> tuple[threading.Thread, threading.Thread] | None:
    """The two threads; None without Triton (torch's CPU build). Triton's modules are imported here, before either
    starts: threads importing them at once deadlock on their import locks (Python then hands one of them a module
    half imported)."""
    global _driver_start
    try:
        from triton.runtime.cache import triton_key  # Triton 3.6 and 3.8 keep it here
        from triton.runtime.driver import driver
    except ImportError:  # no Triton, or one that keys elsewhere: its first kernel pays both
        return None
    key = threading.Thread(target=triton_key, name="triton-key", daemon=True)
    _driver_start = threading.Thread(target=_start_driver, args=(driver,), name="triton-driver", daemon=True)
    key.start()
    _driver_start.start()
    return key, _driver_start


def wait_for_triton_driver() -> None:
    """Joins the driver's start, if this process began one."""
    global _driver_start
    if _driver_start is not None:
        _driver_start.join()
        _driver_start = None


def _start_driver(driver: Any) -> None:
    with contextlib.suppress(Exception):  # no GPU, or another Triton: the first kernel meets it as before
        driver.active  # noqa: B018 (creating the driver builds its helper module)
