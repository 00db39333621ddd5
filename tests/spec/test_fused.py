"""Fused stage groups in the vocabulary: a group's declaration, the steps a problem's stages run
in, and the checks that refuse a group the forward cannot run (moe_verify/spec/fused.py)."""

from __future__ import annotations

import pytest

from moe_verify.examples.fused import FusedForward, QuantizingScatter
from moe_verify.spec import (
    BATCHED_STAGES,
    STAGES,
    FusedGroup,
    MoEInputs,
    MoEProblem,
    Outputs,
    Stage,
    StageContext,
    StageDelegate,
    call_group,
    check_backend_object,
    fused_groups,
    group_of,
    plan,
)
from optimized import OptimizedBackend

pytestmark = pytest.mark.cpu

Q, A, P = Stage.QUANT_INPUT, Stage.ALIGN, Stage.PERMUTE


def test_a_group_runs_in_the_place_of_its_last_stage() -> None:
    group = FusedGroup("scatter", (Q, P))
    steps = plan(STAGES, (group,))
    # align reads only route, so it runs before the group that ends at permute
    assert steps == (Stage.ROUTE, A, group, Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2, Stage.GATHER)
    assert group_of(steps, Q) is group and group_of(steps, A) is None


def test_the_whole_forward_is_one_step() -> None:
    group = FusedGroup("forward", STAGES)
    assert plan(STAGES, (group,)) == (group,)
    assert group.name == "route..gather (8 stages)"
    assert FusedGroup("g", (Stage.GEMM1, Stage.ACT_QUANT)).name == "gemm1+act_quant"


@pytest.mark.parametrize(
    ("stages", "groups", "says"),
    [
        # permute reads quant_input, so quant_input+gemm1 would have to hand it out mid-call
        (STAGES, [(Q, Stage.GEMM1)], "permute runs between its stages and reads quant_input"),
        # the batched layout has no permute
        (BATCHED_STAGES, [(Q, P)], "this problem does not run permute"),
        # declared out of the forward's order
        (STAGES, [(P, Q)], "the forward runs them as quant_input, permute"),
        # one stage claimed twice
        (STAGES, [(Q, P), (P, Stage.GEMM1)], "stage permute is in two fused groups"),
    ],
    ids=["reads-inside", "not-in-problem", "out-of-order", "twice"],
)
def test_a_group_the_forward_cannot_run_is_refused(
    stages: tuple[Stage, ...], groups: list[tuple[Stage, ...]], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        plan(stages, tuple(FusedGroup(f"g{i}", g) for i, g in enumerate(groups)))


@pytest.mark.parametrize(
    ("method", "stages", "error", "says"),
    [
        ("not a name", (Q, P), ValueError, "expected a method name"),
        ("one", (Q,), ValueError, "two or more distinct stages"),
        ("twice", (Q, Q), ValueError, "two or more distinct stages"),
        ("bogus", (Q, "nope"), ValueError, "'nope' is not a valid Stage"),
        ("cross", (Stage.GATHER, Stage.REDUCE), ValueError, "reduce is made across ranks"),
        ("kind", "quant_input", TypeError, "expected a tuple of stages"),
    ],
    ids=["method", "one-stage", "repeated", "unknown-stage", "reduce", "string"],
)
def test_a_malformed_group_is_refused(method: str, stages: object, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        FusedGroup(method, stages)  # type: ignore[arg-type]


def test_a_fused_backend_needs_no_method_for_its_groups_stages() -> None:
    check_backend_object(FusedForward())
    check_backend_object(QuantizingScatter())


def test_a_declared_group_without_its_method_is_named() -> None:
    class Missing(StageDelegate):
        fused_groups = (FusedGroup("scatter", (Q, P)),)

    with pytest.raises(TypeError, match=r"declares the fused group quant_input\+permute but has"):
        fused_groups(Missing(OptimizedBackend(), "missing"))


class Returns(StageDelegate):
    """A fused quant_input+permute returning whatever it is given."""

    fused_groups = (FusedGroup("scatter", (Q, P)),)

    def __init__(self, returned: object) -> None:
        super().__init__(OptimizedBackend(), "returns")
        self.returned = returned

    def scatter(self, ctx: StageContext) -> dict[str, Outputs]:
        return self.returned  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("returned", "error", "says"),
    [
        ({"quant_input": {}}, ValueError, "returned no permute outputs"),
        ({"permute": {}, "gemm1": {}}, ValueError, r"\['gemm1'\], not stages of its group"),
        ([{}], TypeError, "returned list; a fused group returns a dict"),
        ({"permute": 3}, TypeError, "permute is int, not a dict of outputs"),
    ],
    ids=["no-last", "foreign-stage", "not-a-dict", "outputs-not-a-dict"],
)
def test_what_a_group_returns_is_checked(returned: object, error: type, says: str) -> None:
    problem = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
    ctx = StageContext(problem, MoEInputs.__new__(MoEInputs), None, 0)  # type: ignore[arg-type]
    backend = Returns(returned)
    with pytest.raises(error, match=says):
        call_group(backend, fused_groups(backend)[0], ctx)
