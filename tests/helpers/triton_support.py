"""Where the Triton kernel tests run: on CUDA, or without a GPU through Triton's CPU interpreter.

`TRITON_INTERPRET=1 pytest tests/*/test_*_triton.py` runs the kernels on CPU (it needs numpy<2.4; bf16 dots and
CUDA-graph capture run on CUDA only). Test modules set `pytestmark = TRITON_MARKS`.
"""

from __future__ import annotations

import os

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

TRITON_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 for Triton's CPU interpreter"),
    # The interpreter int()s 1-element arrays (data-dependent loop bounds): NumPy 2.4 raises, older ones warn.
    pytest.mark.skipif(
        DEVICE == "cpu" and np.lib.NumpyVersion(np.__version__) >= "2.4.0",
        reason="Triton 3.6's interpreter needs numpy<2.4",
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]
