"""What a process's first Triton kernel otherwise waits for, started on threads as the job begins on a CUDA GPU, so
that it runs beside the job's reading of its input and the model's load, mostly without the GIL:
- hashing Triton's own files, the part of the kernels' cache keys computed once a process;
- Triton's CUDA driver, which on a fresh machine first builds its C helper module (most of it the C compiler's work,
  in a subprocess).
The engine waits for both (`wait_for_triton_start`) before its first kernel: a kernel that found either unfinished
would do that work again beside the thread (the key's cache is filled only as its computation ends; two threads that
both found no driver would each build one).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

_started: tuple[threading.Thread, threading.Thread] | None = None  # start_triton_in_background's, until waited for


def start_triton_in_background() -> tuple[threading.Thread, threading.Thread] | None:
    """The two threads (the key's, the driver's); None without Triton (torch's CPU build). Triton's modules are
    imported here, before either starts: threads importing them at once deadlock on their import locks (Python then
    hands one of them a module half imported)."""
    global _started
    try:
        from triton.runtime.cache import triton_key  # Triton 3.6 and 3.8 keep it here
        from triton.runtime.driver import driver
    except ImportError:  # no Triton, or one that keys elsewhere: its first kernel pays both
        return None
    _started = (threading.Thread(target=triton_key, name="triton-key", daemon=True),
                threading.Thread(target=_start_driver, args=(driver,), name="triton-driver", daemon=True))
    for thread in _started:
        thread.start()
    return _started


def wait_for_triton_start() -> None:
    """Joins the key's and the driver's threads, if this process began them."""
    global _started
    if _started is not None:
        for thread in _started:
            thread.join()
        _started = None


def _start_driver(driver: Any) -> None:
    with contextlib.suppress(Exception):  # no GPU, or another Triton: the first kernel meets it as before
        driver.active  # noqa: B018 (creating the driver builds its helper module)
