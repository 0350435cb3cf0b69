"""The one Point -> Case conversion (:func:`dsv4cp.sweeps.measure.point_case`), the Case's timing fields
and the harness's emulation of every rank (:mod:`dsv4cp.harness.emulate`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dsv4cp.harness.build import build_step
from dsv4cp.harness.case import Case
from dsv4cp.harness.emulate import emulate_each_rank, emulated_ranks
from dsv4cp.sweeps.measure import point_case, point_inputs, point_split
from dsv4cp.sweeps.spec import make_point

CPU = torch.device("cpu")


def _point(seed: int, **axes):
    return make_point({"preset": "tiny", "tokens": 512, "cp": 2, "packing": "histogram", "partition": "balanced",
                       "seed": seed % 1000, **axes})


def test_point_case_computes_the_inputs_and_split_it_is_not_given(seed):
    point = _point(seed)
    cfg, lengths = point_inputs(point)
    given = point_case(point, cfg, lengths, point_split(point, cfg, lengths), CPU)  # as .ci/gate_worker calls it
    assert point_case(point) == given
    assert given.lengths == tuple(lengths) and given.split == point_split(point, cfg, lengths).bounds
    others = {point_case(dataclasses.replace(point, seed=point.seed + k)).lengths for k in (1, 2, 3)}
    assert others - {given.lengths}  # the seed draws the documents: the defaults are the point's own
    steps = [build_step(case, rank=1) for case in (given, point_case(point))]
    assert torch.equal(steps[0].x, steps[1].x) and torch.equal(steps[0].upstream, steps[1].upstream)


def test_a_measured_point_needs_its_split_and_the_timing_axes_reach_the_case(seed):
    measured = _point(seed, partition="measured")
    with pytest.raises(ValueError, match="^partition: a measured split comes from measurements"):
        point_case(measured)
    case = point_case(_point(seed, fresh_batches=3, partition="equal"))
    assert (case.fresh_batches, case.cuda_graph) == (3, False)
    with pytest.raises(ValueError, match="^fresh_batches: CUDA-graph replays run the one captured batch"):
        point_case(_point(seed, fresh_batches=2, cuda_graph=True, partition="equal"))


@pytest.mark.parametrize(("fields", "message"), [
    ({"fresh_batches": 1}, "^fresh_batches: must be 0 .one batch. or an int >= 2, got 1"),
    ({"fresh_batches": True}, "^fresh_batches: must be 0 .one batch. or an int >= 2, got True"),
    ({"cuda_graph": "yes"}, "^cuda_graph: must be true or false, got 'yes'"),
    ({"cuda_graph": True, "fresh_batches": 4}, "^fresh_batches: CUDA-graph replays run the one captured batch, "
                                               "got fresh_batches 4"),
])
def test_the_case_names_a_bad_timing_field_and_its_value(fields, message):
    with pytest.raises(ValueError, match=message):
        Case(**fields)


def test_every_rank_runs_in_its_own_emulated_group_and_none_outlives_it():
    case = Case(lengths=(96,), split=(0, 32, 64, 96))
    seen = list(emulate_each_rank(case, 3, lambda rank, group: (group.rank(), group.size(), dist.is_initialized()),
                                  ranks=[2, 0]))
    assert seen == [(2, (2, 3, True)), (0, (0, 3, True))]
    assert not dist.is_initialized()

    def failing(rank, group):
        raise RuntimeError(f"measuring rank {rank}")

    with pytest.raises(RuntimeError, match="measuring rank 1"):  # a failing rank still destroys its group
        list(emulate_each_rank(case, 3, failing, ranks=[1]))
    assert not dist.is_initialized()


@pytest.mark.parametrize(("cp", "ranks", "message"), [
    (1, None, "^cp: emulating every rank needs cp >= 2, got 1"),
    (3, [0, 0], r"^ranks: must be distinct ranks in \[0, 3\), got \[0, 0\]"),
    (3, [3], r"^ranks: must be distinct ranks in \[0, 3\), got \[3\]"),
    (3, [], r"^ranks: must be distinct ranks in \[0, 3\), got \[\]"),
])
def test_bad_ranks_are_refused_before_any_group(cp, ranks, message):
    with pytest.raises(ValueError, match=message):
        emulated_ranks(cp, ranks)
    assert emulated_ranks(3) == [0, 1, 2]


def test_a_split_of_other_ranks_is_refused_before_any_group():
    with pytest.raises(ValueError, match="^split: the Case's split has 2 ranks, emulating cp 3"):
        list(emulate_each_rank(Case(lengths=(64,), split=(0, 32, 64)), 3, lambda rank, group: None))
    assert not dist.is_initialized()
