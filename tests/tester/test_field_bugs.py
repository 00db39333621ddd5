"""Test-the-tester for the field's new bug classes (tests/tester/field_bugs.py): each wrong
backend must fail isolated verification at the stage its bug lives in, with messages that name
what is wrong, and the correct backend must pass on the very same inputs (so the inputs are not
what fails). The stale-ids class runs under `moe-verify graph`'s replays instead.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_verify.examples import accumulators
from moe_verify.production.graph import default_replays, verify_graph
from moe_verify.run.inputs import TINY_AMAX, make_inputs
from moe_verify.run.poison import FP8_MAX_CODE, FP32_MAX, poison_padding
from moe_verify.run.runner import run_one_stage
from moe_verify.run.verify import verify
from moe_verify.spec import STAGES, Engine, MoEProblem, Stage, Trace
from optimized import op
from optimized.backend import OptimizedBackend
from reference import ReferenceBackend
from reference.formats import dequantize_fp8_blocks
from tests.tester import field_bugs as fb
from tolerance.report import Report

pytestmark = pytest.mark.cpu

GRAPH_BASE = fb.BASE.replace(tokens=8)  # test_graph.py's bound: half-live leaves 4 padding rows
REPLAYS = {r.name: r for r in default_replays(GRAPH_BASE.tokens, GRAPH_BASE.seed)}


def _run(catch: fb.Catch, backend: OptimizedBackend) -> Report:
    return verify(catch.problem, backend=backend, mode="isolated", padding_poison=catch.poisoned)


def test_every_field_bug_class_is_in_a_table() -> None:
    classes = {
        c
        for c in vars(fb).values()
        if isinstance(c, type) and issubclass(c, OptimizedBackend) and c is not OptimizedBackend
    }
    tabled = {c.backend for c in fb.CATCHES} | {g.backend for g in fb.GRAPH_CATCHES}
    assert tabled == classes
    assert len({c.id for c in fb.CATCHES}) == len(fb.CATCHES)


@pytest.mark.parametrize("catch", fb.CATCHES, ids=lambda c: c.id)
def test_field_bug_is_caught_at_its_stage(catch: fb.Catch, record_report) -> None:
    overridden = [s for s in STAGES if s in vars(catch.backend)]
    assert overridden == [catch.stage], f"{catch.id} must override exactly its stage"
    report = record_report(_run(catch, catch.backend(engine="triton")))
    assert not report.passed, f"{catch.id} ({catch.bug}) passed: {report.summary_line()}"
    culprit = report.first_failing_result
    assert culprit is not None and report.first_failure == catch.stage, report.summary_line()
    assert culprit.status == "fail", f"{culprit.label} raised: {culprit.reason}"
    failing = {r.stage for r in report.isolated or [] if r.status.failing}
    assert failing - {Stage.REDUCE} == {catch.stage}, sorted(failing)
    reasons = [r.reason for r in report.isolated or [] if r.status.failing and r.reason]
    text = "\n".join([*report.failure_messages(), *reasons])
    for name in catch.names:
        assert name in text, f"the messages do not name {name!r}:\n{text}"


@pytest.mark.parametrize("catch", fb.CATCHES, ids=lambda c: c.id)
def test_correct_backend_passes_the_same_inputs(catch: fb.Catch, record_report) -> None:
    report = record_report(_run(catch, OptimizedBackend(engine="triton")))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])


# -- the inputs reach the bug -------------------------------------------------------------------


def test_tiny_token_has_e8m0_byte_zero_and_live_codes() -> None:
    problem = fb.TINY
    x = make_inputs(problem, "cpu")
    out = run_one_stage(ReferenceBackend(), "quant_input", problem, x, Trace("golden"), 0)
    scale, codes = out["a1q_scale"], out["a1q"].float()
    assert scale.dtype == torch.uint8 and bool((scale[0] == 0).all()), scale[0]
    assert bool((scale[1:] > 0).all())  # no other token is that small
    assert float(codes[0].abs().max()) >= 128  # x * 2^127: codes, not zeros


@pytest.mark.parametrize("n", [1, 3, fb.TINY.tokens], ids=lambda n: f"tiny{n}")
def test_tiny_tokens_rescale_only_the_first_tokens(n: int) -> None:
    """Deterministic: the first n rows at |max| 2^-119, proportional to the rows they replace;
    every other tensor is that of the problem without tiny tokens (no random draw moved)."""
    plain, tiny = make_inputs(fb.MXFP8, "cpu"), make_inputs(fb.MXFP8.replace(tiny_tokens=n), "cpu")
    rows = tiny.hidden_states[:n].float()
    assert bool((rows.abs().amax(dim=1) == TINY_AMAX).all())
    want = plain.hidden_states[:n].float()
    want = (want / want.abs().amax(dim=1, keepdim=True) * TINY_AMAX).bfloat16()
    assert torch.equal(tiny.hidden_states[:n], want)
    assert torch.equal(tiny.hidden_states[n:], plain.hidden_states[n:])
    for name in ("router_logits", "w13", "w2"):
        assert torch.equal(getattr(tiny, name), getattr(plain, name)), name


def test_the_optimized_path_takes_tiny_tokens_in_both_modes(record_report) -> None:
    report = record_report(verify(fb.TINY, backend=OptimizedBackend(engine="triton"), mode="both"))
    assert report.passed, report.summary_line()


def test_tiny_tokens_name_the_case_and_round_trip() -> None:
    assert fb.TINY.id == f"{fb.MXFP8.id}-tiny1" and "tiny" not in fb.MXFP8.id
    assert MoEProblem.from_dict(fb.TINY.to_dict()) == fb.TINY


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(tiny_tokens=17), r"tiny_tokens \(at most tokens=16\)"),
        (dict(tiny_tokens=-1), "MoEProblem.tiny_tokens"),
        (dict(tiny_tokens=1, provenance=True), "erase the tags"),
    ],
    ids=["more-than-tokens", "negative", "with-provenance"],
)
def test_tiny_tokens_the_case_cannot_hold_are_refused(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fb.MXFP8.replace(**changes)


def test_poisoned_padding_drives_the_padding_accumulator_to_inf() -> None:
    problem = fb.PSUM
    x = make_inputs(problem, "cpu")
    golden = ReferenceBackend().run(problem, x, 0)
    perm = poison_padding(golden, problem)["permute"]
    pad = perm["m_indices"] == -1
    assert bool(pad.any())
    assert bool((perm["a_perm"].view(torch.uint8)[pad] == FP8_MAX_CODE).all())
    assert bool((perm["a_scale_perm"][pad] == FP32_MAX).all())
    assert torch.equal(perm["a_perm"][~pad], golden["permute"]["a_perm"][~pad])
    weight = dequantize_fp8_blocks(x.w13_q.q[0], x.w13_q.scale[0], x.w13_q.block)
    acc = accumulators(perm["a_perm"][pad], perm["a_scale_perm"][pad], weight, 128)
    assert bool(torch.isinf(acc).any()) and not bool(torch.isnan(acc).any())
    clean = golden["permute"]
    acc = accumulators(clean["a_perm"][pad], clean["a_scale_perm"][pad], weight, 128)
    assert bool(torch.isfinite(acc).all()), "without the poison nothing overflows"


def test_padding_bleed_is_invisible_without_the_poison(record_report) -> None:
    """The field report's point (FlashInfer #3650): on synthetic inputs the padding rows are
    zero and their accumulators finite, so the bleeding epilogue passes; only the poison shows
    it."""
    backend = fb.PaddingInfBleedsIntoTile(engine="triton")
    report = record_report(verify(fb.PSUM, backend=backend, mode="isolated"))
    assert report.passed, report.summary_line()


def test_ll_warp_remainder_is_right_below_32_groups(record_report) -> None:
    """One warp below H = 4096: the same kernel is right, so the 33-group case is what fails."""
    problem = fb.LL_33_GROUPS.replace(intermediate=128 * 3)
    report = record_report(
        verify(problem, backend=fb.LlActQuantWarpRemainder(engine="triton"), mode="isolated")
    )
    assert report.passed, report.summary_line()


# -- stale ids under graph replay ---------------------------------------------------------------


def _recorded(report, record_report: Callable[[Report], Report]) -> None:
    for r in report.replays:
        if not r.passed:
            record_report(r.report)


@pytest.mark.parametrize("catch", fb.GRAPH_CATCHES, ids=lambda c: c.id)
def test_stale_ids_class_under_graph_replay(catch: fb.GraphCatch, record_report) -> None:
    assert [s for s in STAGES if s in vars(catch.backend)] == [Stage.ALIGN]
    backend = op.register_backend(catch.backend())
    report = verify_graph(
        GRAPH_BASE.replace(topology=catch.topology),
        replays=[REPLAYS[name] for name, _ in catch.replays],
        engine=Engine.TRITON,
        backend=backend,
    )
    _recorded(report, record_report)
    assert [(r.replay.name, r.first_failure) for r in report.replays] == list(catch.replays), (
        report.to_summary()
    )
    for r in report.replays:
        failing = {x.rank for x in r.report.results if x.status.failing and x.stage != "reduce"}
        assert failing == (set(catch.ranks) if not r.passed else set()), r.replay.name
        if not r.passed:
            text = "\n".join(r.report.failure_messages())
            assert "counts" in text and "rank 1" in text, text


def test_correct_backend_passes_the_stale_id_replays_under_ep(record_report) -> None:
    report = verify_graph(
        GRAPH_BASE.replace(topology="ep:2"),
        replays=[REPLAYS[n] for n, _ in fb.GRAPH_CATCHES[-1].replays],
        engine=Engine.TRITON,
    )
    _recorded(report, record_report)
    assert report.passed, report.to_summary()
