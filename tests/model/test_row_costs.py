"""One cost model: the balanced split's per-row costs (:mod:`dsv4cp.model.row_costs`) are the layer
estimate's accounting (:mod:`dsv4cp.model.costs`) per unit of work, so summed over the rows they give the
estimate's per-phase-class FLOPs, and with a machine its FLOP seconds plus the top-k's score reads."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.model import Machine, estimate
from dsv4cp.model.costs import unit_costs
from dsv4cp.model.phase_classes import MODEL_PHASE_CLASS, PHASE_CLASSES
from dsv4cp.model.row_costs import RowCosts, class_unit_costs, row_costs
from dsv4cp.workloads import pack_lengths

TOKENS, CP = 65536, 4
TAIL = 700
"""Rows of tail padding after the documents: projected, seeing no key."""

RTOL = 1e-12
"""Same formulas, summed in another order: float64 rounding only."""

POOLED_SHARE = 1e-2
"""Bound on the share of a compressor's per-row FLOPs spent per pooled entry (pooling, the indexer
keys' rotation): ``~1 / hidden`` of its projections. The per-row costs charge every row ``1 / r`` of an
entry, the estimate only the entries a document completes, so on the compressors the two differ by at
most this share of the rows that complete no entry (tail padding, documents' trailing partial groups)."""


def _class_flops(est, direction: str) -> dict[str, float]:
    """The estimate's FLOPs per phase class in ``direction`` without the halo's (summed over ranks)."""
    table = est.table(direction)
    table = table[table["phase"].isin(MODEL_PHASE_CLASS.keys())]
    work = (table["flops"] - table["redundant_flops"]).groupby(table["phase"].map(MODEL_PHASE_CLASS)).sum()
    return {name: float(work.get(name, 0.0)) for name in PHASE_CLASSES}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("packing", ["one", "histogram", "adversarial"])
@pytest.mark.parametrize(("ratio", "loss"), [(0, "sparse"), (4, "sparse"), (4, "dense"), (128, "sparse")])
def test_row_costs_sum_to_the_estimates_class_flops(ratio: int, loss: str, packing: str, direction: str,
                                                    seed: int) -> None:
    cfg = DSv4Config.preset("flash", indexer_loss=loss)
    lengths = pack_lengths(TOKENS - TAIL, packing, seed=seed % 1000, cp=CP, ratio=ratio)
    est = estimate(cfg, ratio, lengths, CP, Machine(), total=TOKENS)
    want = _class_flops(est, direction)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    unpooled = TOKENS - ratio * sum(n // ratio for n in lengths) if ratio else 0  # rows completing no entry
    for name, terms in class_unit_costs(cfg, ratio, direction).items():
        got = float(row_costs(RowCosts(*terms), cu, TOKENS, cfg, ratio).sum())
        if name == "compressors" and want[name] > 0:
            assert 0 <= got - want[name] <= want[name] * POOLED_SHARE * unpooled / TOKENS, (got, want[name])
        else:
            assert got == pytest.approx(want[name], rel=RTOL, abs=0), (name, got, want[name])
    touched = {c for c, v in want.items() if v > 0}
    expected = {"W": {"attention", "projections"}, "H": {"attention", "projections", "compressors"}}
    c_layer = set(PHASE_CLASSES) - ({"indexer"} if direction == "bwd" else set())  # the selection: forward only
    assert touched == expected.get(layer_kind(ratio), c_layer)


def test_machine_row_costs_are_flop_seconds_plus_the_topk_reads() -> None:
    """At a machine's ceilings every class costs its FLOPs at the peak; the indexer also pays the top-k's
    fp32 score read per visible entry at the memory bandwidth (forward only: the selection has no backward)."""
    cfg = DSv4Config.preset("flash")
    machine = Machine(peak_flops=1e12, hbm_bandwidth=1e11)
    for direction in ("fwd", "bwd"):
        flops, seconds = class_unit_costs(cfg, 4, direction), class_unit_costs(cfg, 4, direction, machine)
        topk = unit_costs(cfg, 4)["indexer.topk"]["fwd"]["hbm_bytes"][2] if direction == "fwd" else 0.0
        assert topk == (4.0 if direction == "fwd" else 0.0)
        for name in PHASE_CLASSES:
            want = flops[name] / 1e12
            want[2] += topk / 1e11 if name == "indexer" else 0.0
            np.testing.assert_allclose(seconds[name], want, rtol=1e-15, atol=0)
    step = RowCosts.for_layer(cfg, 4, machine)
    passes = [RowCosts.for_layer(cfg, 4, machine, d) for d in ("fwd", "bwd")]
    for field in ("per_row", "per_window_key", "per_visible_entry", "per_compressed_key"):
        assert getattr(step, field) == pytest.approx(sum(getattr(p, field) for p in passes), rel=1e-14)
