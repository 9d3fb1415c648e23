"""Shared fixtures: tiny random Hugging Face checkpoints of every supported architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.common import build_tiny_model_dir

# The tiny test models gain nothing from intra-op threads; on small CPU machines extra threads only add overhead.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model_dir(architecture, sharded=False, sliding_window=None) -> checkpoint directory, built once per
    session."""
    built: dict[tuple[str, bool, int | None], Path] = {}

    def get(architecture: str, sharded: bool = False, sliding_window: int | None = None) -> Path:
        key = (architecture, sharded, sliding_window)
        if key not in built:
            suffix = ("-sharded" if sharded else "") + (f"-window{sliding_window}" if sliding_window else "")
            directory = tmp_path_factory.mktemp(f"{architecture}{suffix}")
            built[key] = build_tiny_model_dir(architecture, directory, "20KB" if sharded else None, sliding_window)
        return built[key]

    return get
