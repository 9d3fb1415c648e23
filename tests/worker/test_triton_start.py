"""Triton's key and driver started on threads as the job begins on a GPU (batchgen/worker/triton_start.py)."""

from __future__ import annotations

import sys
import threading

import pytest

from batchgen.worker import triton_start


def test_tritons_own_key_and_driver_start_on_threads_where_triton_is(monkeypatch):
    """Without Triton (torch's CPU build) none starts; with it, the engine's wait returns once both threads are done:
    the once-a-process key cached, the driver's thread ended quietly without a GPU."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        assert "triton" not in sys.modules
        assert triton_start.start_triton_in_background() is None
        triton_start.wait_for_triton_start()  # none started: nothing to wait for
        return
    triton_key.cache_clear()
    key, driver = triton_start.start_triton_in_background()
    triton_start.wait_for_triton_start()
    assert errors == [] and not key.is_alive() and not driver.is_alive() and triton_start._started is None
    assert triton_key.cache_info().currsize == 1


def test_the_engines_wait_lasts_until_the_keys_thread_is_done(monkeypatch):
    """A kernel launched while the key's thread still hashes would hash Triton's files again beside it."""
    cache = pytest.importorskip("triton.runtime.cache", reason="needs Triton (not in torch's CPU build)")
    release, hashed = threading.Event(), []
    monkeypatch.setattr(cache, "triton_key", lambda: release.wait() and hashed.append(True))
    triton_start.start_triton_in_background()
    waiter = threading.Thread(target=triton_start.wait_for_triton_start)
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not hashed
    release.set()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and hashed == [True]
