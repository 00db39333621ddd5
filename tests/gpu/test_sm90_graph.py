"""SM90 tier for `moe-verify graph`: the production op captured in a CUDA graph at a token bound
and replayed under the default routings (moe_verify/production/graph.py default_replays), each
replay's
stage taps against the golden of its inputs.

FP8-block runs through DeepGEMM (forced: a silent fallback to Triton would pass without testing
DeepGEMM under capture) with both SM90 scale formats and both contiguous layouts, and on the
masked layout of ep:N+ll, which is captured on its own; MXFP8 and MXFP4 run their GEMMs on the
Triton engine (DeepGEMM's MX GEMMs are SM100-only). The wrong backends of
tests/tester/production_wrong.py must fail at their stage or guard under real replays too.
The CPU tier (tests/production/test_graph.py) runs the same logic with eager replays.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from moe_verify import verify
from moe_verify.production.graph import GraphReport, default_replays, verify_graph
from moe_verify.run.runner import production_backend
from moe_verify.spec import Engine, GroupedLayout, MoEProblem, Recipe, ScaleFmt
from optimized import op
from tests.tester.production_wrong import CATCHES, Catch
from tolerance.report import Report

pytestmark = pytest.mark.sm90

CEIL, PACKED = ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
PSUM, M_INDICES = GroupedLayout.PSUM, GroupedLayout.M_INDICES
# H and I multiples of 128 (DeepGEMM's K blocks), A = 128 (a legal SM90 BLOCK_M), 256 tokens
# so half-live leaves 128 padding rows; eight experts, so ep:2 has four per rank.
GPU = MoEProblem(tokens=256, hidden=512, intermediate=512, num_experts=8, topk=2, alignment=128)
REPLAYS = {r.name: r for r in default_replays(GPU.tokens, GPU.seed)}

DEEPGEMM = [
    GPU.replace(grouped_layout=PSUM),  # what vLLM 0.32 runs on SM90
    GPU.replace(grouped_layout=M_INDICES),
    GPU.replace(scale_fmt=CEIL, grouped_layout=PSUM),  # power-of-two fp32 scales
    GPU.replace(scale_fmt=CEIL, grouped_layout=M_INDICES),
    GPU.replace(topology="ep:2", grouped_layout=PSUM),  # an expert map under stale padding ids
    GPU.replace(topology="ep:2+ll"),  # the masked GEMM (DeepEP low-latency layout)
    GPU.replace(topology="ep:2+ll", scale_fmt=CEIL),
]
TRITON = [
    GPU.replace(recipe=Recipe.MXFP8, scale_fmt=PACKED),  # 1x32 groups, packed E8M0
    GPU.replace(recipe=Recipe.MXFP4_W4A8, scale_fmt=CEIL),  # E2M1 weights
]
PARAMS = [pytest.param(p, Engine.DEEPGEMM, id=f"{p.id}-deepgemm") for p in DEEPGEMM] + [
    pytest.param(p, Engine.TRITON, id=f"{p.id}-triton") for p in TRITON
]


def _recorded(report: GraphReport, record_report: Callable[[Report], Report]) -> None:
    """Show every failing replay's stage table if the test fails."""
    for r in report.replays:
        if not r.passed:
            record_report(r.report)


@pytest.mark.parametrize(("problem", "engine"), PARAMS)
def test_captured_op_passes_every_default_replay(
    problem: MoEProblem, engine: Engine, record_report: Callable[[Report], Report]
) -> None:
    report = verify_graph(problem, engine=engine)
    _recorded(report, record_report)
    assert report.captured, report.capture_note
    assert report.engine == engine.value
    assert [r.replay.name for r in report.replays] == list(REPLAYS)
    assert report.passed, report.to_summary()


@pytest.mark.parametrize("catch", CATCHES, ids=lambda c: c.id)
def test_wrong_backend_fails_under_replay(
    catch: Catch, record_report: Callable[[Report], Report]
) -> None:
    backend = op.register_backend(catch.backend())  # fresh state: no earlier test's calls
    problem = GPU.replace(topology=catch.topology, grouped_layout=PSUM)
    replays = [REPLAYS[name] for name, _ in catch.replays]
    report = verify_graph(problem, replays=replays, engine=Engine.DEEPGEMM, backend=backend)
    _recorded(report, record_report)
    assert report.captured, report.capture_note
    got = [(r.replay.name, r.first_failure) for r in report.replays]
    assert got == list(catch.replays), report.to_summary()


def test_identical_inputs_twice_trip_replays_differ_under_capture() -> None:
    first = REPLAYS["capture-softmax"]
    report = verify_graph(
        GPU.replace(grouped_layout=PSUM), replays=[first, first], engine=Engine.DEEPGEMM
    )
    assert report.captured, report.capture_note
    assert [r.first_failure for r in report.replays] == [None, "replays-differ"]


def test_one_class_fails_run_and_the_captured_graph_at_the_same_stage() -> None:
    """A kernel written once as an OptimizedBackend subclass that breaks gather: `run` (eager,
    validated) and `graph` (captured, replayed) both name gather."""
    spec = "tests.tester.wrong_backends:TopkWeightsIgnored"
    problem = GPU.replace(grouped_layout=PSUM)
    run = verify(problem, backend=spec, engine=Engine.DEEPGEMM, mode="isolated")
    assert run.first_failure == "gather", run.to_summary()
    report = verify_graph(
        problem,
        replays=[REPLAYS["capture-softmax"], REPLAYS["skew"]],
        engine=Engine.DEEPGEMM,
        backend=production_backend(spec, Engine.DEEPGEMM),
    )
    assert report.captured and not report.host_reads, report.capture_note
    assert [r.first_failure for r in report.replays] == ["gather", "gather"], report.to_summary()
