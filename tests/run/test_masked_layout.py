"""The masked (batched) layout in every topology, not only under ep:N+ll: the problem runs
dispatch instead of align and permute, the golden and the optimized path agree in tp and plain
ep, a dispatch written from the contract passes, and one that puts a live slot past its batch's
masked_m fails at dispatch (docs/stage-contract.md#the-masked-layout-in-any-topology)."""

from __future__ import annotations

import pytest

from moe_verify.examples.masked import (
    PrePackedDispatch,
    SortedDispatch,
    SortedDispatchFromOne,
    UnwrittenFp32Padding,
)
from moe_verify.run.verify import verify
from moe_verify.spec import (
    BATCHED_STAGES,
    STAGES,
    GroupedLayout,
    MoEProblem,
    Stage,
    Status,
)
from optimized import OptimizedBackend

pytestmark = pytest.mark.cpu

SHAPE = dict(tokens=9, hidden=128, intermediate=256, num_experts=4, topk=2)


def masked(topology: str, **changes: object) -> MoEProblem:
    return MoEProblem(**SHAPE, topology=topology, grouped_layout="masked", **changes)


@pytest.mark.parametrize("topology", ["single", "tp:2", "ep:2", "ep:2:round_robin"])
def test_any_topology_runs_the_batched_stages(topology: str) -> None:
    p = masked(topology)
    assert p.batched and p.stages == BATCHED_STAGES
    assert p.id.endswith("-masked")
    assert MoEProblem.from_dict(p.to_dict()) == p
    contiguous = p.replace(grouped_layout=GroupedLayout.AUTO)
    assert not contiguous.batched and contiguous.stages == STAGES


def test_ep_ll_is_always_masked() -> None:
    ll = MoEProblem(**SHAPE, topology="ep:2+ll")
    assert ll.batched and ll.replace(grouped_layout="masked").batched
    for layout in ("m_indices", "psum"):
        with pytest.raises(ValueError, match=f"ep\\+ll dispatches .* got grouped_layout={layout}"):
            ll.replace(grouped_layout=layout)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"recipe": "mxfp8", "scale_fmt": "ue8m0_packed"}, "masked layout .* got recipe mxfp8"),
        ({"recipe": "mxfp4_w4a8", "scale_fmt": "ue8m0_packed"}, "got recipe mxfp4_w4a8"),
    ],
)
def test_the_masked_layout_refuses_what_it_does_not_run(changes: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        masked("tp:2", **changes)


def test_a_batch_capacity_needs_batches() -> None:
    assert masked("tp:2", ll_capacity=256).ll_max_tokens == 256
    with pytest.raises(ValueError, match="capacity of the masked layout.*topology tp2 has no"):
        MoEProblem(**SHAPE, topology="tp:2", ll_capacity=256)


@pytest.mark.parametrize("topology", ["tp:2", "ep:2"])
def test_a_dispatch_written_from_the_contract_passes(topology: str) -> None:
    report = verify(masked(topology), backend=SortedDispatch(engine="triton"), mode="both")
    assert report.exit_code == 0, report.failure_messages()
    stages = {r.stage for r in report.isolated}
    assert Stage.DISPATCH in stages and not stages & {Stage.ALIGN, Stage.PERMUTE}


def test_the_optimized_path_runs_the_masked_layout_with_shared_experts() -> None:
    p = masked("tp:2", shared_experts=1, scale_fmt="float32_ceil_ue8m0")
    report = verify(p, backend=OptimizedBackend(engine="triton"), mode="both")
    assert report.exit_code == 0, report.failure_messages()


@pytest.mark.parametrize("topology", ["tp:2", "ep:2"])
def test_a_slot_past_masked_m_fails_at_dispatch(topology: str) -> None:
    report = verify(masked(topology), backend=SortedDispatchFromOne(engine="triton"), mode="both")
    assert report.exit_code == 1
    for results in (report.isolated, report.chained):
        first = next(r for r in results if r.status is Status.FAIL)
        assert first.stage == Stage.DISPATCH, first
    rows = next(
        c for r in report.isolated if r.stage == Stage.DISPATCH for c in r.failed_checks
        if c.name == "expert rows"
    )  # fmt: skip
    assert "which no expert reads" in rows.detail, rows.detail


@pytest.mark.parametrize("topology", ["tp:2", "ep:2+ll"])
def test_packed_scales_run_in_the_batches(topology: str) -> None:
    """ue8m0_packed in the masked layout: act_quant's scales packed per batch (MN-major, word
    columns TMA-aligned to the batch's rows), and a dispatch that packs its own."""
    p = (
        masked(topology, scale_fmt="ue8m0_packed")
        if "ll" not in topology
        else MoEProblem(**SHAPE, topology=topology, scale_fmt="ue8m0_packed")
    )
    for backend in (OptimizedBackend(engine="triton"), PrePackedDispatch(engine="triton")):
        report = verify(p, backend=backend, mode="both")
        assert report.exit_code == 0, report.failure_messages()


def _dispatch_checks(report) -> dict[str, bool]:
    return {
        c.name: c.passed for r in report.isolated if r.stage == Stage.DISPATCH for c in r.checks
    }


def test_padding_rows_are_judged_where_deepgemm_reads_them() -> None:
    """Packed words handed over (no packer): rows past masked_m hold 0xFF and nothing judges
    them. fp32 scales in a UE8M0 format: DeepGEMM's packer reads every row of the batches, so a
    row past masked_m that is not a power of two fails; in plain float32 nothing packs them."""
    packed = verify(masked("tp:2", scale_fmt="ue8m0_packed"), backend=PrePackedDispatch("triton"))
    assert packed.exit_code == 0 and "padding scales" not in _dispatch_checks(packed)
    ceil = verify(
        masked("tp:2", scale_fmt="float32_ceil_ue8m0"), backend=UnwrittenFp32Padding("triton")
    )
    assert _dispatch_checks(ceil)["padding scales"] is False
    first = next(r for r in ceil.isolated if r.status is Status.FAIL)
    assert first.stage == Stage.DISPATCH
    plain = verify(masked("tp:2"), backend=UnwrittenFp32Padding("triton"))
    assert plain.exit_code == 0 and "padding scales" not in _dispatch_checks(plain)
