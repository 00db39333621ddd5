"""The tested side's second run of a metamorphic pair (tolerance/invariance.py INVARIANCES): the
pair of backends and problems a setting gives (`invariance_pair`: alignment, M_sum, the ep:N+ll
capacity, DeepGEMM's hints; two poisons are built by moe_verify/run/verify.py `tested_sides`),
and each stage's agreement check of the two runs (`with_agreement`). `verify` runs the pair rank
by rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_verify.run.options import check_invariance
from moe_verify.run.runner import RankRun, Side, resolve_backend
from moe_verify.spec import (
    LL_BLOCK_ROWS,
    Backend,
    Engine,
    Mode,
    MoEProblem,
    Status,
    TopologyKind,
)
from tolerance.compare import StageResult
from tolerance.invariance import Invariance, agreement


@dataclass(frozen=True)
class Twin:
    """The tested side's second run of a metamorphic pair: its backend and problem (the same
    problem, or one that differs only in the setting), the pair's label and the invariance."""

    backend: Backend | Side
    problem: MoEProblem
    label: str
    invariance: Invariance


def with_agreement(
    results: list[StageResult], first: RankRun, second: RankRun, mode: Mode, twin: Twin
) -> list[StageResult]:
    """`results` with each stage's agreement check of the metamorphic pair added (a stage whose
    two runs disagree fails, even where each run alone was within its tolerance of the golden)."""
    a, b = first.tested[mode], second.tested[mode]
    layouts = (a, b) if mode is Mode.CHAINED else (first.golden, second.golden)
    out = []
    for r in results:
        check = agreement(r.stage, a, b, twin.label, layouts, twin.invariance)
        if check is not None:
            status = r.status
            if not check.passed and status in (Status.PASS, Status.SKIP):
                status = Status.FAIL
            r = dataclasses.replace(r, checks=[*r.checks, check], status=status)
        out.append(r)
    return out


def invariance_pair(
    problem: MoEProblem, kind: str, backend: str | type | Backend, engine: Engine | str
) -> tuple[Backend, Backend, MoEProblem, str]:
    """The two tested backends and the second run's problem of the invariance `kind`
    (tolerance/invariance.py INVARIANCES), and the pair's label; a ValueError saying why where
    the setting has no second legal value here. The problem's settings (alignment,
    ll_capacity) pair any backend with itself on a second problem; the kernel settings (m_sum,
    expected_m, num_sms) are constructor arguments of optimized.OptimizedBackend and its
    subclasses."""
    check_invariance(kind)
    from optimized import OptimizedBackend

    first = resolve_backend(backend, engine)
    if kind in ("m_sum", "expected_m", "num_sms") and not isinstance(first, OptimizedBackend):
        raise ValueError(
            f"invariance {kind}: a setting of optimized.OptimizedBackend's constructor, so it "
            f"needs that backend or a module:Class subclass of it, got backend {backend!r}"
        )
    cls = type(first)
    deepgemm_only = kind in ("expected_m", "num_sms")
    if deepgemm_only and Engine(engine) is not Engine.DEEPGEMM:
        raise ValueError(f"invariance {kind}: a hint of DeepGEMM's, so it needs --engine deepgemm")
    if kind == "alignment":
        other = {128: 64, 64: 128}.get(problem.alignment)
        if other is None:
            raise ValueError(
                f"invariance alignment: pairs 64 with 128 (both legal SM90 BLOCK_Ms); the "
                f"problem's alignment is {problem.alignment}"
            )
        second = dataclasses.replace(problem, alignment=other)
        return first, first, second, f"{problem.alignment} vs {other}"
    if kind == "m_sum":
        if problem.topology.kind is TopologyKind.EP_HT or problem.batched:
            raise ValueError(
                f"invariance m_sum: {problem.layout_name} has no upper-bound M_sum to compare "
                "(ep:N+ht is exact, the masked layout batched)"
            )
        return first, cls(engine=engine, exact_m_sum=True), problem, "upper bound vs exact"
    if kind == "ll_capacity":
        if not problem.batched:
            raise ValueError(
                f"invariance ll_capacity: the batch capacity of the masked layout (ep:N+ll's "
                f"DeepEP max_tokens); {problem.layout_name} has no batches"
            )
        rows = problem.ll_max_tokens
        doubled = 2 * max(rows, LL_BLOCK_ROWS)
        second = dataclasses.replace(problem, ll_capacity=doubled)
        return first, first, second, f"{rows} vs {doubled} rows"
    if kind == "expected_m":
        if not problem.batched:
            raise ValueError(
                "invariance expected_m: the masked GEMM's hint needs the masked layout "
                f"(ep:N+ll, or grouped_layout masked); {problem.layout_name} has none"
            )
        hint = max(1, problem.tokens)
        return first, cls(engine=engine, expected_m=hint), problem, f"mean batch vs {hint}"
    return first, cls(engine=engine, num_sms=100), problem, "all SMs vs 100"
