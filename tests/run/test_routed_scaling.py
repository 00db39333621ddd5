"""SGLang's convention for routed_scaling_factor as a declared reading of the contract: a backend
whose route returns unscaled weights (declaring scale_on_output) and whose gather multiplies the
fp32 sum by the factor passes in both modes; isolated mode hands its gather the golden's unscaled
weights (moe_verify/run/runner.py `fed_upstream`). Each near miss fails at its own stage
(tests/tester/routed_scaling_backends.py). No engine needed.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.run import sm90_chain
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import fed_upstream
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Routing, Stage, Trace
from reference.moe import ReferenceBackend
from tests.tester import routed_scaling_backends as rs
from tolerance.policy import GATHER_BITWISE

pytestmark = pytest.mark.cpu

# DeepSeek-V3's routing on a small layer: 4 groups of 2 experts, the best 2 groups, factor 2.5.
GROUPED = MoEProblem(
    tokens=16, hidden=128, intermediate=128, num_experts=8, topk=2, alignment=32,
    routing=Routing.GROUPED, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
)  # fmt: skip
EP = GROUPED.replace(topology="ep:2")  # remote slots skipped on each rank


@pytest.mark.parametrize("problem", [GROUPED, EP], ids=lambda p: p.id)
def test_scale_on_output_passes_in_both_modes(problem: MoEProblem, record_report) -> None:
    report = record_report(verify(problem, backend=rs.ScaleOnOutput(engine="triton"), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for mode in ("isolated", "chained"):
        assert report.recipes(mode)[Stage.ROUTE] == rs.ON_OUTPUT, report.recipes(mode)
    # isolated, the gather is matched against the scale_on_output reading's two roundings
    assert report.recipes("isolated")[Stage.GATHER] == "mul_add+scale_on_output"


def test_without_a_factor_the_convention_is_the_plain_one(record_report) -> None:
    """Factor 1: the route declares nothing and the gather multiplies by 1; nothing to choose."""
    plain = GROUPED.replace(routed_scaling_factor=1.0)
    report = record_report(verify(plain, backend=rs.ScaleOnOutput(engine="triton"), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    assert Stage.ROUTE not in report.recipes("isolated")


@pytest.mark.parametrize(
    ("backend", "stage"),
    [
        (rs.ScaledTwice, Stage.GATHER),  # scaled weights fed, the factor applied again
        (rs.DeclaresOnOutputReturnsScaled, Stage.ROUTE),  # held to the unscaled weights
        (rs.NeverScales, Stage.GATHER),  # the unscaled sum, the factor forgotten
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_near_misses_fail_at_their_stage(backend: type, stage: str, record_report) -> None:
    report = record_report(verify(GROUPED, backend=backend(engine="triton"), mode="both"))
    assert not report.passed
    failing = {r.stage for r in report.isolated or [] if r.status.failing}
    assert failing == {stage}, f"isolated mode must blame {stage} alone: {report.summary_line()}"
    chained = [r for r in report.chained or [] if r.status.failing]
    assert chained and chained[0].stage == stage, report.summary_line()


def test_a_declared_reading_the_problem_lacks_fails_at_route(record_report) -> None:
    """scale_on_output declared where the factor is 1: the problem has one reading."""
    plain = GROUPED.replace(routed_scaling_factor=1.0)
    backend = rs.DeclaresOnOutputReturnsScaled(engine="triton")
    report = record_report(verify(plain, backend=backend, mode="isolated"))
    (route,) = [r for r in report.isolated or [] if r.stage == Stage.ROUTE]
    assert route.status.failing, route
    assert "not a legitimate recipe" in route.checks[0].detail


# The SM90 chain (docs/tolerance.md "Zero tolerance on SM90"): k = 4 of 8 experts in 4 groups;
# weights a few ulps off move a bf16 output only on enough elements (65,536 here: WIDE).
K4 = GROUPED.replace(tokens=32, hidden=256, topk=4)
WIDE = GROUPED.replace(tokens=64, hidden=1024, intermediate=256)


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor counts as lying on an SM90 GPU."""
    monkeypatch.setattr(sm90_chain, "sm90_device", lambda t: True)


@pytest.mark.parametrize(
    ("backend", "problem"),
    [
        (rs.ScaleOnOutputChain, K4),
        (rs.RotatedScaleOnOutputChain, K4),  # the chain sums in the tested slot order
        (rs.OtherSumOrderOnOutputChain, WIDE),  # ... with the tested unscaled weights
    ],
    ids=lambda x: getattr(x, "name", None) or x.id,
)
def test_the_sm90_chain_gathers_in_the_routes_reading(
    backend: type, problem: MoEProblem, sm90: None, record_report
) -> None:
    """Chained against the golden's SM90 chain, the gather is held bit for bit to the
    scale_on_output reading, on the tested route's unscaled weights in its own slot order."""
    report = record_report(verify(problem, backend=backend(engine="triton"), mode="chained"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    (gather,) = [r for r in report.chained or [] if r.stage == Stage.GATHER]
    assert any(c.reason == GATHER_BITWISE.ulp.reason and c.limit == 0 for c in gather.checks)
    assert gather.recipe == "mul_add+scale_on_output"


def test_isolated_mode_feeds_the_declared_reading() -> None:
    """The golden's route, bound to the reading the tested route declared: its unscaled weights
    under the contract's name, the declaration, and nothing of the other reading."""
    inputs = make_inputs(GROUPED)
    golden = ReferenceBackend().run(GROUPED, inputs)
    declared = Trace("tested")
    declared.add(Stage.ROUTE, {**golden[Stage.ROUTE], "recipe": rs.ON_OUTPUT})
    fed = fed_upstream(golden, declared, Stage.GATHER)[Stage.ROUTE]
    assert torch.equal(fed["topk_weights"], golden[Stage.ROUTE]["topk_weights@scale_on_output"])
    assert fed["recipe"] == rs.ON_OUTPUT
    assert not [k for k in fed if "@" in k or k == "recipe_outputs"], list(fed)
    undeclared = Trace("tested")
    undeclared.add(Stage.ROUTE, {"topk_ids": golden[Stage.ROUTE]["topk_ids"]})
    plain = fed_upstream(golden, undeclared, Stage.GATHER)[Stage.ROUTE]
    assert plain["topk_weights"] is golden[Stage.ROUTE]["topk_weights"]
