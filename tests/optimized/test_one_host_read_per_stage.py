"""Verification mode's value checks read the device once per stage: each kernel wrapper queues
its rules as device masks and reads them together (optimized/kernels/_validate.py `any_true`);
only a violation reads more, to name it. A read is a sync, and the syncs, not the checks' own
kernels, made verification mode 2.4x the production forward on the H100 (docs/perf.md)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.production.host_reads import HostReads
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    Engine,
    GroupedLayout,
    MoEProblem,
    ScaleFmt,
    Stage,
    StageContext,
    call_stage,
    run_stages,
)
from optimized import OptimizedBackend
from optimized.kernels._validate import InvalidKernelInput, any_true, unexplained
from optimized.kernels.gather import ep_gather
from optimized.topology import ShardCache

pytestmark = pytest.mark.cpu

BASE = MoEProblem(tokens=24, hidden=256, intermediate=256, num_experts=8, topk=2)
PROBLEMS = [
    BASE.replace(grouped_layout=GroupedLayout.PSUM),
    BASE.replace(grouped_layout=GroupedLayout.M_INDICES),
    BASE.replace(topology="ep:2", scale_fmt=ScaleFmt.UE8M0_PACKED),
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_each_checked_stage_reads_the_device_at_most_once(problem: MoEProblem) -> None:
    inputs = make_inputs(problem)
    backend, shard_of = OptimizedBackend(engine=Engine.TRITON), ShardCache()
    trace = run_stages(backend, problem, inputs, 0, shard_of=shard_of, engine=Engine.TRITON)
    reads = {}
    for stage in problem.stages:
        if stage is Stage.ROUTE:
            continue
        ctx = StageContext(problem, inputs, trace.upto(stage), 0, shard_of=shard_of)
        counted = HostReads()
        with counted.counting():
            call_stage(backend, stage, ctx)
        reads[stage.value] = counted.reads
    assert all(len(r) <= 1 for r in reads.values()), reads
    # the checks still run: align reads its ids once
    assert reads["align"] == ["__bool__"], reads


def test_any_true_reads_all_masks_at_once() -> None:
    assert not any_true()
    assert not any_true(torch.zeros(3, dtype=torch.bool), torch.zeros(0, dtype=torch.bool))
    assert any_true(torch.zeros(3, dtype=torch.bool), torch.tensor([False, True]))
    counted = HostReads()
    with counted.counting():
        any_true(*(torch.zeros(4, dtype=torch.bool) for _ in range(5)))
    assert len(counted.reads) == 1


def test_a_flag_no_check_names_is_an_error_not_a_launch() -> None:
    with pytest.raises(AssertionError, match="ep_gather: the batched input check flagged"):
        unexplained("ep_gather")


def test_a_batched_check_still_names_what_was_wrong() -> None:
    """A live slot whose inv_perm is past mm2: flagged in the batched read, then named."""
    mm2 = torch.zeros(8, 16, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)
    weights = torch.ones(2, 2)
    inv_perm = torch.tensor([[0, 9], [2, 99]], dtype=torch.int32)  # 9 is live and out of range
    with pytest.raises(InvalidKernelInput, match=r"inv_perm\[0, 1\] = 9 is outside \[0, 8\)"):
        ep_gather(mm2, ids, weights, inv_perm)
    inv_perm[0, 1] = 3  # 99 is a -1 slot's: not read, not a violation
    ep_gather(mm2, ids, weights, inv_perm)
