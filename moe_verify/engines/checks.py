"""What `moe-verify engines --run` checks on each release of an engine: a few cases (the sweep
presets `engine-vllm`, `engine-sglang`, `engine-lmdeploy`), at least one per scale format and
grouped layout the adapter runs, and what each stage must do on them.

A stage must pass, unless the case names a finding it reproduces (it must then fail: a release
that fixed one shows as a change to record), or the engine names why it may skip (SGLang's
JIT-compiled CUDA stages off CUDA). Chained mode may also skip every stage after one that
skipped. The judgement reads the sweep's summary.json, so the checks run through the CLI like
any sweep, each case contained in a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_verify.spec import (
    Activation,
    GroupedLayout,
    MoEProblem,
    Routing,
    ScaleFmt,
    Status,
    Topology,
)

F32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
M_IDX, PSUM = GroupedLayout.M_INDICES, GroupedLayout.PSUM
OAI = Activation("swigluoai", 1.702, 1.0, 1.5)
CLAMPED = Activation("silu", limit=1.5)
MODES = ("isolated", "chained")


@dataclass(frozen=True)
class EngineCase:
    """One case and the findings it reproduces: stage -> the finding, per mode."""

    problem: MoEProblem
    edge: str
    findings: Mapping[str, str] = field(default_factory=dict)  # isolated mode
    chained_findings: Mapping[str, str] = field(default_factory=dict)

    def failing(self, mode: str) -> Mapping[str, str]:
        return self.findings if mode == "isolated" else self.chained_findings


@dataclass(frozen=True)
class EngineChecks:
    """An engine's cases, and the stages that may skip (stage -> why)."""

    cases: tuple[EngineCase, ...]
    may_skip: Mapping[str, str] = field(default_factory=dict)


def _problem(
    fmt: ScaleFmt,
    topology: str,
    routing: Routing,
    layout: GroupedLayout,
    *,
    hidden: int = 384,
    intermediate: int = 256,
    tokens: int = 12,
    act: Activation | None = None,
) -> MoEProblem:
    return MoEProblem(
        tokens=tokens,
        hidden=hidden,
        intermediate=intermediate,
        num_experts=8,
        topk=2,
        scale_fmt=fmt,
        activation=act or Activation(),
        routing=routing,
        topology=Topology.parse(topology),
        grouped_layout=layout,
    )


# The scale formats and grouped layouts are the ones each adapter runs (tests/engines checks that
# against the adapter's own refusals); A = 128 everywhere, DeepGEMM's contiguous BLOCK_M.
CHECKS: dict[str, EngineChecks] = {
    "vllm": EngineChecks(
        cases=(
            EngineCase(_problem(F32, "tp:1", Routing.SOFTMAX, M_IDX), "fp32 scales, m_indices"),
            EngineCase(
                _problem(CEIL, "tp:1", Routing.SOFTMAX, PSUM, tokens=3),
                "ceil-UE8M0 scales, psum; T*k < E (the min-active M_sum bound)",
            ),
            EngineCase(
                _problem(PACKED, "ep:2", Routing.INVALID_SLOTS, PSUM, act=OAI),
                "packed UE8M0 scales, psum, EP expert_map, -1 slots, swigluoai clamped",
            ),
        ),
    ),
    "sglang": EngineChecks(
        cases=(
            EngineCase(_problem(F32, "tp:1", Routing.SOFTMAX, M_IDX), "fp32 scales, m_indices"),
            EngineCase(
                _problem(CEIL, "ep:2", Routing.ONE_EXPERT, M_IDX, act=CLAMPED),
                "ceil-UE8M0 scales, expert_start of rank 1, a rank with no live row",
            ),
        ),
        may_skip={
            "quant_input": "JIT-compiled CUDA: skipped off CUDA (docs/sglang.md)",
            "act_quant": "JIT-compiled CUDA: skipped off CUDA (docs/sglang.md)",
        },
    ),
    "lmdeploy": EngineChecks(
        cases=(
            EngineCase(
                _problem(F32, "tp:1", Routing.ONE_EXPERT, M_IDX, hidden=1024, intermediate=512),
                "fp32 scales, one live slot a token: every stage passes",
            ),
            EngineCase(
                _problem(CEIL, "ep:2", Routing.EMPTY_MIDDLE, M_IDX, hidden=1024, intermediate=512),
                "ceil-UE8M0 scales, DeepEP's local ids, rank 1's first expert empty",
                findings={
                    "permute": "finding 4: unwritten UE8M0 padding scales",
                    "act_quant": "finding 5: plain fp32 activation scales",
                    "gather": "finding 6: bf16 accumulation",
                },
                chained_findings={"permute": "finding 4: unwritten UE8M0 padding scales"},
            ),
        ),
    ),
}


def preset(key: str) -> list[MoEProblem]:
    """The sweep preset `engine-<key>`: the engine's cases."""
    return [c.problem for c in CHECKS[key].cases]


def edges(key: str) -> dict[str, str]:
    """Case id -> the edge it exercises."""
    return {c.problem.id: c.edge for c in CHECKS[key].cases}


def judge(key: str, summary: Mapping[str, Any]) -> list[str]:
    """What differs between a sweep's summary.json (of preset `engine-<key>`) and what each
    stage must do; empty when the release behaves as recorded."""
    checks = CHECKS[key]
    ran = {c["id"]: c for c in summary.get("cases", [])}
    problems: list[str] = []
    for case in checks.cases:
        got = ran.get(case.problem.id)
        if got is None:
            problems.append(f"{case.problem.id}: did not run")
            continue
        report = got.get("report") or {}
        if not report:
            problems.append(f"{case.problem.id}: {got.get('status')}: {got.get('summary')}")
            continue
        for mode in MODES:
            problems += [
                f"{case.problem.id} {mode}: {p}"
                for p in _judge_mode(report.get(mode) or [], case.failing(mode), checks, mode)
            ]
    return problems


def _judge_mode(
    results: list[Mapping[str, Any]], failing: Mapping[str, str], checks: EngineChecks, mode: str
) -> list[str]:
    """One mode's results against the case: a finding's stage fails (on some rank), every other
    stage passes or skips where allowed."""
    if not results:
        return ["no stage ran"]
    verdicts: dict[str, set[str]] = {}
    for r in results:
        verdicts.setdefault(r["stage"], set()).add(r["status"])
    problems = [
        f"{stage} did not fail, expected {why}"
        for stage, why in failing.items()
        if Status.FAIL not in verdicts.get(stage, set())
    ]
    skipped = False
    for stage, statuses in verdicts.items():
        allowed = {Status.FAIL, Status.PASS} if stage in failing else {Status.PASS}
        if stage in checks.may_skip or (mode == "chained" and skipped):
            allowed.add(Status.SKIP)
        skipped = skipped or Status.SKIP in statuses
        wrong = statuses - allowed
        if wrong:
            reasons = {_why(r) for r in results if r["stage"] == stage and r["status"] in wrong}
            why = "; ".join(sorted(r for r in reasons if r)) or "see summary.json"
            problems.append(f"{stage} {'/'.join(sorted(wrong))}: {why}")
    return problems


def _why(result: Mapping[str, Any]) -> str:
    """A result's reason, or the checks it failed."""
    failed = [c["name"] for c in result.get("checks") or [] if not c.get("passed", True)]
    return result.get("reason") or (f"checks {', '.join(failed)} failed" if failed else "")
