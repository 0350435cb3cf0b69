"""Independent float64 per-document reference of the DeepSeek-V4 attention layer (DESIGN 1, 2, 4.1).

This module deliberately shares no code with ``dsv4cp.layer`` or ``dsv4cp.ops``: it reads only a
``state_dict``-like mapping of plain tensors and the fields of the config dataclass, and it spells the
math out with Python loops over documents, compressed entries and query positions. Vectorisation is
used only inside one query (its key list, its small softmax) or for per-token projections.

Everything is computed in float64 with differentiable torch ops, so tests can compare input and
parameter gradients through autograd.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

F64 = torch.float64


# ---------------------------------------------------------------------------------------- helpers
def _as_list(offsets) -> list[int]:
    if isinstance(offsets, Tensor):
        return [int(v) for v in offsets.tolist()]
    return [int(v) for v in offsets]


def rms_norm(v: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """v * rsqrt(mean(v^2) + eps) (* weight), over the last dim."""
    out = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def rope_frequencies(cfg, compress_ratio: int) -> Tensor:
    """Per-pair angular frequencies w_i (float64, [P/2]); YaRN-corrected for C/H layers."""
    P = cfg.rope_dim
    half = P // 2
    if compress_ratio == 0:
        base = float(cfg.rope_base)
        return torch.tensor([base ** (-2.0 * i / P) for i in range(half)], dtype=F64)
    base = float(cfg.compressed_rope_base)

    def corr(beta: float) -> float:
        return P * math.log(cfg.yarn_original_len / (2.0 * math.pi * beta)) / (2.0 * math.log(base))

    low = min(max(math.floor(corr(cfg.yarn_beta_fast)), 0), P - 1)
    high = min(max(math.ceil(corr(cfg.yarn_beta_slow)), 0), P - 1)
    denom = (high - low) if high != low else 0.001
    freqs = []
    for i in range(half):
        w = base ** (-2.0 * i / P)
        m = min(max((i - low) / denom, 0.0), 1.0)
        freqs.append(w * (1.0 - m) + (w / cfg.yarn_factor) * m)
    return torch.tensor(freqs, dtype=F64)


def apply_rope(v: Tensor, pos: float, freqs: Tensor) -> Tensor:
    """Rotate the last P = 2*len(freqs) dims of ``v`` (any leading shape) by angle pos * w_i,
    interleaved pairs (2i, 2i+1) of that slice. ``pos`` negative gives the inverse rotation."""
    P = 2 * freqs.numel()
    keep, rot = v[..., :-P], v[..., -P:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    ang = freqs * float(pos)
    cos, sin = torch.cos(ang), torch.sin(ang)
    a2 = a * cos - b * sin
    b2 = a * sin + b * cos
    rotated = torch.stack((a2, b2), dim=-1).reshape(rot.shape)
    return torch.cat((keep, rotated), dim=-1)


def hadamard_matrix(n: int) -> Tensor:
    """Sylvester Hadamard matrix of order n (power of two), scaled by n^-0.5 (orthonormal)."""
    assert n >= 1 and n & (n - 1) == 0, n
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h * n**-0.5


def compress_document(
    xd: Tensor, wkv: Tensor, wgate: Tensor, ape: Tensor, norm_w: Tensor, r: int, c: int, overlap: bool,
    eps: float, freqs: Tensor, hadamard: Tensor | None = None,
) -> Tensor:
    """Compressed entries of ONE document (DESIGN 1.5): [floor(n/r), c] float64.

    Loops over entries; each entry's slots are gathered explicitly and pooled under a per-channel
    softmax of the gates.
    """
    n = xd.shape[0]
    n_entries = n // r
    if n_entries == 0:
        return xd.new_zeros((0, c))
    a = xd @ wkv.t()  # [n, coff*c]
    z_raw = xd @ wgate.t()
    z = torch.stack([z_raw[s] + ape[s % r] for s in range(n)])  # ape by document position mod r
    entries = []
    for j in range(n_entries):
        if overlap:
            vals = [a[j * r:(j + 1) * r, c:2 * c]]  # B halves of group j
            gates = [z[j * r:(j + 1) * r, c:2 * c]]
            if j > 0:  # A halves of group j-1
                vals.insert(0, a[(j - 1) * r:j * r, :c])
                gates.insert(0, z[(j - 1) * r:j * r, :c])
            vals_t, gates_t = torch.cat(vals, dim=0), torch.cat(gates, dim=0)
        else:
            vals_t, gates_t = a[j * r:(j + 1) * r], z[j * r:(j + 1) * r]
        weights = torch.softmax(gates_t, dim=0)  # per channel over the slots
        pooled = (weights * vals_t).sum(dim=0)
        e = rms_norm(pooled, norm_w, eps)
        e = apply_rope(e, j * r, freqs)
        if hadamard is not None:
            e = e @ hadamard
        entries.append(e)
    return torch.stack(entries)


# ---------------------------------------------------------------------------------------- sparse op
def reference_sparse_attention(
    q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float, topk_length: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-query loop version of DESIGN 4.1 in float64.

    q [T, H, D], kv [N, D] (key and value), idx [T, Kt] (negative = invalid; a repeated index is a
    repeated key), sink [H]. Returns out [T, H, D] (0 for a row without valid key) and lse [T, H]:
    the natural-log sum of exp(logits) over valid keys EXCLUDING the sink (-inf without key).
    """
    q64, kv64, sink64 = q.to(F64), kv.to(F64), sink.to(F64)
    T, H, D = q64.shape
    idx_rows = idx.tolist()
    lengths = None if topk_length is None else [int(v) for v in topk_length.tolist()]
    outs, lses = [], []
    for t in range(T):
        slots = idx_rows[t] if lengths is None else idx_rows[t][: max(lengths[t], 0)]
        valid = [int(i) for i in slots if i >= 0]
        if not valid:
            outs.append(q64.new_zeros((H, D)))
            lses.append(q64.new_full((H,), -math.inf))
            continue
        keys = kv64[valid]  # [k, D]
        logits = scale * (q64[t] @ keys.t())  # [H, k]
        lses.append(torch.logsumexp(logits, dim=-1))
        probs = torch.softmax(torch.cat((logits, sink64[:, None]), dim=-1), dim=-1)[:, :-1]
        outs.append(probs @ keys)
    if T == 0:
        return q64.new_zeros((0, H, D)), q64.new_zeros((0, H))
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------- the layer
def reference_forward(
    state: Mapping[str, Tensor], cfg, compress_ratio: int, x: Tensor,
    cu_seqlens: Sequence[int] | Tensor, cu_seqlens_padded: Sequence[int] | Tensor,
    *, info: dict | None = None,
) -> tuple[Tensor, Tensor | None]:
    """DSv4 attention layer of ratio ``compress_ratio`` on packed ``x [T, hidden]``, per document.

    Returns ``(out [T, hidden] float64, indexer_loss)``; the loss is a float64 scalar for C layers
    (ratio 4) and None otherwise. If ``info`` is a dict it receives diagnostics:
    ``selected`` {row: list of document-local entry ids} and ``topk_margin`` (smallest relative gap
    between the K-th and (K+1)-th indexer score of any query; +inf when no query had to choose).
    """
    r = int(compress_ratio)
    kind = "W" if r == 0 else ("C" if r == 4 else "H")
    cu, cup = _as_list(cu_seqlens), _as_list(cu_seqlens_padded)
    eps = float(cfg.rms_eps)
    H, D = cfg.n_heads, cfg.head_dim
    G, OL, W, K = cfg.o_groups, cfg.o_lora_rank, cfg.window, cfg.index_topk
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    scale = D**-0.5

    def p(name: str) -> Tensor:
        return state[name].to(F64)

    wq_a, q_norm, wq_b = p("wq_a.weight"), p("q_norm.weight"), p("wq_b.weight")
    wkv, kv_norm = p("wkv.weight"), p("kv_norm.weight")
    wo_a, wo_b = p("wo_a.weight"), p("wo_b.weight")
    sink = p("attn_sink")
    freqs = rope_frequencies(cfg, r)
    had = hadamard_matrix(Di) if (kind == "C" and cfg.hadamard) else None

    x = x.to(F64)
    T, hidden = x.shape
    out_rows: list[Tensor | None] = [None] * T
    kl_terms: list[Tensor] = []
    selected: dict[int, list[int]] = {}
    margin = math.inf

    for d in range(len(cup) - 1):
        start, end = cup[d], cup[d + 1]
        n = end - start
        real = cu[d + 1] - cu[d]
        if n == 0:
            continue
        xd = x[start:end]

        # queries and window key/values, one token at a time for the RoPE
        c_lat = rms_norm(xd @ wq_a.t(), q_norm, eps)  # [n, q_lora]
        q_raw = rms_norm((c_lat @ wq_b.t()).view(n, H, D), None, eps)
        kv_raw = rms_norm(xd @ wkv.t(), kv_norm, eps)  # [n, D]
        q = torch.stack([apply_rope(q_raw[t], t, freqs) for t in range(n)])  # [n, H, D]
        kv = torch.stack([apply_rope(kv_raw[t], t, freqs) for t in range(n)])  # [n, D]

        # compressed key/values
        if kind != "W":
            overlap = kind == "C"
            ckv = compress_document(
                xd, p("compressor.wkv.weight"), p("compressor.wgate.weight"), p("compressor.ape"),
                p("compressor.norm.weight"), r, D, overlap, eps, freqs,
            )
        if kind == "C":
            xdet, cdet = xd.detach(), c_lat.detach()
            ki = compress_document(
                xdet, p("indexer.compressor.wkv.weight"), p("indexer.compressor.wgate.weight"),
                p("indexer.compressor.ape"), p("indexer.compressor.norm.weight"), 4, Di, True, eps, freqs,
                had,
            )  # [E, Di]
            qi_raw = (cdet @ p("indexer.wq_b.weight").t()).view(n, Hi, Di)
            qi = []
            for t in range(n):
                v = apply_rope(qi_raw[t], t, freqs)
                qi.append(v @ had if had is not None else v)
            qi = torch.stack(qi)  # [n, Hi, Di]
            wi = (xdet @ p("indexer.weights_proj.weight").t()) * (Hi**-0.5 * Di**-0.5)  # [n, Hi]

        for t in range(n):
            row = start + t
            lo = max(0, t - W + 1)
            win = kv[lo:t + 1]
            n_win = win.shape[0]
            n_vis = (t + 1) // r if r > 0 else 0
            scores = None
            if kind == "C" and n_vis > 0:
                scores = wi[t] @ torch.relu(qi[t] @ ki[:n_vis].t())  # [n_vis]
                s_det = scores.detach()
                order = torch.argsort(s_det, descending=True, stable=True).tolist()
                sel = order[:K]
                if n_vis > K:
                    gap = float(s_det[order[K - 1]] - s_det[order[K]])
                    margin = min(margin, gap / max(float(s_det.abs().max()), 1e-300))
                selected[row] = sorted(sel)
                keys = torch.cat((win, ckv[sel]), dim=0)
            elif kind == "H" and n_vis > 0:
                keys = torch.cat((win, ckv[:n_vis]), dim=0)
            else:
                sel = []
                keys = win
            logits = scale * (q[t] @ keys.t())  # [H, n_keys]
            probs = torch.softmax(torch.cat((logits, sink[:, None]), dim=-1), dim=-1)[:, :-1]
            o = probs @ keys  # [H, D]
            o = apply_rope(o, -t, freqs)  # inverse rotation at the query position
            per_group = o.reshape(G, (H // G) * D)
            y = torch.cat([wo_a[g * OL:(g + 1) * OL] @ per_group[g] for g in range(G)])
            out_rows[row] = wo_b @ y

            # indexer KL (target side detached, prediction = indexer scores)
            if kind == "C" and scores is not None and t < real:
                qd, sink_d = q[t].detach(), sink.detach()
                if cfg.indexer_loss == "sparse":
                    ld = scale * (qd @ keys.detach().t())
                    lse = torch.logsumexp(torch.cat((ld, sink_d[:, None]), dim=-1), dim=-1)
                    pj = torch.exp(ld[:, n_win:] - lse[:, None])  # [H, |Sel|]
                    pred_scores = scores[sel]
                else:
                    lw = scale * (qd @ win.detach().t())
                    lc = scale * (qd @ ckv[:n_vis].detach().t())
                    lse = torch.logaddexp(
                        torch.logsumexp(torch.cat((lw, sink_d[:, None]), dim=-1), dim=-1),
                        torch.logsumexp(lc, dim=-1),
                    )
                    pj = torch.exp(lc - lse[:, None])  # [H, n_vis]
                    pred_scores = scores
                target = pj.sum(dim=0)
                target = target / target.sum()
                log_pred = torch.log_softmax(pred_scores, dim=-1)
                kl_terms.append((torch.xlogy(target, target) - target * log_pred).sum())

    zero = x.new_zeros(hidden)
    out = torch.stack([row if row is not None else zero for row in out_rows]) if T else x.new_zeros((0, hidden))

    loss = None
    if kind == "C":
        n_real = cu[-1]
        total = torch.stack(kl_terms).sum() if kl_terms else x.new_zeros(())
        loss = float(cfg.indexer_loss_coeff) * total / max(n_real, 1)
    if info is not None:
        info["selected"] = selected
        info["topk_margin"] = margin
    return out, loss
