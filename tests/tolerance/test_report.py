"""Report: verdict, culprit stage, and renderings carrying what a failure message needs."""

from __future__ import annotations

import json

import pytest
import torch

from moe_verify.spec import Mode, MoEProblem, Status, Trace
from tests.tolerance.synthetic import build_golden, clone_trace, mark_stage, slot_row, tiny_problem
from tolerance import CheckResult, Report, StageResult, Worst, compare

pytestmark = pytest.mark.cpu


@pytest.fixture
def problem() -> MoEProblem:
    return tiny_problem()


@pytest.fixture
def golden(problem: MoEProblem) -> Trace:
    return build_golden(problem)


def _permute_broken(golden: Trace) -> Trace:
    """m_indices padding 0 instead of -1: permute fails; everything else passes."""
    other = clone_trace(golden)
    m = other["permute"]["m_indices"]
    m[m == -1] = 0
    return other


def _gemm2_nan(golden: Trace) -> Trace:
    other = clone_trace(golden)
    other["gemm2"]["mm2"][slot_row(golden, 2, 1), 9] = float("nan")
    return other


def _report(problem: MoEProblem, golden: Trace, isolated: Trace, chained: Trace | None = None):
    return Report(
        problem,
        "candidate",
        Mode.ISOLATED,
        isolated=compare(golden, isolated, problem, mode=Mode.ISOLATED),
        chained=None if chained is None else compare(golden, chained, problem, mode=Mode.CHAINED),
    )


def test_passing_report(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, clone_trace(golden), clone_trace(golden))
    assert report.passed
    assert report.first_failure is None
    assert report.summary_line().startswith(
        f"PASS {problem.id} [candidate, both] isolated: 9 pass; chained: 9 pass"
    )


def test_first_failure_prefers_isolated_mode(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, _gemm2_nan(golden), _permute_broken(golden))
    assert not report.passed
    assert report.first_failure == "gemm2"


def test_a_report_of_both_modes_says_so_and_counts_each_mode_apart(
    problem: MoEProblem, golden: Trace
) -> None:
    """Isolated: gemm2 alone fails; chained: permute fails too. The header, verdict line, JSON
    and the object name both modes, and each mode's failures are counted in its own tally."""
    chained = _permute_broken(_gemm2_nan(golden))
    report = _report(problem, golden, _gemm2_nan(golden), chained)
    assert report.mode == "both" and report.results is report.isolated
    assert report.counts(Mode.ISOLATED)["fail"] == 1 and report.counts(Mode.CHAINED)["fail"] == 2
    assert report.counts()["fail"] == 3  # every mode run
    line = report.summary_line()
    assert line.startswith(f"FAIL {problem.id} [candidate, both] first failure: gemm2 [isolated]")
    assert "; isolated: 8 pass, 1 fail; chained: 7 pass, 2 fail" in line
    assert (
        report.to_summary()
        .splitlines()[0]
        .endswith("mode both  verdict FAIL  first failure: gemm2 (isolated)")
    )
    data = json.loads(report.to_json())
    assert (data["mode"], data["first_failure"], data["first_failure_mode"]) == (
        "both",
        "gemm2",
        "isolated",
    )
    assert data["counts"] == {
        "isolated": {"pass": 8, "fail": 1, "skip": 0, "error": 0},
        "chained": {"pass": 7, "fail": 2, "skip": 0, "error": 0},
    }
    assert Report.from_dict(data).mode == "both"
    assert "mode: both" in report.to_markdown()


def test_a_single_mode_report_keeps_its_mode(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, _gemm2_nan(golden))
    assert report.mode == Mode.ISOLATED and report.chained is None
    assert "[candidate, isolated] first failure: gemm2 (nan_inf" in report.summary_line()
    assert json.loads(report.to_json())["counts"] == {
        "isolated": {"pass": 8, "fail": 1, "skip": 0, "error": 0}
    }
    assert Report(problem, "candidate", "both").chained == []


def test_first_failure_falls_back_to_chained(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, clone_trace(golden), _permute_broken(golden))
    assert report.first_failure == "permute"


def test_skipped_stage_does_not_pass_or_fail_the_case(problem: MoEProblem, golden: Trace) -> None:
    other = mark_stage(clone_trace(golden), "gemm1", Status.SKIP, "needs SM100")
    report = _report(problem, golden, other)
    assert report.passed
    assert report.counts()[Status.SKIP] == 1 and report.counts()[Status.PASS] == 8
    assert "1 skip" in report.summary_line()
    assert "needs SM100" in report.to_table()


def test_error_stage_fails_the_case(problem: MoEProblem) -> None:
    results = [
        StageResult("route", Status.PASS, []),
        StageResult("permute", Status.ERROR, [], "Boom: x"),
    ]
    report = Report(problem, "candidate", Mode.ISOLATED, isolated=results)
    assert not report.passed
    assert report.first_failure == "permute"
    assert "ERROR Boom: x" in "\n".join(report.failure_messages())


def test_json_round_trips(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, _gemm2_nan(golden), _permute_broken(golden))
    data = json.loads(report.to_json())
    assert data["case"] == problem.id
    assert data["first_failure"] == "gemm2"
    assert data["passed"] is False
    assert [s["stage"] for s in data[Mode.ISOLATED]][:2] == ["route", "quant_input"]
    assert Report.from_dict(data).to_dict() == report.to_dict()


def test_json_is_strict_with_non_finite_values(problem: MoEProblem, golden: Trace) -> None:
    # A NaN in a live GEMM row makes calc_diff NaN: it must serialize without bare NaN tokens.
    report = _report(problem, golden, _gemm2_nan(golden))
    text = report.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert '"nan"' in text


def test_table_names_case_first_failure_and_coordinates(problem: MoEProblem, golden: Trace) -> None:
    table = _report(problem, golden, _gemm2_nan(golden)).to_table()
    assert problem.id in table
    assert "first failure: gemm2" in table
    header = table.splitlines()[2]
    for column in ("stage", "status", "check", "value", "limit", "worst coordinates", "reason"):
        assert column in header
    assert "t=2 k=1 e=2 r=0 col=9" in table


def test_failure_message_carries_everything_style_asks(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, _gemm2_nan(golden))
    message = next(m for m in report.failure_messages() if "check nan_inf" in m)
    assert problem.id in message
    assert "stage gemm2" in message
    assert "limit 0" in message and "always fails" in message  # limit and its reason
    assert "(token 2, k 1, expert 2, rank 0, column 9)" in message
    assert "golden" in message and "other nan" in message  # both values
    assert "candidate: 1 NaN, 0 Inf; golden: 0 NaN, 0 Inf" in message


def test_failure_message_of_bitwise_stage_names_slot(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    a = other["permute"]["a_perm"].view(torch.uint8)
    r0, r1 = slot_row(golden, 0, 0), slot_row(golden, 1, 0)
    a[[r0, r1]] = a[[r1, r0]].clone()
    report = _report(problem, golden, other)
    message = next(m for m in report.failure_messages() if "a_perm rows" in m)
    assert "(token 0, k 0, expert 0, rank 0, column" in message
    assert "slot (token 0, k 0)" in message
    assert "NaN/Inf: not counted" in message


def test_markdown_has_tables_per_mode_and_failures(problem: MoEProblem, golden: Trace) -> None:
    md = _report(problem, golden, _gemm2_nan(golden), _permute_broken(golden)).to_markdown()
    assert md.startswith(f"## {problem.id}: FAIL")
    assert "### isolated" in md and "### chained" in md and "### failures" in md
    assert "| stage | status | check |" in md


def test_summary_line_names_culprit_check_and_coordinates(
    problem: MoEProblem, golden: Trace
) -> None:
    line = _report(problem, golden, _gemm2_nan(golden)).summary_line()
    assert line.startswith(f"FAIL {problem.id} [candidate, isolated] first failure: gemm2 (nan_inf")
    assert "(token 2, k 1, expert 2, rank 0, column 9)" in line


def test_report_rejects_unknown_mode(problem: MoEProblem) -> None:
    with pytest.raises(ValueError, match="mode"):
        Report(problem, "candidate", "sideways")


def test_report_results_follow_primary_mode(problem: MoEProblem) -> None:
    chained = [StageResult("route", Status.FAIL, [CheckResult("topk_ids", False, 1, 0, "r")])]
    report = Report(problem, "candidate", Mode.CHAINED, chained=chained)
    assert report.results is chained
    assert report.isolated is None
    assert report.first_failure == "route"


def test_worst_holds_plain_numbers_only() -> None:
    """A tensor in a report pins device memory and prints as tensor(..., device=...)."""
    assert Worst(golden=1, other=2.5).other == 2.5
    with pytest.raises(TypeError, match="Worst.golden must be a number, got Tensor"):
        Worst(golden=torch.tensor(119))


def _recipe_report(problem: MoEProblem) -> Report:
    """quant_input passed as the Triton recipe on rank 0 and the CUDA one on rank 1; act_quant
    failed against its declared recipe; gemm1 names none."""

    def stage(name: str, status: Status, rank: int, recipe: str | None) -> StageResult:
        check = CheckResult("codes", status is Status.PASS, 0, 0, "why", None, "d", recipe)
        return StageResult(name, status, [check], rank=rank, recipe=recipe)

    results = [
        stage("quant_input", Status.PASS, 0, "triton_reciprocal"),
        stage("quant_input", Status.PASS, 1, "cuda_division"),
        stage("gemm1", Status.PASS, 0, None),
        stage("act_quant", Status.FAIL, 0, "colmajor"),
    ]
    return Report(problem, "candidate", Mode.ISOLATED, isolated=results)


def test_report_names_the_recipe_of_each_stage(problem: MoEProblem) -> None:
    report = _recipe_report(problem)
    assert report.recipes() == {
        "quant_input": "triton_reciprocal / cuda_division",
        "act_quant": "colmajor",
    }
    line = report.summary_line()
    assert line.startswith(f"FAIL {problem.id} [candidate, isolated] first failure: act_quant@r0 ")
    assert "(colmajor)" in line
    assert line.endswith(
        "recipes: quant_input triton_reciprocal / cuda_division, act_quant colmajor"
    )
    table = report.to_table()
    assert "quant_input@r0 (triton_reciprocal)" in table
    assert "quant_input@r1 (cuda_division)" in table
    assert "gemm1@r0  " in table  # no recipe, no parentheses
    assert "| act_quant@r0 (colmajor) |" in report.to_markdown()
    assert "act_quant@r0 (colmajor)" in report.to_summary()
    assert "stage act_quant@r0 (colmajor), check codes" in report.failure_messages()[0]


def test_report_recipes_round_trip_through_json(problem: MoEProblem) -> None:
    report = _recipe_report(problem)
    back = Report.from_dict(json.loads(report.to_json()))
    assert back.recipes() == report.recipes()
    assert [c.recipe for r in back.results for c in r.checks] == [
        "triton_reciprocal",
        "cuda_division",
        None,
        "colmajor",
    ]


def test_passing_report_names_recipes_in_its_summary_line(problem: MoEProblem) -> None:
    check = CheckResult("codes", True, 0, 0, "why", None, "d", "triton_reciprocal")
    passing = [StageResult("quant_input", Status.PASS, [check], recipe="triton_reciprocal")]
    report = Report(problem, "candidate", Mode.ISOLATED, isolated=passing)
    assert report.summary_line().endswith("1 pass; recipes: quant_input triton_reciprocal")


def _stages(*statuses: Status) -> list[StageResult]:
    names = ("route", "permute", "gemm1", "gemm2")
    return [StageResult(n, s, [], f"{n} reason") for n, s in zip(names, statuses, strict=False)]


@pytest.mark.parametrize(
    ("statuses", "verdict", "exit_code"),
    [
        ((Status.PASS, Status.PASS), Status.PASS, 0),
        ((Status.PASS, Status.SKIP), Status.PASS, 0),  # a skip alone does not fail a case
        ((Status.PASS, Status.FAIL, Status.SKIP), Status.FAIL, 1),
        ((Status.FAIL, Status.ERROR), Status.ERROR, 2),  # an error outranks a failed check
        ((Status.SKIP, Status.SKIP), Status.SKIP, 2),  # nothing was verified: not a pass
        ((), Status.SKIP, 2),  # no stage at all
    ],
    ids=["pass", "pass-with-skip", "fail", "error-over-fail", "all-skipped", "empty"],
)
def test_verdict_and_exit_code(
    problem: MoEProblem, statuses: tuple[Status, ...], verdict: Status, exit_code: int
) -> None:
    report = Report(problem, "candidate", Mode.ISOLATED, isolated=_stages(*statuses))
    assert report.verdict is verdict and report.exit_code == exit_code
    assert report.summary_line().startswith(f"{verdict.upper()} {problem.id}")
    assert f"verdict {verdict.upper()}" in report.to_summary().splitlines()[0]
    assert report.to_dict()["verdict"] == verdict


def test_summary_line_names_skipped_stages_and_their_reason_once(problem: MoEProblem) -> None:
    why = "deep_gemm unavailable: no CUDA GPU"
    results = [
        StageResult("route", Status.PASS, []),
        StageResult("gemm1", Status.SKIP, [], why, rank=0),
        StageResult("gemm1", Status.SKIP, [], why, rank=1),
        StageResult("gemm2", Status.SKIP, [], why, rank=0),
    ]
    report = Report(problem, "candidate", Mode.ISOLATED, isolated=results, chained=results)
    line = report.summary_line()
    assert line.startswith(f"PASS {problem.id}") and f"(gemm1, gemm2 skipped: {why})" in line
    assert line.count(why) == 1
    assert "verdict PASS (gemm1, gemm2 skipped)" in report.to_summary()
    assert report.to_summary().count(why) == 2  # the skipped section, and the last line


def test_every_stage_skipped_is_a_skip_verdict(problem: MoEProblem) -> None:
    results = [StageResult(s, Status.SKIP, [], "declined") for s in ("route", "gemm1")]
    report = Report(problem, "candidate", Mode.ISOLATED, isolated=results)
    assert report.passed  # the old meaning stays: nothing failed
    assert report.summary_line() == (
        f"SKIP {problem.id} [candidate, isolated] every tested stage was skipped: "
        "route, gemm1 skipped: declined"
    )


def test_files_round_trip_through_json(problem: MoEProblem, golden: Trace) -> None:
    report = _report(problem, golden, _gemm2_nan(golden))
    report.files["dump"] = ["/tmp/dump/case"]
    data = json.loads(report.to_json())
    assert data["files"] == {"dump": ["/tmp/dump/case"]} and data["verdict"] == "fail"
    assert Report.from_dict(data).files == report.files


def test_default_failure_lines_are_one_per_mode_and_stage_and_short(
    problem: MoEProblem, golden: Trace
) -> None:
    from tolerance.report import LINE_WIDTH

    report = _report(problem, golden, _gemm2_nan(golden), _gemm2_nan(golden))
    lines = report.failure_lines()
    # several checks of gemm2 fail in each mode: one line each
    assert len(report.failure_messages()) > 2
    assert [line.split(":")[0] for line in lines] == ["[isolated] gemm2", "[chained] gemm2"]
    assert all(len(line) <= LINE_WIDTH for line in lines), [len(line) for line in lines]
    first = lines[0]
    assert first.startswith(
        "[isolated] gemm2: nan_inf 1 > 0, 1 element in 1 slot beyond at (token 2, k 1, expert 2, "
        "rank 0"
    )
    assert "other nan" in first and first.endswith("(docs/tolerance.md#nan-and-inf)")
    assert "always fails" not in "\n".join(lines)  # the reason's text is under -v


def test_failing_ranks_fold_into_one_line(problem: MoEProblem) -> None:
    def failing(rank: int) -> StageResult:
        check = CheckResult(
            "counts", False, 2, 0, "exact (docs/tolerance.md#align)", Worst(rank=rank)
        )
        return StageResult("align", Status.FAIL, [check], rank=rank)

    report = Report(problem, "candidate", Mode.ISOLATED, isolated=[failing(0), failing(1)])
    (line,) = report.failure_lines()
    assert line.startswith("[isolated] align@r0 (ranks 0, 1 fail): counts 2 > 0 at (token -")
    assert line.endswith("(docs/tolerance.md#align)")
    full = report.failure_messages()
    assert len(full) == 2 and "exact (docs" in full[0] and "(reason above)" in full[1]


def test_the_tightest_check_is_a_bounded_one_where_the_stage_has_one() -> None:
    """A must-be-zero check (nan_inf: 0 / 0) is not the stage's tightest margin when a bounded
    check (limit > 0) ran beside it."""
    from moe_verify.run.verify import verify
    from optimized import OptimizedBackend
    from tolerance.report import _tightest

    problem = MoEProblem(tokens=12, hidden=128, intermediate=128, num_experts=4, topk=2)
    report = verify(problem, backend=OptimizedBackend(engine="triton"), mode="isolated")
    for r in report.isolated:
        tightest = _tightest(r)
        assert tightest is not None
        if any(float(c.limit) > 0 for c in r.checks):
            assert float(tightest.limit) > 0, (r.stage, tightest.name)
    table = report.to_summary()
    assert "nan_inf: 0 / 0" not in table, table


def test_a_gather_far_from_every_recipe_counts_output_elements_not_codes() -> None:
    from moe_verify.examples.wrapped import HalvesOneToken
    from moe_verify.run.verify import verify

    problem = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2)
    report = verify(problem, backend=HalvesOneToken(engine="triton"), mode="isolated")
    (gather,) = [r for r in report.isolated if r.stage == "gather"]
    details = " ".join(c.detail for c in gather.failed_checks)
    assert "bf16 output elements differ bit for bit" in details, details
    assert "codes and scale groups" not in details, details


def test_a_failure_over_many_rows_names_the_first_few() -> None:
    """Every token wrong: the check names its first rows, not only the worst, and the JSON
    report keeps them."""
    from moe_verify.run.verify import verify
    from tests.tester.wrong_backends import TopkWeightsIgnored

    problem = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2)
    report = verify(problem, backend=TopkWeightsIgnored(engine="triton"), mode="isolated")
    (gather,) = [r for r in report.isolated if r.stage == "gather"]
    ulp = next(c for c in gather.failed_checks if c.name == "ulp")
    assert [w.token for w in ulp.first_rows] == [0, 1, 2, 3]
    text = ulp.rows_text()
    assert text.endswith("(0, 0), (1, 0), (2, 0), (3, 0) and 12 more"), text
    assert any(text in line for line in report.failure_messages())
    again = Report.from_dict(json.loads(report.to_json()))
    (gather_again,) = [r for r in again.isolated if r.stage == "gather"]
    assert next(c for c in gather_again.checks if c.name == "ulp").first_rows == ulp.first_rows
