"""The checks `moe-verify engines --run` runs on each release (moe_verify/engines/checks.py): the
presets cover every scale format and grouped layout each adapter runs, and the judgement of a
sweep's summary.json catches every way a release can differ from what is recorded."""

from __future__ import annotations

from typing import Any

import pytest

from moe_verify.adapters.lmdeploy import LmdeployBackend
from moe_verify.adapters.sglang import SglangBackend
from moe_verify.adapters.vllm import VllmBackend
from moe_verify.engines import checks
from moe_verify.spec import GroupedLayout, MoEProblem, ScaleFmt, StageSkipped, Topology
from moe_verify.sweep.cases import preset, preset_edges
from optimized.deepgemm import choose_grouped_layout

pytestmark = pytest.mark.cpu

# Each adapter's own refusals of a problem (its methods, on an instance that loaded nothing).
REFUSALS = {
    "vllm": (VllmBackend, ("_require_supported",)),
    "sglang": (SglangBackend, ("_require_supported",)),
    "lmdeploy": (LmdeployBackend, ("_require_supported", "_require_layout")),
}
LAYOUTS = (GroupedLayout.M_INDICES, GroupedLayout.PSUM)


def _runs(key: str, problem: MoEProblem) -> bool:
    cls, methods = REFUSALS[key]
    backend = object.__new__(cls)
    try:
        for method in methods:
            getattr(backend, method)(problem)
    except StageSkipped:
        return False
    return True


@pytest.mark.parametrize("key", list(checks.CHECKS))
def test_the_preset_covers_every_scale_format_and_layout_the_adapter_runs(key: str) -> None:
    runs = {
        (fmt, layout)
        for fmt in ScaleFmt
        for layout in LAYOUTS
        if _runs(
            key, MoEProblem(scale_fmt=fmt, grouped_layout=layout, topology=Topology.parse("tp:1"))
        )
    }
    cases = checks.preset(key)
    assert {p.scale_fmt for p in cases} == {fmt for fmt, _ in runs}, key
    assert {choose_grouped_layout(p).layout for p in cases} == {lay for _, lay in runs}, key
    assert all(_runs(key, p) for p in cases), key


@pytest.mark.parametrize("key", list(checks.CHECKS))
def test_each_engine_preset_is_a_sweep_preset_with_its_edges(key: str) -> None:
    cases = preset(f"engine-{key}")
    assert cases == checks.preset(key) and len({p.id for p in cases}) == len(cases)
    assert set(preset_edges(f"engine-{key}")) == {p.id for p in cases}


STAGES = ("route", "quant_input", "align", "permute", "gemm1", "act_quant", "gemm2", "gather")


def _results(statuses: dict[str, str], ranks: int = 1) -> list[dict[str, Any]]:
    out = []
    for stage in STAGES:
        for rank in range(ranks):
            status = statuses.get(stage, "pass")
            failed = [{"name": "ulp", "passed": False}] if status == "fail" else []
            out.append(
                {"stage": stage, "status": status, "rank": rank, "reason": "", "checks": failed}
            )
    return out


def _summary(key: str, **modes: dict[str, str]) -> dict[str, Any]:
    """Every case of `key` passing, except `modes` (case index_mode -> stage statuses)."""
    cases = []
    for i, case in enumerate(checks.CHECKS[key].cases):
        ranks = case.problem.topology.size
        report = {}
        for mode in checks.MODES:
            expected = {s: "fail" for s in case.failing(mode)}
            report[mode] = _results({**expected, **modes.get(f"c{i}_{mode}", {})}, ranks)
        cases.append({"id": case.problem.id, "status": "PASS", "summary": "", "report": report})
    return {"cases": cases}


@pytest.mark.parametrize("key", list(checks.CHECKS))
def test_a_release_that_behaves_as_recorded_passes(key: str) -> None:
    assert checks.judge(key, _summary(key)) == []


def test_an_unexpected_failure_is_named_with_its_case_mode_stage_and_checks() -> None:
    problems = checks.judge("vllm", _summary("vllm", c0_isolated={"permute": "fail"}))
    case = checks.CHECKS["vllm"].cases[0].problem.id
    assert problems == [f"{case} isolated: permute fail: checks ulp failed"]


def test_a_finding_that_no_longer_reproduces_fails_the_release() -> None:
    problems = checks.judge("lmdeploy", _summary("lmdeploy", c1_isolated={"gather": "pass"}))
    assert len(problems) == 1 and "gather did not fail, expected finding 6" in problems[0]


def test_a_finding_may_fail_on_one_rank_only() -> None:
    summary = _summary("lmdeploy")
    isolated = summary["cases"][1]["report"]["isolated"]
    next(r for r in isolated if r["stage"] == "gather" and r["rank"] == 1)["status"] = "pass"
    assert checks.judge("lmdeploy", summary) == []


def test_a_finding_stage_that_errors_fails_the_release() -> None:
    problems = checks.judge("lmdeploy", _summary("lmdeploy", c1_isolated={"permute": "error"}))
    assert any("permute did not fail" in p for p in problems)
    assert any("permute error" in p for p in problems)


def test_only_the_engines_named_stages_may_skip() -> None:
    skipped = {"quant_input": "skip", "act_quant": "skip"}
    assert checks.judge("sglang", _summary("sglang", c0_isolated=skipped)) == []
    problems = checks.judge("vllm", _summary("vllm", c0_isolated=skipped))
    assert [p.split(": ")[1] for p in problems] == ["quant_input skip", "act_quant skip"]


def test_chained_mode_may_skip_after_a_skip_and_only_then() -> None:
    after = {s: "skip" for s in STAGES[1:]}  # quant_input skips (JIT CUDA), the rest after it
    assert checks.judge("sglang", _summary("sglang", c0_chained=after)) == []
    problems = checks.judge("sglang", _summary("sglang", c0_isolated=after))
    assert len(problems) == 5 and all(" isolated: " in p for p in problems)  # the 5 not named
    problems = checks.judge("vllm", _summary("vllm", c0_chained={"gather": "skip"}))
    assert len(problems) == 1 and problems[0].endswith("chained: gather skip: see summary.json")


def test_a_case_that_did_not_run_or_errored_fails_the_release() -> None:
    summary = _summary("vllm")
    first = summary["cases"].pop(0)
    assert checks.judge("vllm", summary) == [f"{first['id']}: did not run"]
    summary["cases"].insert(
        0, {**first, "status": "ERROR", "summary": "worker died", "report": None}
    )
    assert checks.judge("vllm", summary) == [f"{first['id']}: ERROR: worker died"]
    first["report"] = {"isolated": first["report"]["isolated"], "chained": []}
    summary["cases"][0] = first
    assert checks.judge("vllm", summary) == [f"{first['id']} chained: no stage ran"]
