"""Zero tolerance on SM90, chained: where the tested GEMMs are DeepGEMM's SM90 kernel and its
act_quant declares the H200's Triton gate, the chained run is compared against the golden's SM90
chain (reference/moe.py `sm90_chain`) with every stage bit for bit (docs/tolerance.md "Zero
tolerance on SM90"). The CPU has no SM90: `sm90_device` is forced, and the tested chains
(tests/tester/sm90_chain_backends.py; NoFmaPromotion in moe_verify/examples) compute what the
hardware computes with the golden's own hardware recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_verify.examples import NoFmaPromotion
from moe_verify.run import sm90_chain
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Stage, StageContext
from reference.moe import ReferenceBackend
from tests.tester import sm90_chain_backends as cb
from tolerance.policy import ACT_QUANT_BITWISE, GATHER_BITWISE, SHARED_BITWISE

pytestmark = pytest.mark.cpu

BASE = MoEProblem(tokens=16, hidden=256, intermediate=128, num_experts=4, topk=2, alignment=32)
# Big enough that promoting without the FMA moves a bf16 output (3 of 65,536 in gemm1 here).
WIDE = MoEProblem(tokens=64, hidden=1024, intermediate=256, num_experts=4, topk=2, alignment=32)


@dataclass(frozen=True)
class Case:
    label: str
    problem: MoEProblem


CASES = [
    Case(f"{label}-{fmt}", problem.replace(scale_fmt=fmt))
    for label, problem in (
        ("m_indices", BASE),
        ("psum", BASE.replace(grouped_layout="psum")),
        ("masked", BASE.replace(topology="ep:2+ll")),
    )
    for fmt in ("float32", "float32_ceil_ue8m0")
]


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor counts as lying on an SM90 GPU."""
    monkeypatch.setattr(sm90_chain, "sm90_device", lambda t: True)


def by_stage(results) -> dict:
    """{stage: result}, the stages of rank 0 (the only rank, or the first of several)."""
    out: dict = {}
    for r in results:
        out.setdefault(r.stage, r)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_the_sm90_chain_passes_every_stage_bit_for_bit(case: Case, sm90: None, record_report):
    report = record_report(verify(case.problem, backend=cb.Sm90Chain(engine="triton"), mode="both"))
    assert report.passed, report.failure_messages()
    chained = by_stage(report.chained)
    for stage in (Stage.GEMM1, Stage.GEMM2):
        (bits,) = [c for c in chained[stage].checks if c.name.endswith(" bits")]
        assert bits.limit == 0 and bits.value == 0 and chained[stage].recipe == "tensor_core"
    act = chained[Stage.ACT_QUANT]
    assert act.recipe.endswith("_sm90_triton")
    assert {c.reason for c in act.checks if c.limit == 0} >= {ACT_QUANT_BITWISE.code_dist.reason}
    gather = chained[Stage.GATHER]
    assert any(c.reason == GATHER_BITWISE.ulp.reason and c.limit == 0 for c in gather.checks)
    # isolated: the declared hardware gate makes act_quant bitwise there too
    isolated = by_stage(report.isolated)[Stage.ACT_QUANT]
    assert isolated.recipe == act.recipe
    assert all(c.limit == 0 for c in isolated.checks if c.name.startswith(("code", "scale")))


@pytest.mark.parametrize(
    ("backend", "problem"),
    [(NoFmaPromotion, WIDE), (cb.OneUlpChain, BASE)],
    ids=["promotion-without-fma", "one-ulp"],
)
def test_a_planted_fault_fails_bitwise_and_passes_the_bounds(
    backend: type, problem: MoEProblem, sm90: None, record_report
) -> None:
    """Side by side: the bitwise chain names gemm1 first; the same run against the fp32 chain
    and its bounds (gemm_recipe fp32_dequant) passes every stage."""
    bitwise = record_report(verify(problem, backend=backend(engine="triton"), mode="chained"))
    assert not bitwise.passed and bitwise.first_failure.startswith(Stage.GEMM1)
    gemm1 = by_stage(bitwise.chained)[Stage.GEMM1]
    (bits,) = gemm1.failed_checks
    assert bits.value >= 1 and "differ from the tensor-core recipe bit for bit" in bits.detail
    bounded = record_report(
        verify(
            problem, backend=backend(engine="triton"), mode="chained", gemm_recipe="fp32_dequant"
        )
    )
    assert bounded.passed, bounded.failure_messages()


class NoGateFacts(cb.Sm90Chain):
    """The SM90 chain's GEMMs, and an act_quant that reports no gate facts (the interpreter's,
    someone else's kernel), so nothing declares its recipe."""

    def act_quant(self, ctx: StageContext):
        outs = super().act_quant(ctx)
        return {k: v for k, v in outs.items() if not k.startswith("gate_")}


@pytest.mark.parametrize("gemm_recipe", [None, "tensor_core"], ids=["automatic", "asked-for"])
def test_no_declared_act_quant_recipe_no_chain(
    gemm_recipe: str | None, sm90: None, monkeypatch: pytest.MonkeyPatch, record_report
) -> None:
    """GEMMs held to the tensor core, but an act_quant whose recipe nobody declares: the chain's
    gemm2 would read one recipe's a2q while the matcher may pass the stage on another, so the
    chained run keeps the fp32 golden and its bounds, asked for or not, and the SM90 chain is
    not computed."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the SM90 chain ran although no act_quant recipe was declared")

    monkeypatch.setattr(ReferenceBackend, "sm90_chain", refuse)
    backend = NoGateFacts(engine="triton")
    report = record_report(verify(BASE, backend=backend, mode="chained", gemm_recipe=gemm_recipe))
    assert report.passed, report.failure_messages()
    assert by_stage(report.chained)[Stage.GEMM2].recipe is None


def test_another_triton_keeps_the_bounds(sm90: None, record_report) -> None:
    """Gate facts from another Triton version than the table's: not declared, not bitwise."""

    class OtherTriton(cb.Sm90Chain):
        def act_quant(self, ctx: StageContext):
            return {**super().act_quant(ctx), "gate_triton": "0.0.0"}

    report = record_report(verify(BASE, backend=OtherTriton(engine="triton"), mode="both"))
    for results in (report.isolated, report.chained):
        act = by_stage(results)[Stage.ACT_QUANT]
        assert not any(c.limit == 0 and c.name.startswith("code") for c in act.checks)


def test_the_chain_golden_refuses_a_recipe_the_problem_has_not() -> None:
    from moe_verify.run.inputs import make_inputs

    golden = ReferenceBackend()
    x = make_inputs(BASE)
    trace = golden.run(BASE, x)
    with pytest.raises(ValueError, match="not a legitimate act_quant recipe"):
        golden.sm90_chain(BASE, x, trace, "bf16_steps")


def test_legitimately_other_route_weights_are_summed_by_the_chain(sm90: None, record_report):
    """Route weights a renormalization sum order apart (within the route bound): the chain's
    gather sums with the tested weights, so the gather is still bitwise and passes."""
    report = record_report(verify(WIDE, backend=cb.OtherSumOrder(engine="triton"), mode="chained"))
    assert report.passed, report.failure_messages()
    route = by_stage(report.chained)[Stage.ROUTE]
    (weights,) = [c for c in route.checks if c.name == "topk_weights"]
    assert weights.value == cb.OtherSumOrder.ULPS  # they do differ


def test_another_quant_recipe_keeps_the_chained_bounds(sm90: None, record_report) -> None:
    """A tested quant_input that matches the other legitimate recipe feeds the GEMMs other
    operands than the golden's chain starts from: the chained run keeps the fp32 golden and its
    bounds, and passes."""
    problem = WIDE.replace(scale_fmt="float32")
    report = record_report(
        verify(problem, backend=cb.ReciprocalQuant(engine="triton"), mode="chained")
    )
    chained = by_stage(report.chained)
    assert chained[Stage.QUANT_INPUT].recipe == "triton_reciprocal"  # it did differ
    assert report.passed, report.failure_messages()
    assert chained[Stage.GEMM1].recipe is None  # not held to the chain's bits


K4 = MoEProblem(tokens=32, hidden=256, intermediate=128, num_experts=8, topk=4, alignment=32)


@pytest.mark.parametrize("gemm_recipe", [None, "fp32_dequant"], ids=["sm90-chain", "bounds"])
def test_a_route_in_another_slot_order_is_compared_slot_by_expert(
    gemm_recipe: str | None, sm90: None, record_report
) -> None:
    """A token's experts in another order are the same routing: the chained stages after route
    are keyed by the golden's slot of each expert, and the SM90 chain's gather sums in the
    tested order, so the correct kernel passes, bit for bit where the chain applies."""
    report = record_report(
        verify(
            K4, backend=cb.RotatedSlots(engine="triton"), mode="chained", gemm_recipe=gemm_recipe
        )
    )
    assert report.passed, report.failure_messages()
    gather = by_stage(report.chained)[Stage.GATHER]
    bitwise = any(c.reason == GATHER_BITWISE.ulp.reason for c in gather.checks)
    assert bitwise is (gemm_recipe is None)


SHARED = BASE.replace(shared_experts=1)


def test_shared_experts_join_the_chain_bit_for_bit(sm90: None, record_report) -> None:
    report = record_report(verify(SHARED, backend=cb.Sm90Chain(engine="triton"), mode="chained"))
    assert report.passed, report.failure_messages()
    shared = by_stage(report.chained)[Stage.SHARED]
    assert any(c.reason == SHARED_BITWISE.ulp.reason and c.limit == 0 for c in shared.checks)


def test_shared_experts_off_the_hardware_fail_bitwise_and_pass_the_bounds(
    sm90: None, record_report
) -> None:
    bitwise = record_report(verify(SHARED, backend=cb.Fp32Shared(engine="triton"), mode="chained"))
    assert bitwise.first_failure.startswith(Stage.SHARED), bitwise.failure_messages()
    bounded = record_report(
        verify(SHARED, backend=cb.Fp32Shared(engine="triton"), mode="chained",
               gemm_recipe="fp32_dequant")
    )  # fmt: skip
    assert bounded.passed, bounded.failure_messages()
