"""Where the router weight is applied, declared: the problem says it (`router_weight`), the golden
and the optimized path follow it, and a quant_input that applies it elsewhere fails there with a
"router weight" check (moe_verify/examples/router_weight.py, tolerance/stages/router_weight.py,
docs/stage-contract.md#router-weight)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.examples.router_weight import WeightOnInput, WeightOnScales, WeightTwice
from moe_verify.run.inputs import make_inputs
from moe_verify.run.verify import verify
from moe_verify.spec import (
    ROUTER_WEIGHT,
    MoEProblem,
    Outputs,
    RouterWeight,
    Stage,
    StageContext,
    StageDelegate,
    Status,
    call_stage,
)
from optimized import OptimizedBackend
from reference import formats, moe
from reference.recipes import routed_scaling_recipes
from reference.routing import router_weighted_input

pytestmark = pytest.mark.cpu

# Top-1 with softmax weights below 1 (renormalizing one weight would make every weight 1.0).
TOP1 = dict(hidden=128, intermediate=256, num_experts=4, topk=1, alignment=32, renormalize=False)
ON_INPUT = dict(TOP1, router_weight="input")
CASES = [
    MoEProblem(tokens=8, **ON_INPUT),
    MoEProblem(tokens=1, **ON_INPUT),  # T = 1
    MoEProblem(tokens=9, topology="tp:2", **ON_INPUT),  # every rank weights every token
    MoEProblem(tokens=12, topology="ep:2", **ON_INPUT),  # a token's row is 0 on the other rank
    MoEProblem(tokens=12, topology="ep:2+ht", **ON_INPUT),  # received tokens' weights
    MoEProblem(tokens=8, topology="ep:2+ll", **ON_INPUT),  # the batched combine sums with 1
    MoEProblem(tokens=8, recipe="mxfp8", scale_fmt="ue8m0_packed", **ON_INPUT),  # E8M0 bytes
]
IN_GATHER = MoEProblem(tokens=8, **TOP1)


# -- the problem ---------------------------------------------------------------------------------


def test_the_convention_round_trips_and_names_the_case() -> None:
    p = CASES[0]
    assert p.router_weight is RouterWeight.INPUT
    assert p.id == "fp8_block-tp1-T8-H128-I256-E4-k1-softmax-A32-weight_on_input"
    assert MoEProblem.from_dict(p.to_dict()) == p
    assert p.to_dict()["router_weight"] == "input"
    older = {k: v for k, v in p.to_dict().items() if k != "router_weight"}  # an older problem.json
    assert MoEProblem.from_dict(older).router_weight is RouterWeight.GATHER
    assert "weight_on_input" not in IN_GATHER.id


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"topk": 2}, ("MoEProblem.router_weight", "topk=1 only", "got topk=2")),
        ({"renormalize": True}, ("MoEProblem.router_weight", "weight 1.0", "renormalize")),
        ({"provenance": True}, ("MoEProblem.router_weight", "provenance")),
    ],
    ids=["top2", "weights-all-one", "provenance"],
)
def test_the_weight_on_the_input_is_refused_where_it_is_undefined_or_verifies_nothing(
    changes: dict, needles: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as info:
        MoEProblem(**{**ON_INPUT, "tokens": 8, **changes})
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_grouped_routing_weights_carry_the_factor_into_the_input() -> None:
    """One reading of routed_scaling_factor: the weights carry it into the input (the gather's
    sum times the factor would apply it twice)."""
    grouped = dict(routing="grouped", num_expert_group=2, topk_group=1)
    p = MoEProblem(tokens=8, **{**ON_INPUT, **grouped, "routed_scaling_factor": 2.5})
    assert routed_scaling_recipes(p) == ()
    assert len(routed_scaling_recipes(p.replace(router_weight="gather"))) == 2


# -- the golden ----------------------------------------------------------------------------------


def test_the_weight_is_rounded_to_bf16_and_the_product_once() -> None:
    hidden = torch.tensor([[3.0, 1.0234375], [1.5, -2.0]], dtype=torch.bfloat16)
    weights = torch.tensor([[0.3], [0.5]])
    # bf16(0.3) = 77/256; 3 * 77/256 = 231/256 exactly (an fp32 weight would give 0.8984375);
    # 1.0234375 * 77/256 = 0.30783..., to the nearest bf16 (2^-9 apart here): 0.30859375
    assert router_weighted_input(hidden, weights).tolist() == [
        [0.90234375, 0.30859375],
        [0.75, -1.0],
    ]


def test_the_weighted_input_is_vllms_product_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    weights = torch.rand(64, 1, generator=gen)
    vllm = hidden * weights.to(hidden.dtype)  # fused_moe/prepare_finalize/no_dp_ep.py, 0.32.0
    assert torch.equal(
        router_weighted_input(hidden, weights).view(torch.int16), vllm.view(torch.int16)
    )


def test_the_golden_quantizes_the_weighted_input_and_sums_with_weight_one() -> None:
    p = CASES[0]
    x = make_inputs(p, "cpu")
    trace = moe.run(p, x)
    weights = trace[Stage.ROUTE]["topk_weights"]
    assert bool((weights < 1).all()), "top-1 weights below 1, or nothing is verified"
    q, s = formats.quantize_fp8_groups(
        router_weighted_input(x.hidden_states, weights), 128, p.scale_fmt
    )
    assert torch.equal(trace[Stage.QUANT_INPUT]["a1q"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(trace[Stage.QUANT_INPUT]["a1q_scale"], s)
    # top-1, every slot live: each token's output is its one mm2 row, times 1
    rows = trace[Stage.PERMUTE]["inv_perm"][:, 0].long()
    mm2 = trace[Stage.GEMM2]["mm2"]
    assert torch.equal(trace[Stage.GATHER]["out"].view(torch.int16), mm2[rows].view(torch.int16))


def test_each_golden_carries_the_other_conventions_quant_input_beside() -> None:
    on_input = moe.run(CASES[0], make_inputs(CASES[0], "cpu"))
    in_gather = moe.run(IN_GATHER, make_inputs(IN_GATHER, "cpu"))
    other = in_gather[Stage.QUANT_INPUT]
    assert other["router_weight_outputs"]["input"]["a1q"] == "a1q@router_weight_input"
    assert torch.equal(
        other["a1q@router_weight_input"].view(torch.uint8),
        on_input[Stage.QUANT_INPUT]["a1q"].view(torch.uint8),
    )
    back = on_input[Stage.QUANT_INPUT]
    assert torch.equal(
        back["a1q@router_weight_gather"].view(torch.uint8), other["a1q"].view(torch.uint8)
    )
    two = MoEProblem(tokens=8, **{**TOP1, "topk": 2})
    assert "router_weight_outputs" not in moe.run(two, make_inputs(two, "cpu"))[Stage.QUANT_INPUT]


# -- verdicts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_the_optimized_path_follows_the_problem(problem: MoEProblem) -> None:
    report = verify(problem, backend="optimized", engine="triton", mode="both")
    assert report.passed_strict, report.summary_line()


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_a_declared_weight_on_the_input_passes(problem: MoEProblem) -> None:
    report = verify(problem, backend=WeightOnInput(engine="triton"), mode="both")
    assert report.passed_strict, report.summary_line()


def _first_failure(backend: object, problem: MoEProblem, mode: str) -> tuple[str, list]:
    report = verify(problem, backend=backend, mode=mode)
    first = report.first_failing_result
    assert first is not None, report.summary_line()
    return first.stage, first.failed_checks


@pytest.mark.parametrize("mode", ["isolated", "chained"])
def test_a_declared_weight_on_the_input_fails_a_gather_problem_at_quant_input(mode: str) -> None:
    stage, failed = _first_failure(WeightOnInput(engine="triton"), IN_GATHER, mode)
    assert stage == Stage.QUANT_INPUT
    assert failed[0].name == "router weight"
    assert "declares router_weight='input'" in failed[0].detail
    assert "the problem's is 'gather'" in failed[0].detail


class Undeclared(WeightOnInput):
    """The weight on the input, declared by nobody: the outputs say it."""

    name = "weight-on-input-undeclared"

    def quant_input(self, ctx: StageContext) -> Outputs:
        outputs = super().quant_input(ctx)
        return {k: v for k, v in outputs.items() if k != ROUTER_WEIGHT}


class InGatherAlways(StageDelegate):
    """The optimized path's quant_input as for a problem weighted in the gather, undeclared."""

    name = "in-gather-always"

    def __init__(self) -> None:
        super().__init__(OptimizedBackend(engine="triton"), self.name)

    def quant_input(self, ctx: StageContext) -> Outputs:
        in_gather = ctx.problem.replace(router_weight=RouterWeight.GATHER)
        return call_stage(self.inner, Stage.QUANT_INPUT, ctx.replace(problem=in_gather))


@pytest.mark.parametrize("mode", ["isolated", "chained"])
@pytest.mark.parametrize(
    ("backend", "problem", "applied", "wanted"),
    [
        (Undeclared(engine="triton"), IN_GATHER, "input", "gather"),
        (InGatherAlways(), CASES[0], "gather", "input"),
    ],
    ids=["on-input-for-gather", "in-gather-for-input"],
)
def test_an_undeclared_convention_is_named_by_its_outputs(
    backend: object, problem: MoEProblem, applied: str, wanted: str, mode: str
) -> None:
    stage, failed = _first_failure(backend, problem, mode)
    assert stage == Stage.QUANT_INPUT
    assert failed[0].name == "router weight"
    assert f"a1q matches the golden's under router_weight='{applied}'" in failed[0].detail
    assert f"the problem's is '{wanted}'" in failed[0].detail


def test_an_undeclared_match_of_the_problems_convention_passes() -> None:
    report = verify(CASES[0], backend=Undeclared(engine="triton"), mode="isolated")
    assert report.passed_strict, report.summary_line()


def test_a_quant_input_wrong_otherwise_does_not_blame_the_convention() -> None:
    """Weighted on the input for a gather problem and one code also wrong: the other
    convention does not make it pass, so it is not offered as the explanation."""

    class AlsoWrong(Undeclared):
        def quant_input(self, ctx: StageContext) -> Outputs:
            outputs = super().quant_input(ctx)
            a1q = outputs["a1q"].clone()
            a1q.view(torch.uint8)[0, 0] ^= 1
            return {**outputs, "a1q": a1q}

    stage, failed = _first_failure(AlsoWrong(engine="triton"), IN_GATHER, "isolated")
    assert stage == Stage.QUANT_INPUT
    assert "router weight" not in [c.name for c in failed]


@pytest.mark.parametrize("mode", ["isolated", "chained"])
def test_the_weight_applied_twice_fails_at_gather(mode: str) -> None:
    stage, failed = _first_failure(WeightTwice(engine="triton"), CASES[0], mode)
    assert stage == Stage.GATHER
    assert "router weight" not in [c.name for c in failed]


@pytest.mark.parametrize("mode", ["isolated", "chained"])
def test_the_weight_on_the_scales_fails_at_quant_input(mode: str) -> None:
    stage, failed = _first_failure(WeightOnScales(engine="triton"), CASES[0], mode)
    assert stage == Stage.QUANT_INPUT
    assert "router weight" not in [c.name for c in failed]
    assert {c.name for c in failed} >= {"a1q_scale"}


def test_an_unknown_router_weight_breaks_the_contract() -> None:
    class Sideways(WeightOnInput):
        def quant_input(self, ctx: StageContext) -> Outputs:
            return {**super().quant_input(ctx), ROUTER_WEIGHT: "sideways"}

    report = verify(CASES[0], backend=Sideways(engine="triton"), mode="isolated")
    (quant,) = [r for r in report.isolated if r.stage == Stage.QUANT_INPUT]
    assert quant.status is Status.FAIL
    assert "expected one of ['gather', 'input'], got 'sideways'" in quant.reason + str(
        [c.detail for c in quant.checks]
    )
