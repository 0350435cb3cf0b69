"""Registers the optional library backends (DESIGN 4.2), one-sided, so they are used in pairs:

* "flashmla": forward only (FlashMLA's sparse prefill, :mod:`dsv4cp.kernels.flashmla`);
* "cudnn": backward only (cuDNN frontend's DSA backward, :mod:`dsv4cp.kernels.cudnn_dsa`).

E.g. ``backend="flashmla+cudnn"``, ``"triton+cudnn"`` or ``"flashmla+triton"``. Neither enters "auto"
(a one-sided backend cannot serve both directions). Importing this module imports neither library;
``available(device)`` does, on CUDA devices only, when a backend is asked for.
"""

from __future__ import annotations

from dsv4cp.kernels import cudnn_dsa, flashmla
from dsv4cp.ops.sparse_attention import SparseAttentionBackend, backend_names, register_backend

MISSING_HINTS = {flashmla.NAME: flashmla.MISSING_HINT, cudnn_dsa.NAME: cudnn_dsa.MISSING_HINT}
"""What each optional backend needs, by backend name."""


def _register() -> None:
    names = backend_names()
    if flashmla.NAME not in names:
        register_backend(SparseAttentionBackend(flashmla.NAME, flashmla.sparse_attention_forward, None,
                                                flashmla.available))
    if cudnn_dsa.NAME not in names:
        register_backend(SparseAttentionBackend(cudnn_dsa.NAME, None, cudnn_dsa.sparse_attention_backward,
                                                cudnn_dsa.available))


_register()
