"""Kernel options as arguments: ``DSv4Attention(kernel_options=...)`` and ``sparse_attention(options=...)``
reach both directions' kernels (the backward runs outside any block, long after the forward), and no module
below the harness reads them from a global."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dsv4cp import kernel_options
from dsv4cp.config import DSv4Config
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import triton_available
from dsv4cp.layer import DSv4Attention
from dsv4cp.ops import sparse_attention
from dsv4cp.packing import PackedSeqs

needs_triton = pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton's CPU interpreter")


@needs_triton
def test_layer_backward_runs_with_its_options(seed):
    cfg = DSv4Config.preset("tiny")
    pin = {"triton_bwd_config": "16,16,4,1", "triton_dq_in_dkv": "0", "triton_bwd_dq_pass": "0"}
    torch.manual_seed(seed)
    layer = DSv4Attention(cfg, 4, backend="triton", kernel_options=KernelOptions.resolve(pin))
    x = torch.randn(32, cfg.hidden, requires_grad=True)
    out = layer(x, PackedSeqs.from_lengths([32]))
    kernel_options.reset_backends_ran()
    out.out.square().mean().backward()  # outside any with block: the layer's scope holds
    ran = kernel_options.backends_ran()
    assert ran["sparse_attention.bwd"] == "triton"
    assert ran["sparse_attention.bwd_dq.config"] == "block_h=16,block_k=16,num_warps=4,num_stages=1", ran
    assert "sparse_attention.bwd_dq_dq_in_dkv.config" not in ran  # triton_dq_in_dkv=0 took effect
    assert kernel_options.source("triton_bwd_config") != "explicit"
    with pytest.raises(ValueError, match="^triton_dq_in_dkv: must be '0' or '1'"):
        KernelOptions.resolve({"triton_dq_in_dkv": "yes"})
    with pytest.raises(ValueError, match="^kernel_options: must be a KernelOptions, got dict"):
        DSv4Attention(cfg, 4, kernel_options=pin)


@needs_triton
def test_sparse_attention_options_reach_both_directions(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 2, 16, generator=gen, requires_grad=True)
    kv = torch.randn(10, 16, generator=gen, requires_grad=True)
    idx = torch.randint(-1, 10, (6, 7), generator=gen, dtype=torch.int32)
    sink = torch.randn(2, generator=gen, requires_grad=True)
    kernel_options.reset_backends_ran()
    options = KernelOptions(triton_fwd_config=(16, 16, 4, 1), triton_dq_in_dkv=False, triton_bwd_dq_pass=False)
    out, _ = sparse_attention(q, kv, idx, sink, 0.25, backend="triton", options=options)
    out.sum().backward()
    ran = kernel_options.backends_ran()
    assert ran["sparse_attention.fwd.config"] == "block_h=16,block_k=16,num_warps=4,num_stages=1", ran
    assert "sparse_attention.bwd_dq.config" in ran and "sparse_attention.bwd_dq_dq_in_dkv.config" not in ran
    with pytest.raises(ValueError, match="^options: must be a KernelOptions, got dict"):
        sparse_attention(q, kv, idx, sink, 0.25, backend="triton", options={"triton_fwd_config": "16,16,4,1"})


GLOBAL_READS = re.compile(r"kernel_options\.(get|resolved|overrides|where|source)\(|\bresolved\(\)|options_in_force|"
                          r"options_from|kernel_scope")
"""What reading the kernel options from the process-wide registry looks like."""


BELOW_THE_HARNESS = ("layer", "model", "cp", "ops", "kernels")
"""The packages under the harness (pyproject.toml's layers): they take the options as arguments."""


def test_no_module_below_the_harness_reads_the_options_from_a_global():
    """The layer, the cost model, the CP machinery, the ops and the kernels take the kernel options as
    arguments: none calls the registry's global reads (``kernel_options.get`` / ``resolved()`` /
    ``overrides`` / ``where``) or the text round trip the custom ops used to need."""
    root = Path(__file__).resolve().parents[2] / "dsv4cp"
    found = [f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
             for package in BELOW_THE_HARNESS for path in sorted((root / package).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if GLOBAL_READS.search(line)]
    assert not found, "global kernel-option reads:\n" + "\n".join(found)
