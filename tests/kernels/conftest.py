"""Kernel tests: without CUDA, Triton kernels run on Triton's CPU interpreter.

``TRITON_INTERPRET=1`` is set here, before any test module imports triton, so that the interpreter is
also what the "triton" backend reports as available on CPU (dsv4cp.kernels.triton_available).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
