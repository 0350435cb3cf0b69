"""What limits each compiled Triton kernel: registers, spills, shared memory, warps (the compiler's
resource report), read from Triton's per-device kernel caches after the kernels have run."""

from __future__ import annotations

from typing import Any


def compiled_resources() -> list[dict[str, Any]]:
    """One row per compiled variant of every kernel this package has built on a GPU."""
    from dsv4cp.kernels import attention_probs_triton, indexer_triton, norm_rope_triton, sparse_attention_launch

    rows = []
    for module in (sparse_attention_launch, attention_probs_triton, indexer_triton, norm_rope_triton):
        kernels = getattr(module, "_KERNELS", None)
        for (name, interpreted), fn in (kernels.built if kernels is not None else {}).items():
            if interpreted:
                continue
            for device, caches in getattr(fn, "device_caches", {}).items():
                for kernel in caches[0].values():
                    meta = kernel.metadata
                    rows.append({
                        "kernel": f"{kernels.bodies[name].__module__.rsplit('.', 1)[-1]}.{name}", "device": device,
                        "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                        "shared_bytes": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
                        "num_stages": getattr(meta, "num_stages", None),
                    })
    return rows


if __name__ == "__main__":
    for row in compiled_resources():
        print(row)
