"""Triton's key and driver started on threads as the job begins on a GPU (batchgen/worker/triton_start.py)."""

from __future__ import annotations

import sys
import threading

from batchgen.worker import triton_start


def test_tritons_own_key_and_driver_start_on_threads_where_triton_is(monkeypatch):
    """Without Triton (torch's CPU build) none starts; with it, its once-a-process key is cached, and the driver's
    thread ends quietly without a GPU. The engine's wait for the driver then returns at once."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        assert "triton" not in sys.modules
        assert triton_start.start_triton_in_background() is None
        triton_start.wait_for_triton_driver()  # none started: nothing to wait for
        return
    triton_key.cache_clear()
    key, driver = triton_start.start_triton_in_background()
    key.join(timeout=60)
    triton_start.wait_for_triton_driver()
    assert errors == [] and not driver.is_alive() and triton_start._driver_start is None
    assert triton_key.cache_info().currsize == 1
