"""Where the Triton kernel tests run: on CUDA, or without a GPU through Triton's CPU interpreter.

`TRITON_INTERPRET=1 pytest tests/*/test_*_triton.py` runs the kernels on CPU (before Triton 3.8 it needs numpy<2.4;
bf16 dots and CUDA-graph capture run on CUDA only). Test modules set `pytestmark = TRITON_MARKS`.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    DEVICE = None
ON_GPU = DEVICE == "cuda"


def _interpreter_needs_old_numpy() -> bool:
    """Before Triton 3.8, the interpreter int()s 1-element arrays (data-dependent loop bounds): NumPy 2.4 raises,
    older ones warn."""
    try:
        triton_version = tuple(int(part) for part in version("triton").split(".")[:2])
    except PackageNotFoundError:
        return False  # no interpreter to run: the test modules skip on importing triton
    return triton_version < (3, 8) and np.lib.NumpyVersion(np.__version__) >= "2.4.0"


TRITON_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 for Triton's CPU interpreter"),
    pytest.mark.skipif(
        DEVICE == "cpu" and _interpreter_needs_old_numpy(), reason="Triton's interpreter before 3.8 needs numpy<2.4"
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]
