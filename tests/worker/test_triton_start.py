"""Triton's key and driver started on threads as the job's config is valid (batchgen/worker/triton_start.py)."""

from __future__ import annotations

import sys
import threading

import pytest

from batchgen.config import EngineConfig
from batchgen.worker import triton_start


@pytest.mark.parametrize("engine", [EngineConfig(device="cpu"), EngineConfig(data_parallel_size=2)],
                         ids=["cpu", "data_parallel_parent"])
def test_nothing_starts_where_this_process_runs_no_engine_on_a_gpu(engine):
    assert triton_start.start_triton_in_background(engine) is None
    triton_start.wait_for_triton_driver()  # none started: nothing to wait for


def test_tritons_own_key_and_driver_start_on_threads_where_triton_is(monkeypatch):
    """Without Triton (torch's CPU build) none starts; with it, its once-a-process key is cached, and the driver's
    thread ends quietly without a GPU. The engine's wait for the driver then returns at once."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    engine = EngineConfig(device="cuda")
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        assert "triton" not in sys.modules
        assert triton_start.start_triton_in_background(engine) is None
        return
    triton_key.cache_clear()
    key, driver = triton_start.start_triton_in_background(engine)
    key.join(timeout=60)
    triton_start.wait_for_triton_driver()
    assert errors == [] and not driver.is_alive() and triton_start._driver_start is None
    assert triton_key.cache_info().currsize == 1
