"""`moe-verify bench --production`'s plumbing on a CPU: eager timing, no DeepGEMM, no verdicts
(the numbers are not performance: docs/perf.md has the H200's). The byte floor and the targets'
logic are checked on hand-counted and synthetic numbers, so each can fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_verify.cli import main
from moe_verify.production.bench_production import bench_decode, bench_production
from moe_verify.production.report import Environment, ProductionBench
from moe_verify.production.targets import (
    CPU_TIMING,
    DECODE_VS_GEMMS,
    FORWARD_VS_FLOOR,
    GEMM_VS_DEEPGEMM,
    GRAPH_TIMING,
    MEMORY_BANDWIDTH,
    Target,
    Traffic,
    Verdict,
    floor_bytes,
    gemm_row,
    memory_row,
)
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import production_backend, run_one_stage
from moe_verify.spec import MoEProblem, Stage, StageContext, Trace
from optimized import OptimizedBackend, deepgemm
from optimized.production import forward_stages
from reference.moe import ReferenceBackend
from reference.topology import placement

pytestmark = pytest.mark.cpu

# Every expert on the one rank; A = 16 keeps M_sum at 80 rows under the interpreter.
TINY = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=16)


# The tiny problem by hand: T = 8 tokens, all 16 slots on the rank, H = I = 128, one fp32 scale
# (4 bytes) per 128 columns.
TINY_FLOORS = {
    "quant_input": 8 * 128 * 2 + 8 * 128 + 4 * 8 * 128 // 128,
    "permute": 8 * (128 + 4) + 16 * (128 + 4),
    "act_quant": 16 * 256 * 2 + 16 * (128 + 4),
    "gather": 16 * 128 * 2 + 8 * 128 * 2,
}


def test_tiny_problem_end_to_end_on_the_cpu() -> None:
    """One run checked whole (each interpreted forward costs a second): every stage timed, the
    floors it recorded, DeepGEMM's absence explained, verification apart, the markdown."""
    bench = bench_production(TINY, repeats=1)
    stages = [s.value for s in forward_stages(TINY)]
    assert [r.stage for r in bench.stages] == stages
    assert all(r.median_us > 0 for r in bench.stages)
    assert bench.forward_us > 0 and bench.timing == CPU_TIMING
    assert all(r.verdict is Verdict.NA for r in bench.stages)  # nothing judged off the GPU
    assert bench.launches is None and "no CUDA device" in bench.launch_note

    floors = {r.stage: r.floor_bytes for r in bench.stages if r.floor_bytes is not None}
    assert floors == TINY_FLOORS
    assert bench.floor_us == pytest.approx(sum(TINY_FLOORS.values()) / bench.bandwidth * 1e6)

    gemms = [r for r in bench.stages if r.stage in ("gemm1", "gemm2")]
    assert [r.deepgemm_us for r in gemms] == [None, None]
    assert all(deepgemm.probe().reason in r.note for r in gemms)
    assert bench.gemms_alone_us is None and bench.forward_vs_bound is None

    assert [v.stage for v in bench.verification] == stages
    assert all(v.median_us > 0 and v.unchecked_us > 0 for v in bench.verification)
    reads = {v.stage: v.host_reads for v in bench.verification}
    # align's id-range check reads once on the host; quant_input has no value check to read
    assert reads["align"] >= 1 and reads["quant_input"] == 0, reads

    text = bench.to_markdown()
    assert TINY.id in text and CPU_TIMING in text
    assert bench.environment.date in text and f"torch {torch.__version__}" in text
    assert all(f"| {stage} |" in text for stage in stages)
    assert "| whole forward |" in text and "Verification mode" in text
    assert "| without host checks us | host reads |" in text
    assert bench.verification_forward_us > 0
    assert "The verification-mode forward" in text and "the production forward." in text
    assert MEMORY_BANDWIDTH.text in text and GEMM_VS_DEEPGEMM.text in text


@pytest.mark.parametrize("topology", ["ep:2+ll", "ep:2+ht"])
def test_traffic_counts_only_this_ranks_slots(topology: str) -> None:
    problem = TINY.replace(topology=topology)
    bench = bench_production(problem, rank=1, repeats=1, verification=False)
    stages = forward_stages(problem)
    assert [r.stage for r in bench.stages] == [s.value for s in stages]
    # The golden's routing, counted here: slots on rank 1's experts (the LL capacity of 128
    # rows drops none of 16 slots).
    x = make_inputs(problem)
    ids = run_one_stage(
        ReferenceBackend(), "route", problem.replace(topology="ep:2"), x, Trace("g"), 1
    )
    ids = ids["topk_ids"]
    hosted = torch.tensor(placement(problem)[1])
    live = torch.isin(ids, hosted)
    received = int(live.any(dim=1).sum())
    t = bench.traffic
    assert (t.live_slots, t.live_tokens) == (int(live.sum()), received)
    assert t.tokens == (received if topology.endswith("ht") else problem.tokens)


def test_decode_rows_one_per_size() -> None:
    decode = bench_decode(TINY, tokens=(1, 2), repeats=1)
    assert [r.tokens for r in decode.rows] == [1, 2]
    assert all(r.forward_us > 0 and r.forward_vs_gemms is None for r in decode.rows)
    assert all(r.forward_verdict(DECODE_VS_GEMMS) is Verdict.NA for r in decode.rows)
    text = decode.to_markdown()
    assert "| 1 |" in text and "| 2 |" in text and deepgemm.probe().reason in text


# -- the byte floor by hand ---------------------------------------------------------------------

# Distinct numbers for each term, so a swapped term changes the count.
TRAFFIC = Traffic(
    tokens=8,
    live_tokens=6,
    live_slots=10,
    hidden=256,
    intermediate=384,
    a1_scale_row=8,
    a2_scale_row=12,
)
HAND = {
    "quant_input": 8 * 256 * 2 + 8 * 256 + 8 * 8,  # bf16 in; fp8 out + scales
    "permute": 6 * (256 + 8) + 10 * (256 + 8),  # each received row read once, each slot written
    "dispatch": 6 * (256 + 8) + 10 * (256 + 8),  # the same rows as permute, batched
    "act_quant": 10 * 768 * 2 + 10 * (384 + 12),  # live mm1 rows in; live a2q rows + scales out
    "gather": 10 * 256 * 2 + 8 * 256 * 2,  # live mm2 rows in; every token's bf16 row out
}


@pytest.mark.parametrize("stage", list(HAND))
def test_floor_bytes_by_hand(stage: str) -> None:
    assert floor_bytes(stage, TRAFFIC) == HAND[stage]


def test_floor_bytes_refuses_a_stage_without_a_floor() -> None:
    with pytest.raises(ValueError, match="floor_bytes: stage.*'gemm1'"):
        floor_bytes("gemm1", TRAFFIC)


# -- the targets on synthetic numbers -----------------------------------------------------------

VERDICTS = [
    # (target, value, T, verdict)
    pytest.param(GEMM_VS_DEEPGEMM, 1.04, 4096, Verdict.MET, id="gemm-under-limit"),
    pytest.param(GEMM_VS_DEEPGEMM, 1.05, 4096, Verdict.MET, id="gemm-at-limit"),
    pytest.param(GEMM_VS_DEEPGEMM, 1.06, 4096, Verdict.NOT_MET, id="gemm-over-limit"),
    pytest.param(GEMM_VS_DEEPGEMM, None, 4096, Verdict.NA, id="gemm-no-value"),
    pytest.param(MEMORY_BANDWIDTH, 0.71, 512, Verdict.MET, id="bandwidth-above"),
    pytest.param(MEMORY_BANDWIDTH, 0.69, 512, Verdict.NOT_MET, id="bandwidth-below"),
    pytest.param(MEMORY_BANDWIDTH, float("nan"), 512, Verdict.NA, id="bandwidth-nan"),
    pytest.param(FORWARD_VS_FLOOR, 1.10, 512, Verdict.MET, id="forward-T512-under"),
    pytest.param(FORWARD_VS_FLOOR, 1.20, 4096, Verdict.NOT_MET, id="forward-T4096-over"),
    pytest.param(FORWARD_VS_FLOOR, 1.20, 1024, Verdict.NA, id="forward-T1024-not-stated"),
    pytest.param(DECODE_VS_GEMMS, 1.29, 1, Verdict.MET, id="decode-T1-under"),
    pytest.param(DECODE_VS_GEMMS, 1.31, 128, Verdict.NOT_MET, id="decode-T128-over"),
    pytest.param(DECODE_VS_GEMMS, 1.10, 512, Verdict.NA, id="decode-T512-not-stated"),
]


@pytest.mark.parametrize(("target", "value", "tokens", "verdict"), VERDICTS)
def test_target_verdict(target: Target, value: float | None, tokens: int, verdict: Verdict) -> None:
    assert target.judge(value, tokens) is verdict


ROWS = [
    # memory stage: 1 MB in 1 ms at 1.25 GB/s (its floor is 0.8 ms): 80% of copy bandwidth
    pytest.param(1e-3, 1.25e9, True, Verdict.MET, id="memory-80pct"),
    pytest.param(1e-3, 2.5e9, True, Verdict.NOT_MET, id="memory-40pct"),
    pytest.param(1e-3, 1.25e9, False, Verdict.NA, id="memory-not-judged"),
]


@pytest.mark.parametrize(("seconds", "bandwidth", "judged", "verdict"), ROWS)
def test_memory_row_judges_its_fraction(
    seconds: float, bandwidth: float, judged: bool, verdict: Verdict
) -> None:
    row = memory_row(Stage.GATHER, seconds, 1_000_000, bandwidth, 4096, judged)
    assert row.of_bandwidth == pytest.approx(1e6 / bandwidth / seconds)
    assert row.verdict is verdict


def test_dispatch_has_a_floor_but_no_target() -> None:
    row = memory_row(Stage.DISPATCH, 1e-3, 1_000_000, 1.25e9, 4096, True)
    assert row.floor_bytes == 1_000_000 and row.verdict is Verdict.NA and "DeepEP" in row.note


@pytest.mark.parametrize(
    ("deepgemm_seconds", "verdict"),
    [
        pytest.param(0.97e-3, Verdict.MET, id="gemm-3pct-over"),
        pytest.param(0.90e-3, Verdict.NOT_MET, id="gemm-11pct-over"),
        pytest.param(None, Verdict.NA, id="gemm-no-deepgemm"),
    ],
)
def test_gemm_row_judges_its_ratio(deepgemm_seconds: float | None, verdict: Verdict) -> None:
    row = gemm_row(Stage.GEMM1, 1e-3, deepgemm_seconds, "no GPU here", 4096, True)
    assert row.verdict is verdict
    if deepgemm_seconds is None:
        assert row.vs_deepgemm is None and "no GPU here" in row.note
    else:
        assert row.vs_deepgemm == pytest.approx(1e-3 / deepgemm_seconds)


def _synthetic(tokens: int, forward_us: float, timing: str = GRAPH_TIMING) -> ProductionBench:
    """A graph-timed bench with GEMMs alone 800 us and a byte floor of 200 us."""
    return ProductionBench(
        problem=TINY.replace(tokens=tokens), rank=0, engine="deepgemm", layout="psum",
        timing=timing, repeats=1, environment=Environment("2026-01-01", "H200", "t", "t", "d"),
        bandwidth=4e12, traffic=Traffic(tokens, tokens, 2 * tokens, 128, 128, 4, 4),
        m_sum_rows=2 * tokens, stages=(), forward_us=forward_us, gemms_alone_us=800.0,
        floor_us=200.0, launches=12, memops=0, launch_note="",
    )  # fmt: skip


FORWARDS = [
    # (T, forward us, target, verdict): the bound is 1000 us with the floor, 800 us without
    pytest.param(4096, 1100.0, FORWARD_VS_FLOOR, Verdict.MET, id="prefill-1.10x"),
    pytest.param(512, 1200.0, FORWARD_VS_FLOOR, Verdict.NOT_MET, id="prefill-1.20x"),
    pytest.param(32, 1000.0, DECODE_VS_GEMMS, Verdict.MET, id="decode-1.25x"),
    pytest.param(32, 1100.0, DECODE_VS_GEMMS, Verdict.NOT_MET, id="decode-1.375x"),
]


@pytest.mark.parametrize(("tokens", "forward_us", "target", "verdict"), FORWARDS)
def test_forward_verdict(tokens: int, forward_us: float, target: Target, verdict: Verdict) -> None:
    bench = _synthetic(tokens, forward_us)
    assert bench.forward_verdict(target) is verdict
    if target is FORWARD_VS_FLOOR:  # the whole-forward table shows it
        assert f"| {verdict} |" in bench.to_markdown()


def test_eager_times_are_never_judged() -> None:
    assert _synthetic(512, 1200.0, CPU_TIMING).forward_verdict(FORWARD_VS_FLOOR) is Verdict.NA


BAD = [
    pytest.param(
        lambda: bench_production(TINY, rank=1), r"rank \(topology", id="rank-past-topology"
    ),
    pytest.param(lambda: bench_production(TINY, repeats=0), "repeats", id="repeats-zero"),
    pytest.param(lambda: bench_production(TINY.replace(tokens=0)), "tokens", id="no-tokens"),
    pytest.param(lambda: bench_production(TINY, engine="cutlass"), "engine", id="bad-engine"),
    pytest.param(lambda: bench_decode(TINY, tokens=()), "tokens", id="decode-no-sizes"),
    pytest.param(lambda: bench_decode(TINY, tokens=(0,)), r"tokens\[\]", id="decode-size-zero"),
    pytest.param(
        lambda: bench_production(TINY, backend="nope"), "no backend named 'nope'", id="backend"
    ),
]


@pytest.mark.parametrize(("call", "names"), BAD)
def test_bad_arguments_are_named(call: Callable[[], object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        call()


def test_problem_must_be_a_problem() -> None:
    with pytest.raises(TypeError, match="problem: expected a MoEProblem"):
        bench_production("tp:1")


class CountsGathers(OptimizedBackend):
    """The optimized path, counting the calls of its gather: production mode must run it."""

    calls = 0

    def gather(self, ctx: StageContext) -> dict[str, object]:
        type(self).calls += 1
        return super().gather(ctx)


def test_production_times_the_backend_it_is_given() -> None:
    """bench --production runs the class `run --backend` takes: the forward, the op and the
    stage timing all call its gather (none of it is the built-in forward)."""
    CountsGathers.calls = 0
    name = production_backend("tests.production.test_bench_production:CountsGathers")
    bench = bench_production(TINY, repeats=1, verification=False, backend=name)
    assert bench.forward_us > 0
    # the tapped forward, gather's warm-up and timed call, the op's warm-up and timed call
    assert CountsGathers.calls >= 5, CountsGathers.calls


def test_cli_backend_needs_production(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-T", "8", "--backend", "optimized"]) == 2
    assert "--backend: needs --production" in capsys.readouterr().err
