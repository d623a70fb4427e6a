"""Device parameter lists shared by the kernel tests.

"cpu" runs the torch / C++ CPU path in a normal session and the Triton interpreter under TRITON_INTERPRET=1
(tests/kernels/test_triton_interpreter.py runs the kernel files that way in a subprocess); "cuda" needs a GPU.
"""
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not HAS_CUDA or INTERPRET, reason="needs CUDA (and no interpreter)")]),
]
TRITON_DEVICES = [
    pytest.param("cpu", id="interpret", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    DEVICES[1],
]
CUDA_ONLY = [DEVICES[1]]
not_interpreted = pytest.mark.skipif(INTERPRET, reason="CPU path only (not under the interpreter)")
